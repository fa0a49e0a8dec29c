"""One job through both twins and the reference loop, on one device, a mesh or many processes;
and the mutation check over a suite.

Every job takes one path: its DP ranks' scenarios (rank d runs the catalogue scenario
built with seed `job.seed + d`), each twin run over them by the one driver, the two traces
compared by the one comparer, each run's streams checked against the reference loop, and
on a mesh the sharded map's own health (recompiles, resharding, collectives).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fm_parity import catalogue
from fm_parity.compare import compare_traces
from fm_parity.driver import run_overlap
from fm_parity.mutations import MUTATIONS
from fm_parity.reference import Streams, run_reference
from fm_parity.scenario import Scenario
from fm_parity.trace import RunResult
from fm_parity.twin import Twin, check_protocol

DETECTORS = ("parity", "oracle", "debug", "checks", "sync")
"""What can catch a bug: a trace divergence, a wrong token stream, a debug invariant
violation, the map's input checks rejecting what it was handed, or (fm_jax, gather
protocol) a device-to-host transfer inside resolve, publish or stash."""


@dataclass(frozen=True)
class Job:
    """One run: a catalogue scenario in one dtype, debug mode and relay protocol, and
    for a spec scenario fm_jax's spec kernel (`SpecConfig.kernel`; plain data: crosses
    into a worker process as JSON).

    `dp` x `tp` > 1 runs fm_jax on a mesh, its DP ranks spread over `processes` processes
    (each holding dp*tp/processes devices); fm_torch holds one map per rank.
    """

    scenario: str
    dtype: str
    debug: bool
    device: str = "cpu"
    steps: int | None = None
    seed: int = 0
    size: int = 1
    dp: int = 1
    tp: int = 1
    processes: int = 1
    protocol: str = "sentinel"
    spec_kernel: str = "xla"

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
    protocol: str = "sentinel"
    spec_kernel: str = "xla"
    dp: int | None = None  # mesh runs only
    tp: int | None = None
    processes: int = 1
    failures: list[str] = field(default_factory=list)  # other failed checks
    extra: dict[str, Any] = field(default_factory=dict)  # mesh health report keys

    @property
    def ok(self) -> bool:
        """No divergence, the oracle holds and no other check failed."""
        return self.divergences == 0 and self.oracle_ok and not self.failures

    def to_json(self) -> dict[str, Any]:
        """The report's per-run entry (mesh runs add dp, tp and the health keys; runs over
        several processes add processes)."""
        keys = ("name", "dtype", "debug", "steps", "ops_compared", "divergences", "oracle_ok")
        doc = {k: getattr(self, k) for k in keys}
        doc["protocol"] = self.protocol
        doc["spec_kernel"] = self.spec_kernel
        if self.dp is not None:
            doc.update(dp=self.dp, tp=self.tp, **self.extra)
        if self.processes > 1:
            doc["processes"] = self.processes
        return doc

    def to_wire(self) -> dict[str, Any]:
        """Everything, for the worker process's report line."""
        return asdict(self)


def lanes_for(job: Job) -> dict[int, Scenario]:
    """DP rank -> the scenario it runs: the catalogue's, built with seed `job.seed + rank`."""
    return {
        d: catalogue.build(job.scenario, size=job.size, seed=job.seed + d) for d in range(job.dp)
    }


def oracle_mismatch(ref: Mapping[tuple[int, int], list[int]], run: RunResult) -> str | None:
    """The first (rank, request) whose stream is not a prefix of the reference's, or None."""
    for key in sorted(run.streams):
        got, want = run.streams[key], ref.get(key, [])
        if got != want[: len(got)] or len(got) > len(want):
            i = next(
                (k for k, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
                min(len(got), len(want)),
            )
            g = got[i] if i < len(got) else "end"
            w = want[i] if i < len(want) else "end"
            return f"rank {key[0]} request {key[1]}, stream entry {i}: got {g}, reference {w}"
    return None


def _oracle(ref: Mapping[tuple[int, int], list[int]], run: RunResult) -> tuple[bool, str | None]:
    """(the run's streams equal the reference's, the first mismatching entry if any)."""
    bad = oracle_mismatch(ref, run)
    ok = bad is None and run.error is None and run.streams == ref
    if bad is None and not ok and run.error is None:
        bad = "requests missing from the run's streams"
    return ok, bad


@functools.lru_cache(maxsize=16)
def _reference(scenario: Scenario, dtype: str, steps: int | None) -> Streams:
    """The reference streams, shared by a scenario's debug-on and debug-off jobs (read only)."""
    return run_reference(scenario, dtype, steps)


def health_failures(report: Mapping[str, Any]) -> list[str]:
    """What a mesh health report (fm_parity.mesh.MeshHealth.report) shows wrong."""
    failures = []
    if report["recompiles"]:
        failures.append(f"{report['recompiles']} compiles on calls whose shapes were seen")
    if report["resharded"]:
        failures.append("the state came back with another sharding")
    moved = {op: n for op, n in report["collectives"].items() if n}
    if moved:
        failures.append(f"collectives in the compiled HLO: {moved}")
    return failures


def sync_failures(runs: Mapping[str, RunResult]) -> list[str]:
    """The 'sync' check: each run's device-to-host transfers inside map ops (the first of
    each run, and how many), which the gather protocol allows only in
    resolve_seq_lens_cpu (docs/CONTRACT.md, 'Two protocols')."""
    out = []
    for name, r in runs.items():
        if r.syncs:
            more = f" ({len(r.syncs)} op calls in all)" if len(r.syncs) > 1 else ""
            out.append(f"sync: {name}: {r.syncs[0]}{more}")
    return out


def evaluate(
    job: Job,
    lanes: Mapping[int, Scenario],
    runs: Mapping[str, RunResult],
    health: Mapping[str, Any] | None = None,
) -> ScenarioResult:
    """Judge a job's two runs (twin name -> run, fm_jax's first): their traces bit for bit,
    each run's streams against the reference loop, no device-to-host transfer inside a
    watched map op (the 'sync' check), and on a mesh the map's health."""
    (na, a), (nb, b) = runs.items()
    cmp = compare_traces(lanes[0].name, a, b, (na, nb))
    ref = {
        (rank, rid): s
        for rank, scn in lanes.items()
        for rid, s in _reference(scn, job.dtype, job.steps).items()
    }
    oracles = {name: _oracle(ref, r) for name, r in runs.items()}
    detectors = []
    if cmp.field_divergences:
        detectors.append("parity")
    if any(bad is not None for _, bad in oracles.values()):
        detectors.append("oracle")
    for kind in ("debug", "checks"):
        if any(r.error_kind == kind for r in runs.values()):
            detectors.append(kind)
    if any(r.syncs or r.error_kind == "sync" for r in runs.values()):
        detectors.append("sync")
    failures = [] if health is None else health_failures(health)
    failures += sync_failures(runs)
    return ScenarioResult(
        name=lanes[0].name,
        dtype=job.dtype,
        debug=job.debug,
        steps=max(r.steps for r in runs.values()),
        ops_compared=cmp.ops_compared,
        divergences=cmp.divergences,
        oracle_ok=all(ok for ok, _ in oracles.values()),
        first_divergence=None if cmp.first is None else str(cmp.first),
        errors={name: r.error for name, r in runs.items() if r.error},
        oracle_failures=[f"{name}: {bad}" for name, (_, bad) in oracles.items() if bad],
        detectors=detectors,
        protocol=job.protocol,
        spec_kernel=job.spec_kernel,
        dp=job.dp if job.mesh else None,
        tp=job.tp if job.mesh else None,
        processes=job.processes,
        failures=failures,
        extra={} if health is None else dict(health),
    )


def failed(job: Job, why: str) -> ScenarioResult:
    """A failing result for a job that could not run to the end of its checks."""
    return ScenarioResult(
        job.scenario,
        job.dtype,
        job.debug,
        0,
        0,
        0,
        False,
        protocol=job.protocol,
        spec_kernel=job.spec_kernel,
        dp=job.dp if job.mesh else None,
        tp=job.tp if job.mesh else None,
        processes=job.processes,
        failures=[why],
    )


def make_twins(
    lanes: Mapping[int, Scenario],
    job: Job,
    mutation: str | None = None,
    mutate: Sequence[str] = ("jax",),
) -> list[Twin]:
    """[jax twin, torch twin] for the job's ranks, the named mutation wrapped around `mutate`."""
    from fm_parity.twin_jax import JaxTwin
    from fm_parity.twin_torch import TorchTwin

    first = lanes[0]
    twins: list[Twin] = [
        JaxTwin(
            first,
            job.dtype,
            job.debug,
            job.device,
            dp=job.dp,
            tp=job.tp,
            protocol=job.protocol,
            spec_kernel=job.spec_kernel,
        ),
        TorchTwin(
            first, job.dtype, job.debug, job.device, ranks=tuple(lanes), protocol=job.protocol
        ),
    ]
    if mutation is not None:
        wrap = MUTATIONS[mutation]
        twins = [wrap(t) if t.name in mutate else t for t in twins]
    return twins


def run_job(
    job: Job, mutation: str | None = None, mutate: Sequence[str] = ("jax",)
) -> ScenarioResult:
    """Run one job in this process (a mesh job needs job.dp * job.tp devices here).

    A job that raises before its checks end is reported as a failing result, so that the
    other jobs still run.
    """
    check_protocol(job.protocol)
    if not catalogue.runs_under(job.scenario, job.protocol):
        raise ValueError(f"scenario {job.scenario} does not run under the {job.protocol} protocol")
    try:
        lanes = lanes_for(job)
        twins = make_twins(lanes, job, mutation, mutate)
        runs = {t.name: run_overlap(lanes, t, job.dtype, job.steps) for t in twins}
        report = next((r for t in twins if (r := t.mesh_report()) is not None), None)
    except Exception as e:
        if not job.mesh:
            raise
        return failed(job, f"{type(e).__name__}: {e}")
    return evaluate(job, lanes, runs, report)


@dataclass(frozen=True)
class MutationResult:
    """Which detectors caught a mutation, and in which run (None: it slipped through)."""

    name: str
    caught_by: str | None
    where: str | None
    protocol: str = "sentinel"

    def to_json(self) -> dict[str, Any]:
        """The report's per-mutation entry."""
        return {"name": self.name, "protocol": self.protocol, "caught_by": self.caught_by}


def check_mutation(
    name: str, jobs: Iterable[Job], mutate: Sequence[str] = ("jax",)
) -> MutationResult:
    """Run the mutated twins through `jobs` in order until some detector fires.

    Every job runs under the mutation's own protocol (`Mutant.judged_under`: the relay
    protocol whose mistake it makes), whatever protocol it names, and in debug mode if
    the mutation shows only there, or is a mistake of debug mode's own bookkeeping
    (`Mutant.debug_only`). Returns the detectors
    that fired in the first scenario that caught it (both debug modes of that scenario
    are run, so 'debug' shows where it applies).
    """
    protocol = MUTATIONS[name].judged_under
    debug_only = MUTATIONS[name].debug_only
    by_scenario: dict[tuple[str, int, int | None, int], list[Job]] = {}
    for job in jobs:
        key = (job.scenario, job.seed, job.steps, job.size)
        group = by_scenario.setdefault(key, [])
        mine = replace(job, protocol=protocol, debug=job.debug or debug_only)
        if mine not in group and catalogue.runs_under(job.scenario, protocol):
            group.append(mine)  # one run per debug mode, whatever protocols `jobs` name
    for group in by_scenario.values():
        fired: list[str] = []
        where = None
        for job in group:
            r = run_job(job, name, mutate)
            where = r.name
            fired += [d for d in r.detectors if d not in fired]
        if fired:
            order = [d for d in DETECTORS if d in fired]
            return MutationResult(name, "+".join(order), where, protocol)
    return MutationResult(name, None, None, protocol)
