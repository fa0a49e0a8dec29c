"""What one benchmark configuration runs on: sizes, and host arrays every implementation shares.

Slots are distinct live slots drawn at random (fixed seed) from 1..R-1; tokens and lengths are
positive. A MIXED batch has prefill rows first (real ids) and decode rows last (sentinels),
with 2*B flat tokens. Every implementation converts these same arrays to its own framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

OPS = (
    "publish",
    "stash",
    "stash_spec",
    "resolve_decode",
    "resolve_mixed",
    "resolve_spec",
    "invalidate",
    "step",
)
"""Measured ops; `step` is resolve + publish + stash + invalidate in docs/CONTRACT.md order."""

SPEC_OPS = ("stash_spec", "resolve_spec", "step")
"""Ops measured on a spec map (publish and invalidate do not change with spec)."""

PLAIN_OPS = tuple(op for op in OPS if op not in ("stash_spec", "resolve_spec"))
"""Ops measured on a map without spec extras."""

VOCAB = 32000


@dataclass(frozen=True)
class Config:
    """One point of a sweep.

    Attributes:
      batch: B, rows per batch (distinct live slots).
      pool: R, slots of the request pool (slot 0 is padding).
      spec: spec extras on (topk_p, topk_index, hidden_states).
      dtype: "int32" or "int64", the buffers' int dtype.
      topk, hidden, hidden_dtype: spec shapes (K, H, "bfloat16").
    """

    batch: int
    pool: int
    spec: bool = False
    dtype: str = "int32"
    topk: int = 8
    hidden: int = 4096
    hidden_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.batch < 1 or self.batch > self.pool - 1:
            raise ValueError(f"batch {self.batch} needs 1..R-1 live slots, R={self.pool}")
        if self.batch & (self.batch - 1):
            raise ValueError(f"batch {self.batch} must be a power of two (a bucket size)")

    @property
    def tokens_mixed(self) -> int:
        """Flat tokens of the MIXED batch: 2B (B for B=1)."""
        return 2 * self.batch if self.batch > 1 else 1

    def ops(self) -> tuple[str, ...]:
        """The ops measured for this configuration."""
        return SPEC_OPS if self.spec else PLAIN_OPS

    def label(self) -> str:
        """Short human label, e.g. 'B=256 R=4096 int32 spec'."""
        s = f"B={self.batch} R={self.pool} {self.dtype}"
        return s + (f" spec(K={self.topk},H={self.hidden})" if self.spec else "")


class HostData(NamedTuple):
    """Host (numpy) arrays of one configuration, shared by every implementation."""

    idx: np.ndarray  # [B] slots
    tokens: np.ndarray  # [B] sampled tokens
    lens: np.ndarray  # [B] new sequence lengths
    mixed_ids: np.ndarray  # [T] prefill ids then decode sentinels
    mixed_lens: np.ndarray  # [B] real lengths (MIXED lengths are restored by the host)
    topk_p: np.ndarray  # [B, K] float32
    topk_index: np.ndarray  # [B, K] int
    hidden: np.ndarray  # [B, H] float32 values, cast to the hidden dtype by each framework


def host_data(cfg: Config, seed: int = 0) -> HostData:
    """Deterministic host arrays for `cfg`."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(cfg.dtype)
    b = cfg.batch
    idx = (rng.permutation(cfg.pool - 1)[:b] + 1).astype(dt)
    tokens = rng.integers(0, VOCAB, b).astype(dt)
    lens = rng.integers(1, 4096, b).astype(dt)
    n_pre = b // 2
    n_dec = b - n_pre
    prefill = rng.integers(0, VOCAB, cfg.tokens_mixed - n_dec).astype(dt)
    mixed_ids = np.concatenate([prefill, -idx[n_pre:]]).astype(dt)
    k = cfg.topk if cfg.spec else 1
    h = cfg.hidden if cfg.spec else 1
    topk_p = rng.random((b, k), dtype=np.float32)
    topk_index = rng.integers(0, VOCAB, (b, k)).astype(dt)
    hidden = rng.standard_normal((b, h), dtype=np.float32)
    return HostData(idx, tokens, lens, mixed_ids, lens.copy(), topk_p, topk_index, hidden)


def min_bytes(cfg: Config, op: str) -> int:
    """Bytes an op must move at the least: its batch inputs, the rows it gathers or
    scatters, and its outputs. Independent of R: an in-place op moves no more."""
    b, t = cfg.batch, cfg.tokens_mixed
    d = np.dtype(cfg.dtype).itemsize
    k, h = cfg.topk, cfg.hidden
    hd = 2 if cfg.hidden_dtype in ("bfloat16", "float16") else 4
    row_spec = d + 4 * k + d * k + hd * h  # bonus, topk_p, topk_index, hidden per row
    sizes = {
        "publish": b * d + 2 * b * d,  # idx, lens in, lens rows written
        "stash": b * d + 2 * b * d,
        "stash_spec": b * d + 2 * b * row_spec,
        "resolve_decode": b * d + 3 * b * d + 2 * b * d,  # idx; ids in/gathered/out; lens
        "resolve_mixed": b * d + 3 * t * d + 2 * b * d,
        "resolve_spec": b * d + 2 * b * row_spec + 2 * b * d,
        "invalidate": b * d + 2 * b * d,
    }
    if op == "step":
        if cfg.spec:
            return (
                sizes["resolve_spec"] + sizes["publish"] + sizes["stash_spec"] + sizes["invalidate"]
            )
        return sizes["resolve_decode"] + sizes["publish"] + sizes["stash"] + sizes["invalidate"]
    return sizes[op]
