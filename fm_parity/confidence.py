"""The confidence relay in parity runs (docs/CONTRACT.md, 'The confidence relay').

A scenario whose spec declares `confidence` (gamma) has every spec DECODE step publish a
confidence row per batch row with its lengths, computed on the host from what the forward
produced (`rows`), with the host's per-slot generation counters (`Scheduler.generation`).
Before its resolve, each spec DECODE step reads its live slots' rows back
(`resolve_confidence_cpu`, waiting for the entry so that runs are deterministic). What a
row's read gave goes into its request's stream (`digest`), so the oracle checks it too:
`Ring` is the reference loop's own model of the ring, with no FutureMap.
"""

from __future__ import annotations

import zlib

import numpy as np

LAG = 2
"""Publishes with confidence back that a read looks (both twins' ring)."""

_QNAN = np.uint32(0x7FC00000)


def rows(tokens: np.ndarray, new_lens: np.ndarray, slots: np.ndarray, gamma: int) -> np.ndarray:
    """[B, gamma] float32 confidence rows of a batch, from each row's token, new length and
    slot: numbers in [0, 1), with -0.0 and NaNs of distinct payloads among them (so a
    row relayed through any cast or arithmetic would differ in its bytes)."""
    t = tokens.astype(np.int64)[:, None]
    n = new_lens.astype(np.int64)[:, None]
    s = slots.astype(np.int64)[:, None]
    j = np.arange(gamma, dtype=np.int64)[None, :]
    u = (t * 31 + n * 7 + s * 13 + j * 101) % 997
    out = (u.astype(np.float32) / np.float32(997.0)).astype(np.float32)
    bits = out.view(np.uint32).copy()
    bits[u % 11 == 3] = np.uint32(0x80000000)  # -0.0
    nan = u % 13 == 5
    bits[nan] = _QNAN | (u[nan] % 251).astype(np.uint32)
    return bits.view(np.float32)


def digest(read: tuple[np.ndarray, np.ndarray] | None, current: np.ndarray) -> list[list[int]]:
    """What each row of a read adds to its request's stream: [-1] when the read gave
    nothing; else [1 if the row's generation is its slot's current one (the request's own
    row) else 0, a CRC of the row's bytes]. `current`: the slots' generations now."""
    if read is None:
        return [[-1] for _ in current]
    conf, gen = read
    return [
        [int(g == c), zlib.crc32(np.ascontiguousarray(r).tobytes())]
        for r, g, c in zip(conf, gen.tolist(), current.tolist(), strict=True)
    ]


class Ring:
    """The reference loop's model of one pool's confidence relay: each slot's last published
    row (zeros until then), and per publish a snapshot of them and of the generations."""

    def __init__(self, pool_size: int, gamma: int) -> None:
        self.buffer = np.zeros((pool_size, gamma), np.float32)
        self.entries: list[tuple[np.ndarray, np.ndarray]] = []

    def publish(self, slots: np.ndarray, conf: np.ndarray, generation: np.ndarray) -> None:
        """Rows `conf` published at `slots`, then the ring's copy with the generations."""
        self.buffer[slots] = conf
        self.entries = [*self.entries[-LAG:], (self.buffer.copy(), generation.copy())]

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Rows and generations at `slots` from LAG publishes back, or None."""
        if len(self.entries) < LAG or not slots.size:
            return None
        buf, gen = self.entries[-LAG]
        return buf[slots], gen[slots]
