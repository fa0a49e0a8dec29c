"""What one benchmark configuration runs on: sizes, protocol, and host arrays every
implementation shares.

Slots are distinct live slots drawn at random (fixed seed) from 1..R-1; tokens and lengths are
positive. A MIXED batch has prefill rows first (real ids) and decode rows last, with 2*B flat
tokens: in the sentinel protocol the decode rows' ids are sentinels; in the gather protocol
the batch brings the prefill ids and the running rows' slots (docs/CONTRACT.md, 'Two
protocols'). Every implementation converts these same arrays to its own framework.
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
"""Measured ops; `step` is resolve + publish + stash (+ invalidate in the sentinel protocol),
in docs/CONTRACT.md order."""

PROTOCOLS = ("sentinel", "gather")
"""The relay protocols (docs/CONTRACT.md, 'Two protocols'); the gather protocol has no
invalidate."""

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
      protocol: "sentinel" or "gather", the relay protocol of every map built for it.
      spec_kernel: how fm_jax's spec maps move their fields (`SpecConfig.kernel`).
    """

    batch: int
    pool: int
    spec: bool = False
    dtype: str = "int32"
    topk: int = 8
    hidden: int = 4096
    hidden_dtype: str = "bfloat16"
    protocol: str = "sentinel"
    spec_kernel: str = "xla"

    def __post_init__(self) -> None:
        if self.batch < 1 or self.batch > self.pool - 1:
            raise ValueError(f"batch {self.batch} needs 1..R-1 live slots, R={self.pool}")
        if self.batch & (self.batch - 1):
            raise ValueError(f"batch {self.batch} must be a power of two (a bucket size)")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")

    @property
    def gather(self) -> bool:
        """The gather protocol: no sentinels, no invalidate."""
        return self.protocol == "gather"

    @property
    def tokens_mixed(self) -> int:
        """Flat tokens of the MIXED batch: 2B (B for B=1)."""
        return 2 * self.batch if self.batch > 1 else 1

    def ops(self) -> tuple[str, ...]:
        """The ops measured for this configuration (the gather protocol has no invalidate)."""
        ops = SPEC_OPS if self.spec else PLAIN_OPS
        return tuple(op for op in ops if not (self.gather and op == "invalidate"))

    def label(self) -> str:
        """Short human label, e.g. 'B=256 R=4096 int32 spec(K=8,H=4096) gather' (a spec
        kernel other than xla named after the spec)."""
        s = f"B={self.batch} R={self.pool} {self.dtype}"
        s += f" spec(K={self.topk},H={self.hidden})" if self.spec else ""
        s += f" {self.spec_kernel}" if self.spec and self.spec_kernel != "xla" else ""
        return s + (" gather" if self.gather else "")


class HostData(NamedTuple):
    """Host (numpy) arrays of one configuration, shared by every implementation."""

    idx: np.ndarray  # [B] slots
    tokens: np.ndarray  # [B] sampled tokens
    lens: np.ndarray  # [B] new sequence lengths
    mixed_ids: np.ndarray  # [T] prefill ids then decode sentinels (sentinel protocol)
    mixed_lens: np.ndarray  # [B] real lengths (MIXED lengths are restored by the host)
    topk_p: np.ndarray  # [B, K] float32
    topk_index: np.ndarray  # [B, K] int
    hidden: np.ndarray  # [B, H] float32 values, cast to the hidden dtype by each framework
    mixed_prefill: np.ndarray  # [T - M] the prefill ids alone (gather protocol)
    mixed_running: np.ndarray  # [M] slots of the running rows, in row order (gather protocol)

    def mixed_token_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """The gather protocol's MIXED batch in fm_jax's per-token layout: ids [T] (the
        prefill ids, then 0 at each running row's position) and token slots [T] (0 at the
        prefill positions, then each running row's slot)."""
        n_pre, n_run = len(self.mixed_prefill), len(self.mixed_running)
        ids = np.concatenate([self.mixed_prefill, np.zeros(n_run, self.mixed_prefill.dtype)])
        slots = np.concatenate([np.zeros(n_pre, self.mixed_running.dtype), self.mixed_running])
        return ids, slots


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
    # The running rows are the last n_dec rows: their sentinels and their slots name the same.
    mixed_ids = np.concatenate([prefill, -idx[n_pre:]]).astype(dt)
    k = cfg.topk if cfg.spec else 1
    h = cfg.hidden if cfg.spec else 1
    topk_p = rng.random((b, k), dtype=np.float32)
    topk_index = rng.integers(0, VOCAB, (b, k)).astype(dt)
    hidden = rng.standard_normal((b, h), dtype=np.float32)
    return HostData(
        idx, tokens, lens, mixed_ids, lens.copy(), topk_p, topk_index, hidden, prefill, idx[n_pre:]
    )


def min_bytes(cfg: Config, op: str) -> int:
    """Bytes an op must move at the least: its batch inputs, the rows it gathers or
    scatters, and its outputs. Independent of R: an in-place op moves no more."""
    b, t = cfg.batch, cfg.tokens_mixed
    m = b - b // 2  # running rows of the MIXED batch
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
        "resolve_spec": b * d + 2 * b * row_spec + 2 * b * d,  # lengths gathered in both
        "invalidate": b * d + 2 * b * d,
    }
    if cfg.gather:  # no ids in, no sentinels; the host's lengths pass through untouched
        sizes["resolve_decode"] = b * d + 2 * b * d  # idx; ids gathered/out
        sizes["resolve_mixed"] = (t - m) * d + 2 * m * d + t * d  # prefill, slots, gathered, out
        sizes["invalidate"] = 0
    if op == "step":
        resolve, stash = ("resolve_spec", "stash_spec") if cfg.spec else ("resolve_decode", "stash")
        return sizes[resolve] + sizes["publish"] + sizes[stash] + sizes["invalidate"]
    return sizes[op]
