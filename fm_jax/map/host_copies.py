"""Host copies the device starts and the host reads without a stall: the last published
lengths (`HostLengths`) and the confidence ring (`ConfidenceRing`).

Lengths. A publish starts the host copy of its lengths (`jax.Array.copy_to_host_async`: a
copy in flight, not a wait) and keeps it with the slots it was published at, as SGLang
copies them on a side stream into pinned memory gated on the publish; a later
`resolve_seq_lens_cpu` of exactly those slots takes the copy, waiting only for the
computation that produced them, not for everything queued. Host lengths given to a publish
are kept as a host copy (the caller may refill its arrays). Only the most recent publish is
kept: a read of other slots, or after another publish, gathers from the buffer. A caller's
device lengths may be donated or deleted after the call: the copy goes with them, and the
read gathers from the map's buffer, which holds the same lengths.

Confidence (DSpark). A publish with confidence rows writes them into the map's confidence
buffer ([R, gamma] float32, as its bits) and returns a copy of the whole buffer; the ring
takes each local DP rank's block and starts its host copy. It keeps the last `DEPTH` blocks
per rank, each with a snapshot of the host's per-slot generation counter at that publish
(SGLang's `req_to_token_pool.req_generation`, bumped when a slot goes to a new request). A
read takes the entry `LAG` publishes back, whose copy has had a whole step to land; it never
waits unless asked (an entry not landed, and the first `LAG` publishes, read as None). The
generation read with a row says which request held the slot when the row was copied. Only
publishes with confidence rows move the ring, and only on the ranks that had rows in them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.host.buckets import Rows
from fm_jax.ops.errors import FutureMapError


class _Published(NamedTuple):
    idx: Rows  # the slots, as placed (host: padded; a jax array: taken as given)
    lens: Any  # the lengths, placed like idx: a host array, or a jax array copying to host


class HostLengths:
    """The most recent publish's lengths (one map; single process)."""

    def __init__(self) -> None:
        self._last: _Published | None = None

    def published(self, idx: Rows, lens: Any) -> None:
        """A publish wrote `lens` at `idx` (both as placed): keep them, a device array with
        its host copy started."""
        if isinstance(lens, jax.Array):
            lens.copy_to_host_async()
        else:  # the caller's own array may be reused for the next batch: keep a copy
            lens = np.array(lens)
        if idx.counts is not None:
            idx = idx._replace(array=np.array(idx.array))
        self._last = _Published(idx, lens)

    def forget(self) -> None:
        """The buffer may no longer hold what was last published (a debug resolve
        consumed it): the next read gathers from the buffer."""
        self._last = None

    def read(self, idx: Rows, subset: bool = False) -> np.ndarray | None:
        """The lengths last published at exactly the slots `idx` (as placed, padded), or
        None when the last publish was at other slots (or there was none). `subset`: host
        slots each among the last publish's (of its rank) do too."""
        last = self._last
        if subset and last is not None and idx.counts is not None:
            return self._among(last, idx)
        if last is None or last.idx.size != idx.size:
            return None
        if idx.counts is None or last.idx.counts is None:  # jax slots: not read, same array
            same = idx.array is last.idx.array
        else:
            same = idx.counts == last.idx.counts and np.array_equal(idx.array, last.idx.array)
        if not same or (isinstance(last.lens, jax.Array) and last.lens.is_deleted()):
            return None  # other slots, or the caller's array donated since: the buffer
        return np.asarray(last.lens)

    @staticmethod
    def _among(last: _Published, idx: Rows) -> np.ndarray | None:
        """Host slots `idx` looked up, rank by rank, among the live slots of `last` (host
        slots too); None when one is not there or the lengths were donated since."""
        counts = last.idx.counts
        if counts is None or idx.counts is None:
            return None
        if isinstance(last.lens, jax.Array) and last.lens.is_deleted():
            return None
        have, lens = np.asarray(last.idx.array), np.asarray(last.lens)
        want = np.asarray(idx.array)
        out = np.zeros(want.shape, lens.dtype)
        s0, s1 = last.idx.size, idx.size
        for d, (n0, n1) in enumerate(zip(counts, idx.counts, strict=True)):
            if not n1:
                continue
            if not n0:
                return None
            slots, got = have[d * s0 : d * s0 + n0], lens[d * s0 : d * s0 + n0]
            w = want[d * s1 : d * s1 + n1]
            order = np.argsort(slots, kind="stable")
            at = np.clip(np.searchsorted(slots, w, sorter=order), 0, n0 - 1)
            if not np.array_equal(slots[order[at]], w):
                return None
            out[d * s1 : d * s1 + n1] = got[order[at]]
        return out


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
