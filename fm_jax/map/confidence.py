"""The confidence relay's host side (DSpark): a ring of host copies the host reads without
waiting.

A publish with confidence rows writes them into the map's confidence buffer ([R, gamma]
float32, as its bits) and returns a copy of the whole buffer; the ring takes each local DP
rank's block of it (one device's shard: [R, gamma]) and starts its device-to-host copy
(`jax.Array.copy_to_host_async`). The ring keeps the last `DEPTH` such blocks per DP
rank, each with a snapshot of the host's per-slot generation counter as it stood at that
publish (SGLang's `req_to_token_pool.req_generation`, bumped when a slot goes to a new
request). A read takes the entry `LAG` publishes back: the publish before the last, whose
copy has had a whole step to land. It never waits unless asked: an entry whose copy is not
done yet reads as None, as do the first `LAG` publishes. The generation read with a row says
which request the host had in that slot when the row was copied: a row of a slot reused
since reads with an older generation than the slot's current one.

Only publishes with confidence rows move the ring, and only on the ranks that had rows in
them (an idle rank's ring stays, as SGLang's per-rank map returns before its copy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.host.host_inputs import Rows
from fm_jax.ops.errors import FutureMapError

LAG = 2
"""Publishes back a read looks (SGLang's CONFIDENCE_RELAY_RING_LAG)."""

DEPTH = LAG + 1
"""Entries kept per rank: the one read, the one landing, the one being written."""


class ResolvedConfidence(NamedTuple):
    """A batch's confidence rows as the ring held them, and their generations.

    Attributes:
      confidence: [B, gamma] float32, each slot's row as published (bit for bit).
      generation: [B] int64, each slot's generation when the row was copied: equal to the
        slot's current generation only if no new request took the slot since.
    """

    confidence: np.ndarray
    generation: np.ndarray


class _Entry(NamedTuple):
    rows: jax.Array  # the rank's block of the buffer after one publish, [R, gamma] bits
    generation: np.ndarray  # [R] int64: the rank's generations at that publish


class ConfidenceRing:
    """One map's ring per DP rank of this process.

    Args:
      pool_size: R, slots per rank.
      dp: DP ranks of the map's layout.
      rank_of: the DP rank a device holds (`MeshLayout.rank_of`).
      ranks: this process's ranks.
    """

    def __init__(
        self, pool_size: int, dp: int, rank_of: Callable[[Any], int], ranks: tuple[int, ...]
    ) -> None:
        self.pool_size = pool_size
        self.dp = dp
        self.rank_of = rank_of
        self._entries: dict[int, list[_Entry | None]] = {d: [None] * DEPTH for d in ranks}
        self._pos = dict.fromkeys(ranks, 0)
        self._rank: dict[Any, int] = {}  # device -> its DP rank

    @property
    def ranks(self) -> list[int]:
        """The local DP ranks the ring serves."""
        return list(self._entries)

    def generations(self, x: Any, idx: Rows) -> dict[int, np.ndarray]:
        """The host's per-slot generation counters as given to a publish with confidence at
        `idx` (as placed): [R] ints (one DP rank), [DP*R] (each rank's end to end) or a
        mapping DP rank -> [R] (every rank with rows); copied (the snapshot), before
        anything runs. FutureMapError naming `generation`."""
        r = self.pool_size
        if x is None:
            raise FutureMapError(
                "generation is required with confidence: the request pool's per-slot "
                f"generation counter, [{r}] ints per DP rank (SGLang's req_generation)"
            )
        if isinstance(x, Mapping):
            parts = {d: _ints(f"generation[rank {d}]", v, r) for d, v in x.items()}
            missing = {d for d in self._entries if idx.has_rows(d)} - set(parts)
            if missing:
                raise FutureMapError(f"generation has no counters for DP rank(s) {sorted(missing)}")
            return parts
        a = _ints("generation", x, self.dp * r)
        return {d: a[d * r : (d + 1) * r] for d in self._entries}

    def issue(self, rows: jax.Array, generation: Mapping[int, np.ndarray], idx: Rows) -> None:
        """A publish wrote confidence rows at `idx` (as placed) and returned the buffer
        `rows`: in the ring of every local rank that had rows (all for jax-array slots,
        whose counts are unknown), its block with its host copy started, and its
        generations."""
        blocks: dict[int, jax.Array] = {}
        for shard in rows.addressable_shards:  # one replica per rank
            d = self._rank.get(shard.device)
            if d is None:
                d = self._rank[shard.device] = self.rank_of(shard.device)
            if d not in blocks and d in self._entries and idx.has_rows(d):
                blocks[d] = shard.data  # an idle rank: no copy, as in SGLang's per-rank map
        for d, block in blocks.items():
            block.copy_to_host_async()
            pos = self._pos[d]
            self._entries[d][pos % DEPTH] = _Entry(block, generation[d])
            self._pos[d] = pos + 1

    def read(self, rank: int, slots: np.ndarray, wait: bool) -> ResolvedConfidence | None:
        """Rank `rank`'s rows at `slots` from the entry LAG publishes back; None before
        LAG publishes, for no slots, or (unless `wait`) while that entry's copy is not done."""
        pos = self._pos[rank]
        if pos < LAG or slots.size == 0:
            return None
        entry = self._entries[rank][(pos - LAG) % DEPTH]
        assert entry is not None
        if not wait and not entry.rows.is_ready():  # type: ignore[attr-defined]  # not in the stubs
            return None
        block = np.asarray(entry.rows)
        return ResolvedConfidence(block[slots].view(np.float32), entry.generation[slots].copy())

    def slots(self, name: str, x: Any) -> np.ndarray:
        """Host slots of a read, each in [0, R); FutureMapError naming `name`."""
        a = np.asarray(x)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise FutureMapError(f"{name} must be 1-D host ints (slots), got {a.dtype} {a.shape}")
        a = a.astype(np.int64)
        bad = (a < 0) | (a >= self.pool_size)
        if bad.any():
            raise FutureMapError(
                f"{name} holds slots outside [0, {self.pool_size}): {a[bad].tolist()}"
            )
        live, counts = np.unique(a[a != 0], return_counts=True)
        if (counts > 1).any():
            raise FutureMapError(
                f"{name} holds live slots {live[counts > 1].tolist()} more than once"
            )
        return a


def _ints(name: str, x: Any, n: int) -> np.ndarray:
    """`x` as a fresh int64 host array of shape [n]; FutureMapError naming `name`."""
    if isinstance(x, jax.Array):
        raise FutureMapError(f"{name} must be host ints (the host's counters), got a jax array")
    a = np.asarray(x)
    if a.shape != (n,) or a.dtype.kind not in "iu":
        raise FutureMapError(f"{name} must be [{n}] ints, got {a.dtype} {a.shape}")
    return a.astype(np.int64)
