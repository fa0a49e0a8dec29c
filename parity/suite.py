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

DETECTORS = ("parity", "oracle", "debug", "checks")
"""What can catch a bug: a trace divergence, a wrong token stream, a debug invariant
violation, or the map's input checks rejecting what it was handed."""


@dataclass(frozen=True)
class Job:
    """One run: a catalogue scenario in one dtype and debug mode (plain data: crosses
    into the int64 worker process as JSON)."""

    scenario: str
    dtype: str
    debug: bool
    device: str = "cpu"
    steps: int | None = None
    seed: int = 0
    size: int = 1


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

    @property
    def ok(self) -> bool:
        """No divergence and the oracle holds."""
        return self.divergences == 0 and self.oracle_ok

    def to_json(self) -> dict[str, Any]:
        """The report's per-scenario entry."""
        keys = ("name", "dtype", "debug", "steps", "ops_compared", "divergences", "oracle_ok")
        return {k: getattr(self, k) for k in keys}

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
    """Build the job's scenario from the catalogue and run it."""
    return run_scenario(catalogue.build(job.scenario, size=job.size, seed=job.seed), job)


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
