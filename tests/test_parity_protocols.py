"""Parity under both relay protocols (docs/CONTRACT.md, 'Two protocols'): the one driver
lays out each protocol's host batches, both twins pass them on as their APIs take them,
the oracle is the same, the report says which protocol each row ran, and the gather
protocol's own mistakes are caught."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from host_devices import cpu_devices_env

from fm_bench.child import child_report
from fm_parity import catalogue, cli
from fm_parity.compare import compare_traces
from fm_parity.driver import run_overlap
from fm_parity.host_batch import build
from fm_parity.mutations import MUTATIONS
from fm_parity.scenario import Kind, Row, Scenario, StepPlan
from fm_parity.suite import Job, ScenarioResult, check_mutation, evaluate, lanes_for, make_twins
from fm_parity.trace import OpRecord, RunResult
from fm_parity.twin import PROTOCOLS
from fm_parity.twin_torch import TorchTwin

GATHER_MUTATIONS = [n for n, cls in MUTATIONS.items() if cls.judged_under == "gather"]
SYNC_ONLY = {"host_copy_syncs"}
"""Mutations that change no value (a transfer that should not happen): parity, the oracle
and debug are blind to them; only the 'sync' check can catch them (test_parity_sync)."""


def _runs(job: Job) -> tuple[dict[str, RunResult], dict[int, Scenario]]:
    """Both twins' runs of `job` (one device), and its lanes."""
    lanes = lanes_for(job)
    twins = make_twins(lanes, job)
    return {t.name: run_overlap(lanes, t, job.dtype, job.steps) for t in twins}, lanes


@pytest.mark.parametrize("name", ["mixed_batches", "spec_decode", "prebuilt_bootstrap"])
def test_both_protocols_pass_and_rows_carry_their_protocol(name):
    """Pins: a protocol whose runs diverge between the twins or leave the oracle, a row
    reporting the wrong protocol, and invalidate records in a gather trace (that protocol
    has no invalidate op)."""
    for protocol in PROTOCOLS:
        job = Job(name, "int32", True, protocol=protocol)
        runs, lanes = _runs(job)
        r = evaluate(job, lanes, runs)
        assert r.ok, (r.first_divergence, r.oracle_failures, r.errors)
        assert r.to_json()["protocol"] == protocol
        ops = {rec.op for run in runs.values() for rec in run.records}
        assert ("invalidate" in ops) == (protocol == "sentinel"), ops
        assert {"resolve", "forward", "publish", "stash", "host"} <= ops


def _without(run: RunResult, drop) -> RunResult:
    """`run` with the records (or fields) `drop(record)` names removed."""
    out = []
    for rec in run.records:
        gone = drop(rec)
        if gone is True:
            continue
        fields = {k: v for k, v in rec.fields.items() if k not in (gone or ())}
        out.append(OpRecord(rec.step, rec.op, fields, rec.rank))
    return RunResult(out, run.streams, run.steps, run.error, run.error_kind)


@pytest.mark.parametrize("name", ["mixed_batches", "chunked_prefill", "spec_decode"])
def test_the_protocols_differ_only_in_the_host_layout(name):
    """Pins: a gather layout that feeds the forward other inputs than the sentinel one.
    With debug off (the poison differs: a sentinel resolve poisons every row's slot, a
    gather resolve only the slots it read) every twin's trace under gather equals its
    trace under sentinel byte for byte, less the invalidate records; a spec DECODE's
    resolved ids are the host's as given (sentinels in one protocol, 0 in the other; the
    forward never reads them), so spec resolve ids are left out."""
    spec = catalogue.build(name).spec is not None

    def drop(rec: OpRecord):
        if rec.op == "invalidate":
            return True
        return ("input_ids",) if spec and rec.op == "resolve" else ()

    runs = {p: _runs(Job(name, "int32", False, protocol=p))[0] for p in PROTOCOLS}
    for twin in ("jax", "torch"):
        a, b = (_without(runs[p][twin], drop) for p in PROTOCOLS)
        cmp = compare_traces(name, a, b, PROTOCOLS)
        assert cmp.divergences == 0 and cmp.ops_compared > 0, str(cmp.first)
        assert a.streams == b.streams


def test_mixed_gather_layout_names_the_running_rows():
    """Pins: a MIXED batch's running slots or fm_jax's per-token slots out of line with the
    tokens (the running rows' tokens are the last live ones; prefill and padding
    positions gather nothing)."""
    scn = catalogue.build("mixed_batches")
    rows = (
        Row(7, 2, "prefill", 0, 3, False, 3),
        Row(8, 5, "decode", seq_len=9),
        Row(9, 1, "decode", seq_len=4),
    )
    hb = build(StepPlan(1, Kind.MIXED, rows), scn, np.dtype("int32"), 0, lambda r: (0, r.seq_len))
    assert hb.running.tolist() == [5, 1] and hb.n_prefill_tokens == 3
    assert hb.mixed_token_slots.tolist() == [0, 0, 0, 5, 1] + [0] * (len(hb.input_ids) - 5)
    assert hb.input_ids[3:].tolist() == [0] * (len(hb.input_ids) - 3)  # no placeholder ids
    assert hb.seq_lens[:3].tolist() == [3, 9, 4]  # the host's lengths
    decode = build(StepPlan(2, Kind.DECODE, rows[1:]), scn, np.dtype("int32"), 0, lambda r: (0, 0))
    assert decode.running.size == 0


@pytest.mark.parametrize("name", [n for n in GATHER_MUTATIONS if n not in SYNC_ONLY])
def test_gather_mutations_are_caught_by_parity(name):
    """Pins: a gather-protocol mistake in fm_jax alone (a MIXED batch gathering at the
    wrong rows, a spec resolve keeping the host's stale lengths, a spec MIXED resolve
    keeping them, a stash skipping a row) passing unseen, or being judged under the
    sentinel protocol."""
    names = ("retire_reuse", "mixed_batches", "spec_decode", "spec_mixed")
    suite = [Job(n, "int32", False) for n in names]
    m = check_mutation(name, suite)
    assert m.protocol == "gather" and m.to_json()["protocol"] == "gather"
    assert m.caught_by is not None and "parity" in m.caught_by.split("+"), m


def test_cli_runs_the_chosen_protocols_and_their_mutations(monkeypatch, capsys):
    """Pins: --protocol not reaching the jobs (default: both, each scenario under each), a
    mutation run under a protocol that was not chosen, and the table losing its protocol
    column. The jobs themselves are stubbed: only the grid is checked here."""
    import fm_parity.runner
    import fm_parity.suite

    seen: dict[str, list] = {"jobs": [], "mutations": []}

    def fake_run_jobs(jobs, progress=None, workers=1):
        seen["jobs"] = list(jobs)
        return [
            ScenarioResult(j.scenario, j.dtype, j.debug, 3, 9, 0, True, protocol=j.protocol)
            for j in jobs
        ]

    def fake_check(name, jobs, mutate=("jax",)):
        seen["mutations"].append(name)
        return fm_parity.suite.MutationResult(
            name, "parity", "idle_steps", MUTATIONS[name].judged_under
        )

    monkeypatch.setattr(fm_parity.runner, "run_jobs", fake_run_jobs)
    monkeypatch.setattr(fm_parity.suite, "check_mutation", fake_check)
    base = ["--scenario", "idle_steps", "--dtype", "int32", "--debug", "off", "--no-progress"]
    assert cli.main(base) == 0
    assert [j.protocol for j in seen["jobs"]] == list(PROTOCOLS)
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header[:2] == ["scenario", "protocol"]
    for protocol in PROTOCOLS:
        seen["mutations"] = []
        assert cli.main([*base, "--protocol", protocol, "--mutations"]) == 0
        assert {j.protocol for j in seen["jobs"]} == {protocol}
        want = [n for n, cls in MUTATIONS.items() if cls.judged_under == protocol]
        assert seen["mutations"] == want and want
        out = capsys.readouterr().out
        assert f"1/1 runs ({protocol})" in out
    with pytest.raises(SystemExit) as e:
        cli.main([*base, "--protocol", "neither"])
    assert e.value.code == 2


def test_unknown_protocol_is_refused():
    """Pins: a misspelt protocol silently running as the default one."""
    with pytest.raises(ValueError, match="unknown protocol 'gathered'"):
        TorchTwin(catalogue.build("idle_steps"), "int32", False, "cpu", protocol="gathered")
    with pytest.raises(ValueError, match="unknown protocol"):
        from fm_parity.suite import run_job

        run_job(Job("idle_steps", "int32", False, protocol="gathered"))


MESH_SPEC_RANKS_OUT_OF_STEP = textwrap.dedent(
    """
    import dataclasses, json
    from fm_parity import catalogue
    from fm_parity.driver import run_overlap
    from fm_parity.suite import Job, evaluate, make_twins

    a = catalogue.build("spec_decode")
    late = tuple(dataclasses.replace(r, arrival=r.arrival + 3) for r in a.requests)
    lanes = {0: a, 1: dataclasses.replace(a, requests=late)}
    out = {}
    for protocol in ("sentinel", "gather"):
        job = Job("spec_decode", "int32", False, dp=2, protocol=protocol)
        runs = {t.name: run_overlap(lanes, t, "int32") for t in make_twins(lanes, job)}
        r = evaluate(job, lanes, runs)
        out[protocol] = [r.ok, r.first_divergence]
    print("REPORT", json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def spec_ranks_out_of_step() -> dict[str, list]:
    """protocol -> [ok, first divergence] of spec_decode on 2 DP ranks of one sharded map,
    rank 1 with every arrival 3 steps later (so at one step one rank runs a spec DECODE
    beside the other's EXTEND or IDLE), in a child whose JAX sees 2 devices."""
    env = cpu_devices_env(2)
    got: dict[str, list] = child_report(["-c", MESH_SPEC_RANKS_OUT_OF_STEP], env, timeout=240)
    return got


def test_spec_ranks_out_of_step_on_a_mesh(spec_ranks_out_of_step):
    """Pins: an IDLE rank of a spec map handing the sharded map no draft to stash (every
    rank stashes a DraftPayload there), and spec ranks in different kinds diverging under
    the sentinel protocol."""
    assert spec_ranks_out_of_step["sentinel"] == [True, None]


def test_spec_ranks_out_of_step_on_a_mesh_gather(spec_ranks_out_of_step):
    """The same under the gather protocol. Pins every rank's lengths being gathered at the
    draft indices: a rank prefilling beside a spec DECODE rank got new_seq_lens[0]."""
    assert spec_ranks_out_of_step["gather"] == [True, None]
