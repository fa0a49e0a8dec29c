"""fm-parity --dp N --tp M: arguments, the mesh subprocess end to end, rows and exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fm_parity import cli
from fm_parity.driver import run_overlap
from fm_parity.runner import worker_env
from fm_parity.suite import Job, ScenarioResult, evaluate, health_failures, lanes_for, make_twins
from fm_parity.twin_torch import TorchTwin

SCENARIO_KEYS = {
    "name",
    "dtype",
    "debug",
    "steps",
    "ops_compared",
    "divergences",
    "oracle_ok",
    "protocol",
    "spec_kernel",
}
CHECK_KEYS = {"recompiles", "compiles_total", "collectives", "resharded"}


def test_mesh_cli_end_to_end(tmp_path):
    """Pins: `fm-parity --dp 2 --tp 2` not reaching a 4-device JAX (the flag must be set in
    the child before JAX starts), mesh rows missing from the JSON or lacking dp/tp and the
    sharded map's health, the existing row keys changing, either relay protocol missing
    from the default run, or a clean mesh run exiting non-zero."""
    out = tmp_path / "mesh.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env.pop("JAX_ENABLE_X64", None)
    argv = ["--dp", "2", "--tp", "2", "--scenario", "steady_decode", "--scenario", "dp_overlap"]
    proc = subprocess.run(
        [sys.executable, "-m", "fm_parity.cli", *argv, "--no-progress", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = proc.stdout.splitlines()[0].split()
    assert header[0] == "scenario" and "mesh" in header and "oracle" in header
    assert "protocol" in header
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu (4 host devices)"
    assert doc["mutations"] == [] and doc["skipped"] == {}
    rows = doc["scenarios"]
    assert [(r["name"], r["protocol"]) for r in rows] == [
        (name, protocol)
        for name in ("steady_decode", "dp_overlap")
        for protocol in ("sentinel", "gather")
    ]
    for run in rows:
        assert set(run) == SCENARIO_KEYS | {"dp", "tp"} | CHECK_KEYS
        assert (run["dtype"], run["debug"], run["dp"], run["tp"]) == ("int32", False, 2, 2)
        assert run["steps"] == 6 and run["divergences"] == 0 and run["oracle_ok"] is True
        assert run["ops_compared"] >= 2 * 6  # both ranks, every step has ops
        assert run["recompiles"] == 0 and run["resharded"] is False
        ops = ["publish", "stash", "resolve"]
        if run["protocol"] == "sentinel":  # the gather protocol runs no invalidate
            ops.append("invalidate")
        assert run["collectives"] == dict.fromkeys(ops, 0)
        assert run["compiles_total"] > 0


@pytest.mark.parametrize(
    "argv,flag",
    [(["--dp", "0"], "--dp"), (["--tp", "-2"], "--tp"), (["--dp", "two"], "--dp")],
)
def test_bad_mesh_shape_is_an_argparse_error(argv, flag, capsys):
    """Pins: a mesh of < 1 ranks (or a non-integer) reaching JAX instead of being refused
    with exit status 2 and a message naming the option."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and (">= 1" in err)


def test_mesh_refuses_mutations_and_seed_dependent_pools(capsys):
    """Pins: --mutations silently ignored on a mesh, an explicitly chosen scenario whose
    pool size varies with the seed (rank d runs seed + d) failing deep inside the run, and
    a process count that cannot hold whole TP groups reaching jax.distributed."""
    assert cli.main(["--dp", "2", "--mutations"]) == 2
    assert "--mutations" in capsys.readouterr().err
    assert cli.main(["--dp", "2", "--scenario", "random_mix"]) == 2
    assert "random_mix: pool size depends on the seed" in capsys.readouterr().err
    for argv in (["--processes", "2"], ["--dp", "2", "--tp", "2", "--processes", "4"]):
        assert cli.main(argv) == 2
        assert "--processes" in capsys.readouterr().err


def test_worker_env_appends_the_device_count():
    """Pins: the mesh worker's device count replacing a user's XLA_FLAGS (or not being set),
    and x64 leaking into the int32 mesh worker by the runner's own doing."""
    base = dict(os.environ)
    try:
        os.environ["XLA_FLAGS"] = "--xla_cpu_enable_fast_math=false"
        os.environ.pop("JAX_ENABLE_X64", None)
        env = worker_env("cpu", x64=False, mesh_devices=8)
    finally:
        os.environ.clear()
        os.environ.update(base)
    assert env["XLA_FLAGS"] == (
        "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8"
    )
    assert "JAX_ENABLE_X64" not in env
    assert env["JAX_PLATFORMS"] == "cpu"  # not a GPU machine's default backend


CLEAN = {
    "recompiles": 0,
    "compiles_total": 9,
    "collectives": {"publish": 0, "stash": 0, "resolve": 0, "invalidate": 0},
    "resharded": False,
}


def _runs(job: Job, lanes, steps: int):
    """The two twins' runs of `job`'s lanes (one device), for judging by hand."""
    twins = make_twins(lanes, job)
    return {t.name: run_overlap(lanes, t, job.dtype, steps) for t in twins}


@pytest.mark.parametrize(
    "change,words",
    [
        ({"recompiles": 1}, "compiles on calls"),
        ({"resharded": True}, "another sharding"),
        ({"collectives": {**CLEAN["collectives"], "resolve": 2}}, "collectives"),
    ],
)
def test_mesh_health_failures_fail_the_row(change, words):
    """Pins: a recompile on a seen shape, a resharded state or a collective in the HLO
    leaving a bit-identical run's row (and the exit status) ok."""
    job = Job("steady_decode", "int32", False, steps=3)
    lanes = lanes_for(job)
    runs = _runs(job, lanes, 3)
    assert health_failures(CLEAN) == []
    clean = evaluate(job, lanes, runs, CLEAN)
    assert clean.ok and clean.extra == CLEAN
    bad = evaluate(job, lanes, runs, {**CLEAN, **change})
    assert not bad.ok and bad.divergences == 0 and words in bad.failures[0]


def test_one_rank_going_wrong_fails_the_row_naming_the_rank():
    """Pins: one DP rank's diverging byte or wrong stream being lost when the ranks are
    judged as one run (two ranks of fm_torch maps stand in for both twins here)."""
    job = Job("dp_overlap", "int32", False, steps=6, dp=2)
    lanes = lanes_for(job)

    def run():
        return run_overlap(
            lanes, TorchTwin(lanes[0], "int32", False, "cpu", ranks=(0, 1)), "int32", 6
        )

    a, b = run(), run()
    assert evaluate(job, lanes, {"jax": a, "torch": b}).ok
    key = next(k for k in sorted(a.streams) if k[0] == 1)
    a.streams[key] = [a.streams[key][0] + 1] + a.streams[key][1:]
    r = evaluate(job, lanes, {"jax": a, "torch": b})
    assert not r.ok and not r.oracle_ok
    assert f"rank 1 request {key[1]}, stream entry 0" in r.oracle_failures[0]
    a = run()
    rec = next(x for x in a.records if x.rank == 1 and x.op == "stash")
    tokens = rec.fields["output_tokens"].value
    tokens.view(np.uint8)[0] ^= 1
    r = evaluate(job, lanes, {"jax": a, "torch": b})
    assert not r.ok and r.divergences == 1
    assert f"rank 1, step {rec.step}, op stash, field output_tokens, slot 1" in r.first_divergence


def test_failing_mesh_row_exits_1(monkeypatch, capsys):
    """Pins: a mesh run whose rows fail (here: a resharded state) still exiting 0."""
    import fm_parity.runner

    failing = ScenarioResult(
        "idle_steps",
        "int32",
        False,
        6,
        40,
        0,
        True,
        dp=4,
        tp=2,
        failures=["the state came back with another sharding"],
        extra={**CLEAN, "resharded": True},
    )

    def fake_run_jobs(jobs, progress=None, workers=1):
        assert all(j.dp == 4 and j.tp == 2 for j in jobs)
        return [failing for _ in jobs]

    monkeypatch.setattr(fm_parity.runner, "run_jobs", fake_run_jobs)
    assert cli.main(["--dp", "4", "--tp", "2", "--scenario", "idle_steps", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "another sharding" in out


def test_plain_report_keeps_its_schema():
    """Pins: unsharded rows growing the mesh keys (the existing JSON schema only gains
    the relay protocol)."""
    r = ScenarioResult("idle_steps", "int32", False, 5, 40, 0, True)
    assert set(r.to_json()) == SCENARIO_KEYS
