"""One scenario through both twins and the reference loop; the mutation check over a suite."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from parity import catalogue
from parity.compare import compare_traces
from parity.driver import run_overlap
from parity.mutations import MUTATIONS
from parity.reference import run_reference
from parity.scenario import Scenario
from parity.trace import RunResult
from parity.twin import Twin

MESH_CHECK = "mesh_check"
"""`Job.kind` of the sharded map's own check (parity.mesh_run.run_on_mesh: its DP scenario
sharded vs unsharded, plus recompiles, resharding and collectives in the compiled HLO)."""

MESH_CHECK_STEPS = 12
"""Length of that check's DP scenario when no --steps is given."""

DETECTORS = ("parity", "oracle", "debug", "checks")
"""What can catch a bug: a trace divergence, a wrong token stream, a debug invariant
violation, or the map's input checks rejecting what it was handed."""


@dataclass(frozen=True)
class Job:
    """One run: a catalogue scenario in one dtype and debug mode (plain data: crosses
    into a worker process as JSON). With dp * tp > 1 it runs on a dp x tp mesh (rank d
    runs the scenario built with seed d); kind MESH_CHECK runs the sharded map's
    compile/collective check (its DP scenario seeded with `seed`) instead."""

    scenario: str
    dtype: str
    debug: bool
    device: str = "cpu"
    steps: int | None = None
    seed: int = 0
    size: int = 1
    dp: int = 1
    tp: int = 1
    kind: str = "catalogue"

    @property
    def mesh(self) -> bool:
        """Whether the job runs on a mesh of more than one device."""
        return self.dp * self.tp > 1


@dataclass
class ScenarioResult:
    """The outcome of one Job. `to_json` gives the report's schema; the rest is for humans."""

    name: str
    dtype: str
    debug: bool
    steps: int
    ops_compared: int
    divergences: int
    oracle_ok: bool
    first_divergence: str | None = None
    errors: dict[str, str] = field(default_factory=dict)
    oracle_failures: list[str] = field(default_factory=list)
    detectors: list[str] = field(default_factory=list)
    dp: int | None = None  # mesh runs only
    tp: int | None = None
    failures: list[str] = field(default_factory=list)  # other failed checks (mesh runs)
    extra: dict[str, Any] = field(default_factory=dict)  # more report keys (mesh check)

    @property
    def ok(self) -> bool:
        """No divergence, the oracle holds and no other check failed."""
        return self.divergences == 0 and self.oracle_ok and not self.failures

    def to_json(self) -> dict[str, Any]:
        """The report's per-scenario entry (mesh runs add dp, tp and `extra`)."""
        keys = ("name", "dtype", "debug", "steps", "ops_compared", "divergences", "oracle_ok")
        doc = {k: getattr(self, k) for k in keys}
        if self.dp is not None:
            doc.update(dp=self.dp, tp=self.tp, **self.extra)
        return doc

    def to_wire(self) -> dict[str, Any]:
        """Everything, for the worker process's report line."""
        return asdict(self)


def oracle_mismatch(ref: RunResult, run: RunResult) -> str | None:
    """The first request whose stream is not a prefix of the reference's, or None."""
    for rid in sorted(run.streams):
        got, want = run.streams[rid], ref.streams.get(rid, [])
        if got != want[: len(got)] or len(got) > len(want):
            i = next(
                (k for k, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
                min(len(got), len(want)),
            )
            g = got[i] if i < len(got) else "end"
            w = want[i] if i < len(want) else "end"
            return f"request {rid}, stream entry {i}: got {g}, reference {w}"
    return None


def _oracle(ref: RunResult, run: RunResult) -> tuple[bool, str | None]:
    """(the run's streams equal the reference's, the first mismatching entry if any)."""
    bad = oracle_mismatch(ref, run)
    return bad is None and run.error is None and run.streams == ref.streams, bad


@functools.lru_cache(maxsize=4)
def _reference(scenario: Scenario, dtype: str, steps: int | None) -> RunResult:
    """The reference run, shared by a scenario's debug-on and debug-off jobs (read only)."""
    return run_reference(scenario, dtype, steps)


def make_twins(
    scenario: Scenario, job: Job, mutation: str | None = None, mutate: Sequence[str] = ("jax",)
) -> list[Twin]:
    """[jax twin, torch twin] for the job, the named mutation wrapped around `mutate`."""
    from parity.twin_jax import JaxTwin
    from parity.twin_torch import TorchTwin

    twins: list[Twin] = [
        JaxTwin(scenario, job.dtype, job.debug, job.device),
        TorchTwin(scenario, job.dtype, job.debug, job.device),
    ]
    if mutation is not None:
        wrap = MUTATIONS[mutation]
        twins = [wrap(t) if t.name in mutate else t for t in twins]  # type: ignore[misc]
    return twins


def run_scenario(
    scenario: Scenario, job: Job, mutation: str | None = None, mutate: Sequence[str] = ("jax",)
) -> ScenarioResult:
    """Run `scenario` through both twins and the reference loop; compare bit for bit."""
    ref = _reference(scenario, job.dtype, job.steps)
    twins = make_twins(scenario, job, mutation, mutate)
    runs = [run_overlap(scenario, t, job.dtype, job.steps) for t in twins]
    cmp = compare_traces(scenario.name, runs[0], runs[1], (twins[0].name, twins[1].name))
    oracles = [_oracle(ref, r) for r in runs]
    detectors = []
    if cmp.field_divergences:
        detectors.append("parity")
    if any(bad is not None for _, bad in oracles):
        detectors.append("oracle")
    for kind in ("debug", "checks"):
        if any(r.error_kind == kind for r in runs):
            detectors.append(kind)
    return ScenarioResult(
        name=scenario.name,
        dtype=job.dtype,
        debug=job.debug,
        steps=max(r.steps for r in runs),
        ops_compared=cmp.ops_compared,
        divergences=cmp.divergences,
        oracle_ok=all(ok for ok, _ in oracles),
        first_divergence=None if cmp.first is None else str(cmp.first),
        errors={t.name: r.error for t, r in zip(twins, runs, strict=True) if r.error},
        oracle_failures=[
            f"{t.name}: {bad}" for t, (_, bad) in zip(twins, oracles, strict=True) if bad
        ],
        detectors=detectors,
    )


def run_job(job: Job) -> ScenarioResult:
    """Build the job's scenario from the catalogue and run it (on a mesh if the job says so;
    a mesh job needs job.dp * job.tp devices in this process)."""
    if job.kind == MESH_CHECK:
        return run_mesh_check(job)
    if job.mesh:
        return run_mesh_job(job)
    return run_scenario(catalogue.build(job.scenario, size=job.size, seed=job.seed), job)


def _mesh_error(job: Job, name: str, e: Exception) -> ScenarioResult:
    """A failing result for a mesh job that raised before it could report."""
    return ScenarioResult(
        name,
        job.dtype,
        job.debug,
        0,
        0,
        0,
        False,
        dp=job.dp,
        tp=job.tp,
        failures=[f"{type(e).__name__}: {e}"],
    )


def _unsharded_oracle(scenario: Scenario, job: Job) -> str | None:
    """None if the unsharded fm_jax twin's streams equal the reference's, else why not."""
    from parity.twin_jax import JaxTwin

    ref = _reference(scenario, job.dtype, job.steps)
    run = run_overlap(
        scenario, JaxTwin(scenario, job.dtype, job.debug, "cpu"), job.dtype, job.steps
    )
    ok, bad = _oracle(ref, run)
    return None if ok else (bad or run.error or "streams differ from the reference")


def mesh_job_result(
    job: Job, rows: Sequence[dict[str, Any]], oracle: Sequence[str | None]
) -> ScenarioResult:
    """Fold `run_catalogue_on_mesh`'s per-rank rows into one result.

    Args:
      job: the mesh job.
      rows: one row per DP rank (rank, steps, ops_compared, divergences, first, errors
        [unsharded, mesh], streams_equal, ok).
      oracle: per rank, None if the unsharded twin's streams equal the reference loop's,
        else the mismatch. With streams_equal this makes the mesh rank's oracle.
    """
    oracle_failures, errors, failures = [], {}, []
    first = None
    for row, bad in zip(rows, oracle, strict=True):
        d = row["rank"]
        if bad is not None:
            oracle_failures.append(f"rank {d} (unsharded jax twin vs reference): {bad}")
        if not row["streams_equal"]:
            oracle_failures.append(f"rank {d}: mesh streams differ from the unsharded twin's")
        unsharded_err, mesh_err = row["errors"]
        if mesh_err is not None or unsharded_err is not None:
            errors[f"rank {d}"] = f"jax: {unsharded_err}; jax-mesh: {mesh_err}"
        if first is None and row["first"] is not None:
            first = f"rank {d}: {row['first']}"
        if not row["ok"] and not row["divergences"] and row["streams_equal"]:
            failures.append(f"rank {d}: record counts or errors differ from the unsharded twin")
    return ScenarioResult(
        name=job.scenario,
        dtype=job.dtype,
        debug=job.debug,
        steps=max((r["steps"] for r in rows), default=0),
        ops_compared=sum(r["ops_compared"] for r in rows),
        divergences=sum(r["divergences"] for r in rows),
        oracle_ok=not oracle_failures and not errors,
        first_divergence=first,
        errors=errors,
        oracle_failures=oracle_failures,
        dp=job.dp,
        tp=job.tp,
        failures=failures,
    )


def run_mesh_job(job: Job) -> ScenarioResult:
    """Run a catalogue scenario on every DP rank of one sharded map (parity.mesh_twin):
    each rank's trace bit for bit against its own unsharded fm_jax twin, and its token
    streams against the reference loop."""
    from parity.mesh_twin import run_catalogue_on_mesh

    try:
        rows = run_catalogue_on_mesh(
            job.scenario,
            job.dp,
            job.tp,
            dtype=job.dtype,
            debug=job.debug,
            size=job.size,
            steps=job.steps,
        )
        verdicts: dict[Scenario, str | None] = {}  # ranks with equal scenarios share a run
        oracle = []
        for row in rows:
            scn = catalogue.build(job.scenario, size=job.size, seed=row["rank"])
            if scn not in verdicts:
                verdicts[scn] = _unsharded_oracle(scn, job)
            oracle.append(verdicts[scn])
    except Exception as e:  # reported as a failing row; the other jobs still run
        return _mesh_error(job, job.scenario, e)
    return mesh_job_result(job, rows, oracle)


def mesh_check_result(job: Job, row: dict[str, Any], records: int) -> ScenarioResult:
    """`run_on_mesh`'s report row as a result: diffs are divergences (at most the 5 it
    lists), and recompiles on seen shapes, resharding or any collective are failures.

    `records`: the trace records compared (busy (step, rank) pairs and final buffers).
    """
    failures = []
    if row["recompiles"]:
        failures.append(f"{row['recompiles']} compiles on steps whose per-rank shape was seen")
    if row["resharded"]:
        failures.append("the state came back with another sharding")
    moved = {op: n for op, n in row["collectives"].items() if n}
    if moved:
        failures.append(f"collectives in the compiled HLO: {moved}")
    diffs = row["diffs"]
    return ScenarioResult(
        name=row["scenario"],
        dtype=job.dtype,
        debug=job.debug,
        steps=row["steps"],
        ops_compared=records,
        divergences=0 if row["ok"] else max(len(diffs), 1),
        oracle_ok=True,  # run_sharded asserts the host's lengths at every step (else raises)
        first_divergence=diffs[0] if diffs else None,
        dp=job.dp,
        tp=job.tp,
        failures=failures,
        extra={k: row[k] for k in ("recompiles", "compiles_total", "collectives", "resharded")},
    )


def run_mesh_check(job: Job) -> ScenarioResult:
    """The sharded map's own check on a dp x tp mesh (parity.mesh_run.run_on_mesh, int32):
    its DP scenario (job.steps long, MESH_CHECK_STEPS by default) sharded vs one unsharded
    map per rank, byte for byte, with no recompile, resharding or collective."""
    from fm_jax import ForwardMode
    from parity.mesh_run import run_on_mesh
    from parity.mesh_scenario import data_parallel_scenario

    scn = data_parallel_scenario(job.dp, steps=job.steps or MESH_CHECK_STEPS, seed=job.seed)
    busy = sum(st.mode != ForwardMode.IDLE for ranks in scn.steps for st in ranks)
    try:
        [row] = run_on_mesh(job.dp, job.tp, scenario=scn, debug=job.debug)
    except AssertionError as e:  # the host-known lengths did not come back
        r = _mesh_error(job, scn.name, e)
        r.oracle_failures, r.failures = [str(e)], []
        return r
    except Exception as e:
        return _mesh_error(job, scn.name, e)
    return mesh_check_result(job, row, busy + scn.dp)


@dataclass(frozen=True)
class MutationResult:
    """Which detectors caught a mutation, and in which run (None: it slipped through)."""

    name: str
    caught_by: str | None
    where: str | None

    def to_json(self) -> dict[str, Any]:
        """The report's per-mutation entry."""
        return {"name": self.name, "caught_by": self.caught_by}


def check_mutation(
    name: str, jobs: Iterable[Job], mutate: Sequence[str] = ("jax",)
) -> MutationResult:
    """Run the mutated twins through `jobs` in order until some detector fires.

    Returns the detectors that fired in the first scenario that caught it (both debug
    modes of that scenario are run, so 'debug' shows where it applies).
    """
    by_scenario: dict[tuple[str, int, int | None, int], list[Job]] = {}
    for job in jobs:
        by_scenario.setdefault((job.scenario, job.seed, job.steps, job.size), []).append(job)
    for (scen, seed, _, size), group in by_scenario.items():
        scenario = catalogue.build(scen, size=size, seed=seed)
        fired: list[str] = []
        for job in group:
            r = run_scenario(scenario, job, name, mutate)
            fired += [d for d in r.detectors if d not in fired]
        if fired:
            order = [d for d in DETECTORS if d in fired]
            return MutationResult(name, "+".join(order), scenario.name)
    return MutationResult(name, None, None)
