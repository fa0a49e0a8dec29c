"""A map's reads on the host: the published lengths, a spec MIXED batch's host tails and
the confidence relay's rows.

`HostReads` serves `FutureMap.resolve_seq_lens_cpu`, `resolve_mixed_tails_cpu` and
`resolve_confidence_cpu` (whose docstrings state the rules); the map calls it under its
lock. It places through the map's placement, reads the runtime's host copies (the last
publish's lengths, the confidence ring) and runs a gather, where one is needed, through
the `run` the map passes with each read (its one way of calling an executable; passed,
not held, so that the map and its reads form no reference cycle).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from fm_jax.host.decisions import Placed
from fm_jax.host.place import Placement
from fm_jax.map.host_copies import ResolvedConfidence
from fm_jax.map.runtime import MapRuntime
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.sharding import per_rank
from fm_jax.ops.types import Batch, ForwardMode, MixedTails, RowsInput, host_mode

Lengths = np.ndarray | dict[int, np.ndarray]
Run = Callable[[Placed, str], Any]
"""The map's call of a placed op on its executable: `run(placed, op)`."""


class HostReads:
    """One map's host reads.

    Args:
      placement: the map's placement (slots checked and placed as its ops place them).
      runtime: the map's runtime (host lengths, confidence ring, debug channel).
    """

    def __init__(self, placement: Placement, runtime: MapRuntime) -> None:
        self._placement = placement
        self._runtime = runtime
        self._layout = placement.inputs.layout

    def seq_lens(self, run: Run, indices: RowsInput, rows: int | None) -> Lengths:
        """`FutureMap.resolve_seq_lens_cpu`: debug, spec: the read consumes the fresh
        publish of each rank it reads."""
        placed = self._placement.slots_op("seq_lens_at", indices, rows)
        if self._runtime.armed is not None:  # debug, spec: it waits for a fresh publish
            self._runtime.read_lengths(placed.idx)
        return self._lengths(run, placed)

    def _lengths(self, run: Run, placed: Placed, subset: bool = False) -> Lengths:
        """`new_seq_lens` at the placed slots, on the host: the last publish's copy at
        exactly its slots (`subset`: at slots among them), else gathered; then the debug
        check."""
        inputs, runtime = self._placement.inputs, self._runtime
        lengths = runtime.host_lengths
        copied = None if lengths is None else lengths.read(placed.idx, subset)
        if copied is not None:  # the slots last published: their copy, no gather
            runtime.check()
            return inputs.unpad(copied, placed.idx)
        out = run(placed, "resolve_seq_lens_cpu")
        if inputs.single_process:
            host = np.asarray(jax.device_get(out))
        else:
            blocks = per_rank(out, self._layout)
            size = placed.idx.size
            host = np.concatenate(
                [blocks.get(d, np.zeros(size, inputs.dtype)) for d in range(self._layout.dp)]
            )
        runtime.check()
        return inputs.unpad(host, placed.idx)

    def mixed_tails(
        self, run: Run, batch: Batch | Mapping[int, Batch], prefix_lens: Any
    ) -> MixedTails | dict[int, MixedTails]:
        """`FutureMap.resolve_mixed_tails_cpu`: every argument checked before the read:
        the batch as `resolve` checks it (placed by the same general path, nothing run:
        slots in range, no live slot twice, token slots one per input id, the running rows
        last in token-slot order), and the host lengths it rebinds >= 0."""
        if self._placement.spec is None or not self._placement.protocol.serves_spec_mixed:
            raise FutureMapError(
                "resolve_mixed_tails_cpu: a spec MIXED batch is a feature of a spec map of "
                "the gather protocol"
            )
        by_rank = isinstance(batch, Mapping)
        batches = dict(batch) if isinstance(batch, Mapping) else {0: batch}
        if not by_rank and self._layout.dp > 1:
            raise FutureMapError(
                "resolve_mixed_tails_cpu: a map of several DP ranks takes a mapping DP rank "
                "-> Batch"
            )
        if prefix_lens is None:
            prefixes: Mapping[int, Any] = {}
        elif isinstance(prefix_lens, Mapping) == by_rank:
            prefixes = prefix_lens if isinstance(prefix_lens, Mapping) else {0: prefix_lens}
        else:
            raise FutureMapError("prefix_lens must be given in the form of the batch")
        rows, running = {}, {}
        for d, b in batches.items():
            where = f"batch[rank {d}]." if by_rank else "batch."
            rows[d] = _mixed_rows(b, where, prefixes.get(d), prefix_lens is not None)
        # resolve's own checks of the batch (its general path places it; nothing runs)
        self._placement.resolve(batch)
        checks = self._placement.inputs.checks
        for d, (_, lens, ts, pre) in rows.items():
            where, rank = (f"batch[rank {d}].", f"[rank {d}]") if by_rank else ("batch.", "")
            for name, x in ((f"{where}seq_lens", lens), (f"prefix_lens{rank}", pre)):
                if x is not None:  # host lengths, rebound and summed: >= 0
                    checks.check("relayed", name, x, np.dtype(np.int64))
            running[d] = ts[ts > 0]
        got: Any = {}
        if any(len(x) for x in running.values()):
            placed = self._placement.slots_op(
                "seq_lens_at", running if by_rank else running[0], None
            )
            got = self._lengths(run, placed, subset=True)
        if not by_rank:
            got = {0: got}
        out = {d: _rebind(*rows[d], got.get(d)) for d in batches}
        return out if by_rank else out[0]

    def confidence(
        self, indices: Any, wait: bool
    ) -> ResolvedConfidence | None | dict[int, ResolvedConfidence | None]:
        """`FutureMap.resolve_confidence_cpu`: the ring's rows at `indices`, per rank for
        a mapping; refused on a map with no confidence relay."""
        ring = self._runtime.confidence
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
        if self._layout.dp > 1:
            raise FutureMapError(
                "resolve_confidence_cpu on a map of several DP ranks takes a mapping DP rank "
                "-> slots"
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
    out: list[np.ndarray | None] = []
    for name, x in (
        ("req_pool_indices", batch.req_pool_indices),
        ("seq_lens", batch.seq_lens),
        ("token_slots", batch.token_slots),
        ("prefix_lens", prefix),
    ):
        if x is None and name == "prefix_lens" and not prefixed:
            out.append(None)
            continue
        a = np.asarray(x) if isinstance(x, np.ndarray | list | tuple) else None
        if a is None or a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            got = type(x).__name__
            raise FutureMapError(f"{where}{name} must be 1-D host ints (numpy), got {got}")
        out.append(a.astype(np.int64))
    idx, lens, ts, pre = out
    assert idx is not None and lens is not None and ts is not None
    for name, x in (("seq_lens", lens), ("prefix_lens", pre)):
        if x is not None and len(x) != len(idx):
            raise FutureMapError(f"{where}{name} has {len(x)} rows, req_pool_indices {len(idx)}")
    return idx, lens, ts, pre


def _rebind(
    idx: np.ndarray, lens: np.ndarray, ts: np.ndarray, prefix: np.ndarray | None, fresh: Any
) -> MixedTails:
    """The running rows (the last live rows, one per nonzero token slot, in order) take
    their published lengths `fresh` (in token-slot order): + 1 in seq_lens_cpu, as they are
    in prefix_lens; the sum is over the live rows."""
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
