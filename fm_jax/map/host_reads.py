"""A map's reads on the host (`FutureMap.resolve_*_cpu`, under its lock).

Lengths: a publish starts the host copy of its lengths and the runtime keeps it with its
slots (as SGLang copies them on a side stream); a read of those slots takes the copy,
waiting for the publishing step only; any other read gathers from the buffer.

Confidence (DSpark): `ConfidenceRing` keeps each local rank's last `DEPTH` copies of the
buffer, each with the host's per-slot generations; a read takes the entry `LAG` publishes
back (a whole step to land) and never waits unless asked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.host.decisions import Placed, Rows
from fm_jax.host.place import Placement
from fm_jax.host.validate import HostChecks
from fm_jax.ops.checks import FRESH_PUBLISH, host_mode
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.sharding import MeshLayout, per_rank
from fm_jax.ops.types import Batch, ForwardMode, MixedTails, RowsInput


def read_published(last: Any, idx: Rows, subset: bool = False) -> np.ndarray | None:
    """The lengths last published (`last`: slots, lengths) at exactly the slots `idx`
    (`subset`: host slots looked up among its host slots), or None: other slots, none, or
    the lengths donated since."""
    if last is None:
        return None
    published, lens = last
    if isinstance(lens, jax.Array) and lens.is_deleted():
        return None
    if subset and idx.counts is not None:
        return _among(published, lens, idx)
    if published.size != idx.size:
        return None
    if idx.counts is None or published.counts is None:  # jax slots: not read, same array
        same = idx.array is published.array
    else:
        same = idx.counts == published.counts and np.array_equal(idx.array, published.array)
    return np.asarray(lens) if same else None


def _among(published: Rows, lens: Any, idx: Rows) -> np.ndarray | None:
    """Host slots `idx` looked up, rank by rank, among the live slots `published` given with
    `lens`; None when one is not there."""
    if published.counts is None or idx.counts is None:
        return None
    have, lens, want = np.asarray(published.array), np.asarray(lens), np.asarray(idx.array)
    out = np.zeros(want.shape, lens.dtype)
    s0, s1 = published.size, idx.size
    for d, (n0, n1) in enumerate(zip(published.counts, idx.counts, strict=True)):
        if not n1:
            continue
        if not n0:
            return None
        slots, got = have[d * s0 : d * s0 + n0], lens[d * s0 : d * s0 + n0]
        w = want[d * s1 : d * s1 + n1]
        order = np.argsort(slots, kind="stable")
        pos = np.clip(np.searchsorted(slots, w, sorter=order), 0, n0 - 1)
        if not np.array_equal(slots[order[pos]], w):
            return None
        out[d * s1 : d * s1 + n1] = got[order[pos]]
    return out


LAG = 2
"""Publishes back a read looks (SGLang's CONFIDENCE_RELAY_RING_LAG)."""

DEPTH = LAG + 1
"""Entries kept per rank: the one read, the one landing, the one being written."""


class ResolvedConfidence(NamedTuple):
    """A batch's confidence rows ([B, gamma] float32, as published) and each slot's
    generation when its row was copied ([B] int64: the slot's current one only if no new
    request took the slot since)."""

    confidence: np.ndarray
    generation: np.ndarray


class _Entry(NamedTuple):
    rows: jax.Array  # the rank's block of the buffer after one publish, [R, gamma] bits
    generation: np.ndarray  # [R] int64: the rank's generations at that publish


class ConfidenceRing:
    """One map's ring per DP rank of this process, of R = `checks.pool_size` slots per rank."""

    def __init__(self, layout: MeshLayout, checks: HostChecks) -> None:
        self.pool_size = checks.pool_size
        self._checks = checks  # the map's: its slot rule
        self.dp = layout.dp
        self._rank = {dev: layout.rank_of(dev) for dev in layout.mesh.local_devices}
        self.ranks = layout.local_ranks()
        self.clear()

    def clear(self) -> None:
        """No publish yet, as at construction."""
        self._entries = {d: deque[_Entry](maxlen=DEPTH) for d in self.ranks}

    def generations(self, x: Any, idx: Rows) -> dict[int, np.ndarray]:
        """The host's per-slot generation counters given to a publish ([DP*R] ints, or a
        mapping DP rank -> [R]), copied (the snapshot) before anything runs."""
        r = self.pool_size
        if x is None:
            raise FutureMapError(
                "generation is required with confidence: the request pool's per-slot "
                f"generation counter, [{r}] ints per DP rank (SGLang's req_generation)"
            )
        if isinstance(x, Mapping):
            parts = {d: _ints(f"generation[rank {d}]", v, r) for d, v in x.items()}
            missing = {d for d in self.ranks if idx.has_rows(d)} - set(parts)
            if missing:
                raise FutureMapError(f"generation has no counters for DP rank(s) {sorted(missing)}")
            return parts
        a = _ints("generation", x, self.dp * r)
        return {d: a[d * r : (d + 1) * r] for d in self.ranks}

    def issue(self, rows: jax.Array, generation: Mapping[int, np.ndarray], idx: Rows) -> None:
        """A publish wrote confidence rows at `idx` and returned the buffer `rows`: each
        local rank with rows there rings its block, its host copy started."""
        blocks: dict[int, jax.Array] = {}
        for shard in rows.addressable_shards:  # one replica per rank
            d = self._rank[shard.device]
            if d not in blocks and idx.has_rows(d):
                blocks[d] = shard.data  # an idle rank: no copy, as in SGLang's per-rank map
        for d, block in blocks.items():
            block.copy_to_host_async()
            self._entries[d].append(_Entry(block, generation[d]))

    def read(self, rank: int, slots: np.ndarray, wait: bool) -> ResolvedConfidence | None:
        """Rank `rank`'s rows at `slots` from the entry LAG publishes back; None before
        LAG publishes, for no slots, or (unless `wait`) while that entry's copy is not done."""
        entries = self._entries[rank]
        if len(entries) < LAG or slots.size == 0:
            return None
        entry = entries[-LAG]
        if not wait and not entry.rows.is_ready():  # type: ignore[attr-defined]  # not in the stubs
            return None
        block = np.asarray(entry.rows)
        return ResolvedConfidence(block[slots].view(np.float32), entry.generation[slots].copy())

    def slots(self, name: str, x: Any) -> np.ndarray:
        """Host slots of a read, int64, checked by the map's slot rule (`HostChecks.slots`)."""
        a = np.asarray(x)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise FutureMapError(f"{name} must be 1-D host ints (slots), got {a.dtype} {a.shape}")
        a = a.astype(np.int64)
        self._checks.slots(name, a)
        return a


def _ints(name: str, x: Any, n: int) -> np.ndarray:
    """`x` as a fresh int64 host array of shape [n]; FutureMapError naming `name`."""
    if isinstance(x, jax.Array):
        raise FutureMapError(f"{name} must be host ints (the host's counters), got a jax array")
    a = np.asarray(x)
    if a.shape != (n,) or a.dtype.kind not in "iu":
        raise FutureMapError(f"{name} must be [{n}] ints, got {a.dtype} {a.shape}")
    return a.astype(np.int64)


Lengths = np.ndarray | dict[int, np.ndarray]
Run = Callable[[Placed, str], Any]
"""The map's `run(placed, op)` (passed with each read, not held: no reference cycle)."""


def seq_lens(
    placement: Placement, runtime: Any, run: Run, indices: RowsInput, rows: int | None
) -> Lengths:
    """`FutureMap.resolve_seq_lens_cpu`. Debug, spec: a read consumes the last publish of
    each rank it reads, which no read may have consumed before ('fresh publish', SGLang's
    consume-once wait)."""
    placed = placement.slots_op("seq_lens_at", indices, rows)
    armed = runtime.armed  # per DP rank: a publish came since the last read; debug, spec
    for d in range(len(armed) if armed is not None else 0):
        if not placed.idx.has_rows(d):
            continue
        if not armed[d]:
            runtime.debug.host_violation(
                runtime.step,
                "resolve_seq_lens_cpu",
                FRESH_PUBLISH,
                "a read of lengths waited for a publish that an earlier read already "
                "consumed, or that never came",
                d,
            )
        armed[d] = False
    return _lengths(placement, runtime, run, placed)


def _lengths(
    placement: Placement, runtime: Any, run: Run, placed: Placed, subset: bool = False
) -> Lengths:
    """`new_seq_lens` at the placed slots, on the host: the last publish's copy, else
    gathered; then the debug check."""
    inputs, layout = placement.inputs, placement.inputs.layout
    host = read_published(runtime.last_published, placed.idx, subset)
    if host is None:  # not the slots last published: gathered
        out = run(placed, "resolve_seq_lens_cpu")
        if inputs.single_process:
            host = np.asarray(jax.device_get(out))
        else:
            blocks = per_rank(out, layout)
            size = placed.idx.size
            host = np.concatenate(
                [blocks.get(d, np.zeros(size, inputs.dtype)) for d in range(layout.dp)]
            )
    runtime.check()
    return inputs.unpad(host, placed.idx)


def mixed_tails(
    placement: Placement, runtime: Any, run: Run, batch: Any, prefix_lens: Any
) -> MixedTails | dict[int, MixedTails]:
    """`FutureMap.resolve_mixed_tails_cpu`: every argument checked before the read (the
    batch as `resolve` checks it, nothing run; the host lengths it rebinds >= 0)."""
    if placement.spec is None or not placement.protocol.serves_spec_mixed:
        raise FutureMapError(
            "resolve_mixed_tails_cpu: a spec MIXED batch is a feature of a spec map of "
            "the gather protocol"
        )
    by_rank = isinstance(batch, Mapping)
    if not by_rank and placement.inputs.dp > 1:
        raise FutureMapError(
            "resolve_mixed_tails_cpu: a map of several DP ranks takes a mapping DP rank -> Batch"
        )
    if prefix_lens is not None and isinstance(prefix_lens, Mapping) != by_rank:
        raise FutureMapError("prefix_lens must be given in the form of the batch")
    batches = dict(batch) if by_rank else {0: batch}
    prefixes = {} if prefix_lens is None else prefix_lens if by_rank else {0: prefix_lens}
    rows, running = {}, {}
    for d, b in batches.items():
        where = f"batch[rank {d}]." if by_rank else "batch."
        rows[d] = _mixed_rows(b, where, prefixes.get(d), prefix_lens is not None)
    placement.resolve(batch)  # resolve's own checks of the batch (placed; nothing runs)
    for d, (_, lens, ts, pre) in rows.items():
        where, rank = (f"batch[rank {d}].", f"[rank {d}]") if by_rank else ("batch.", "")
        for name, x in ((f"{where}seq_lens", lens), (f"prefix_lens{rank}", pre)):
            if x is not None:  # host lengths, rebound and summed: >= 0
                placement.inputs.checks.check("relayed", name, x, np.dtype(np.int64))
        running[d] = ts[ts > 0]
    got: Any = {}
    if any(len(x) for x in running.values()):
        placed = placement.slots_op("seq_lens_at", running if by_rank else running[0], None)
        got = _lengths(placement, runtime, run, placed, subset=True)
    if not by_rank:
        got = {0: got}
    out = {d: _rebind(*rows[d], got.get(d)) for d in batches}
    return out if by_rank else out[0]


def confidence(
    runtime: Any, indices: Any, wait: bool
) -> ResolvedConfidence | None | dict[int, ResolvedConfidence | None]:
    """`FutureMap.resolve_confidence_cpu`: the ring's rows at `indices`, per rank for
    a mapping; refused on a map with no confidence relay."""
    ring = runtime.confidence
    if ring is None:
        raise FutureMapError(
            "resolve_confidence_cpu: the map relays no confidence; declare its width, "
            "SpecConfig(..., confidence=gamma)"
        )
    if not isinstance(wait, bool):
        raise FutureMapError(f"wait must be a bool, got {wait!r}")
    if isinstance(indices, Mapping):
        unknown = sorted(set(indices) - set(ring.ranks))
        if unknown:
            raise FutureMapError(f"indices names DP rank(s) {unknown}, not this process's")
        slots = {d: ring.slots(f"indices[rank {d}]", s) for d, s in indices.items()}
        return {d: ring.read(d, s, wait) for d, s in slots.items()}
    if ring.dp > 1:
        raise FutureMapError(
            "resolve_confidence_cpu on a map of several DP ranks takes a mapping DP rank -> slots"
        )
    return ring.read(0, ring.slots("indices", indices), wait)


def _mixed_rows(
    batch: Batch, where: str, prefix: Any, prefixed: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """A host spec MIXED batch's (slots, host lengths, token slots, prefix lengths)."""
    if not isinstance(batch, Batch):
        raise FutureMapError(f"{where[:-1]} must be a Batch, got {type(batch).__name__}")
    if host_mode(batch.forward_mode, f"{where}forward_mode") != ForwardMode.MIXED:
        raise FutureMapError(f"{where}forward_mode must be MIXED: only it has running rows")
    idx, lens, ts = (
        _host_ints(f"{where}{name}", getattr(batch, name))
        for name in ("req_pool_indices", "seq_lens", "token_slots")
    )
    pre = _host_ints(f"{where}prefix_lens", prefix) if prefixed else None
    for name, x in (("seq_lens", lens), ("prefix_lens", pre)):
        if x is not None and len(x) != len(idx):
            raise FutureMapError(f"{where}{name} has {len(x)} rows, req_pool_indices {len(idx)}")
    return idx, lens, ts, pre


def _host_ints(name: str, x: Any) -> np.ndarray:
    """`x`, 1-D host ints, as int64; FutureMapError naming `name`."""
    a = np.asarray(x) if isinstance(x, np.ndarray | list | tuple) else None
    if a is None or a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise FutureMapError(f"{name} must be 1-D host ints (numpy), got {type(x).__name__}")
    return a.astype(np.int64)


def _rebind(
    idx: np.ndarray, lens: np.ndarray, ts: np.ndarray, prefix: np.ndarray | None, fresh: Any
) -> MixedTails:
    """The running rows (the last live rows) take their published lengths `fresh`: + 1 in
    seq_lens_cpu, as they are in prefix_lens; the sum is over the live rows."""
    live = idx > 0
    n = int(np.count_nonzero(ts))
    seq = lens.copy()
    pre = None if prefix is None else prefix.copy()
    if n:
        rows = np.flatnonzero(live)[-n:]
        published = np.asarray(fresh, np.int64)[:n]
        seq[rows] = published + 1
        if pre is not None:
            pre[rows] = published
    return MixedTails(seq, int(seq[live].sum()), pre)
