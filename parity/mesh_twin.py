"""Parity's JAX twin on one DP rank of a mesh `FutureMap`, to run catalogue scenarios on a mesh.

`RankView` gives one rank of a sharded map the single-pool `fm_jax.FutureMap` interface
(every call feeds that rank's rows; the other ranks get all-padding parts, as idle ranks
do). `MeshRankTwin` is `JaxTwin` over such a view, so parity's overlap driver runs a
catalogue scenario on rank d exactly as it runs it on an unsharded map, and the two traces
compare record for record.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import fm_jax
from parity.mesh_run import make_mesh
from parity.scenario import Scenario
from parity.twin_jax import JaxTwin


class RankView:
    """The single-pool FutureMap API over DP rank `rank` of a mesh FutureMap."""

    def __init__(self, fm: fm_jax.FutureMap, rank: int) -> None:
        if rank not in fm.local_ranks:
            raise ValueError(f"DP rank {rank} is not local to this process {fm.local_ranks}")
        self.fm, self.rank = fm, rank
        self.spec = fm.spec
        self.device = next(d for d in fm.layout.mesh.local_devices if fm.layout.rank_of(d) == rank)

    def _block(self, x: Any) -> Any:
        """Rank `rank`'s block of a global array, as a one-device array on `self.device`."""
        if x is None:
            return None
        return next(sh.data for sh in x.addressable_shards if sh.device == self.device)

    @property
    def state(self) -> fm_jax.FutureMapState:
        """This rank's pool (host copies)."""
        bufs = self.fm.buffers()
        return fm_jax.FutureMapState(
            **{
                name: fm_jax.per_rank(bufs[name], self.fm.layout)[self.rank]
                if name in bufs
                else None
                for name in fm_jax.FutureMapState._fields
            }
        )

    def check(self) -> None:
        self.fm.check()

    def resolve_seq_lens_cpu(self, slots: np.ndarray) -> np.ndarray:
        return self.fm.resolve_seq_lens_cpu({self.rank: slots})[self.rank]

    def resolve(self, batch: fm_jax.Batch) -> fm_jax.Resolved:
        rows, toks = len(batch.req_pool_indices), len(batch.input_ids)
        out = self.fm.resolve({self.rank: batch}, rows=rows, tokens=toks)
        draft = None
        if out.draft is not None:
            draft = fm_jax.DraftPayload(*(self._block(x) for x in out.draft))
        return fm_jax.Resolved(self._block(out.input_ids), self._block(out.seq_lens), draft)

    def publish(self, slots: np.ndarray, lens: Any) -> None:
        self.fm.publish({self.rank: slots}, {self.rank: np.asarray(lens)}, rows=len(slots))

    def stash(self, slots: np.ndarray, payload: Any) -> None:
        if isinstance(payload, fm_jax.DraftPayload):
            payload = fm_jax.DraftPayload(*(None if x is None else np.asarray(x) for x in payload))
        else:
            payload = np.asarray(payload)
        self.fm.stash({self.rank: slots}, {self.rank: payload}, rows=len(slots))

    def invalidate(self, batch: fm_jax.Batch, slots: np.ndarray) -> fm_jax.Batch:
        out = self.fm.invalidate(batch, {self.rank: slots}, rows=len(slots))
        return out._replace(
            input_ids=self._block(out.input_ids), seq_lens=self._block(out.seq_lens)
        )


class MeshRankTwin(JaxTwin):
    """`JaxTwin` whose FutureMap is DP rank `rank` of a shared mesh FutureMap."""

    name = "jax-mesh"

    def __init__(self, scenario: Scenario, dtype: str, fm: fm_jax.FutureMap, rank: int) -> None:
        self.dtype = np.dtype(dtype)
        self.on_host = True
        sp = scenario.spec
        self.spec = None if sp is None else (sp.topk, sp.hidden)
        view = RankView(fm, rank)
        self.device = view.device
        self.fm = view  # type: ignore[assignment]


def sharded_map_for(
    scenario: Scenario, dp: int, tp: int, *, dtype: str = "int32", debug: bool = False
) -> fm_jax.FutureMap:
    """A mesh FutureMap configured like JaxTwin's map for `scenario`, on a dp x tp mesh."""
    sp = scenario.spec
    cfg = None if sp is None else fm_jax.SpecConfig(sp.topk, sp.hidden, jax.numpy.bfloat16)
    return fm_jax.FutureMap(
        scenario.pool_size,
        mesh=make_mesh(dp, tp),
        dp_axis="dp",
        tp_axis="tp",
        dtype=np.dtype(dtype),
        spec=cfg,
        debug=debug,
        batch_buckets=scenario.batch_buckets,
        token_buckets=sorted(set(scenario.token_buckets) | set(scenario.batch_buckets)),
    )


def run_catalogue_on_mesh(
    name: str,
    dp: int,
    tp: int,
    *,
    dtype: str = "int32",
    debug: bool = False,
    size: int = 1,
    steps: int | None = None,
) -> list[dict[str, Any]]:
    """Run catalogue scenario `name` on every DP rank of one sharded map; compare each rank
    with the same scenario on its own unsharded `JaxTwin`, record for record, byte for byte.

    Rank d runs the scenario built with seed=d (ranks differ); ranks run one after another
    on the shared map, the others idle meanwhile.

    Returns:
      One report row per rank: scenario, dp, tp, rank, ops_compared, divergences, first
      divergence, errors, streams_equal, ok.
    """
    from parity import catalogue
    from parity.compare import compare_traces
    from parity.driver import run_overlap

    scns = [catalogue.build(name, size=size, seed=d) for d in range(dp)]
    if len({s.pool_size for s in scns}) != 1:
        raise ValueError(f"{name}: pool size depends on the seed; one sharded map cannot hold it")
    fm = sharded_map_for(scns[0], dp, tp, dtype=dtype, debug=debug)
    rows = []
    for d, scn in enumerate(scns):
        ref = run_overlap(scn, JaxTwin(scn, dtype, debug, "cpu"), dtype, steps)
        got = run_overlap(scn, MeshRankTwin(scn, dtype, fm, d), dtype, steps)
        cmp = compare_traces(scn.name, ref, got, ("jax", "jax-mesh"))
        ok = (
            cmp.divergences == 0
            and len(ref.records) == len(got.records)
            and ref.error == got.error
            and ref.streams == got.streams
        )
        rows.append(
            {
                "scenario": name,
                "dp": dp,
                "tp": tp,
                "rank": d,
                "steps": got.steps,
                "ops_compared": cmp.ops_compared,
                "divergences": cmp.divergences,
                "first": None if cmp.first is None else str(cmp.first),
                "errors": [ref.error, got.error],
                "streams_equal": ref.streams == got.streams,
                "ok": ok,
            }
        )
    return rows
