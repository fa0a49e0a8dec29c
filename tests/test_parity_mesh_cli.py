"""fm-parity --dp N --tp M: arguments, the mesh subprocess end to end, rows and exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity import cli
from parity.runner import worker_env
from parity.suite import MESH_CHECK, Job, ScenarioResult, mesh_check_result, mesh_job_result

SCENARIO_KEYS = {"name", "dtype", "debug", "steps", "ops_compared", "divergences", "oracle_ok"}
CHECK_KEYS = {"recompiles", "compiles_total", "collectives", "resharded"}


def test_mesh_cli_end_to_end(tmp_path):
    """Pins: `fm-parity --dp 2 --tp 2` not reaching a 4-device JAX (the flag must be set in
    the child before JAX starts), mesh rows missing from the JSON or lacking dp/tp, the
    existing row keys changing, or a clean mesh run exiting non-zero."""
    out = tmp_path / "mesh.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env.pop("JAX_ENABLE_X64", None)
    argv = ["--dp", "2", "--tp", "2", "--scenario", "steady_decode", "--steps", "6"]
    proc = subprocess.run(
        [sys.executable, "-m", "parity.cli", *argv, "--no-progress", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = proc.stdout.splitlines()[0].split()
    assert header[0] == "scenario" and "mesh" in header and "oracle" in header
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu (4 host devices)"
    assert doc["mutations"] == [] and doc["skipped"] == {}
    run, check = doc["scenarios"]
    assert set(run) == SCENARIO_KEYS | {"dp", "tp"}
    assert (run["name"], run["dtype"], run["debug"], run["dp"], run["tp"]) == (
        "steady_decode",
        "int32",
        False,
        2,
        2,
    )
    assert run["steps"] == 6 and run["divergences"] == 0 and run["oracle_ok"] is True
    assert run["ops_compared"] >= 2 * 6  # both ranks, every step has ops
    assert set(check) == SCENARIO_KEYS | {"dp", "tp"} | CHECK_KEYS
    assert check["name"] == "dp_overlap" and (check["dp"], check["tp"]) == (2, 2)
    assert check["steps"] == 6 and check["divergences"] == 0 and check["recompiles"] == 0
    assert check["collectives"] == {"publish": 0, "stash": 0, "resolve": 0, "invalidate": 0}
    assert check["resharded"] is False and check["compiles_total"] > 0


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
    """Pins: --mutations silently ignored on a mesh, and an explicitly chosen scenario whose
    pool size varies with the seed (rank d runs seed d) failing deep inside the run."""
    assert cli.main(["--dp", "2", "--mutations"]) == 2
    assert "--mutations" in capsys.readouterr().err
    assert cli.main(["--dp", "2", "--scenario", "random_mix"]) == 2
    assert "random_mix: pool size depends on the seed" in capsys.readouterr().err


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


CLEAN_CHECK = {
    "scenario": "dp_overlap",
    "steps": 6,
    "ok": True,
    "diffs": [],
    "recompiles": 0,
    "compiles_total": 9,
    "collectives": {"publish": 0, "stash": 0, "resolve": 0, "invalidate": 0},
    "resharded": False,
}
CHECK_JOB = Job(MESH_CHECK, "int32", False, dp=4, tp=2, kind=MESH_CHECK)


@pytest.mark.parametrize(
    "change,words",
    [
        ({"recompiles": 1}, "compiles on steps"),
        ({"resharded": True}, "another sharding"),
        ({"collectives": {**CLEAN_CHECK["collectives"], "resolve": 2}}, "collectives"),
        ({"ok": False, "diffs": ["step 3 rank 1 tokens: ..."]}, None),
    ],
)
def test_mesh_check_failures_fail_the_row(change, words):
    """Pins: a recompile on a seen shape, a resharded state, a collective in the HLO or a
    byte difference in the sharded map's check leaving its row (and the exit status) ok."""
    assert mesh_check_result(CHECK_JOB, CLEAN_CHECK, 30).ok
    r = mesh_check_result(CHECK_JOB, {**CLEAN_CHECK, **change}, 30)
    assert not r.ok
    if words is None:
        assert r.divergences == 1 and r.first_divergence.startswith("step 3")
    else:
        assert words in r.failures[0]


def _rank_row(rank: int, **change: object) -> dict[str, object]:
    row = {
        "rank": rank,
        "steps": 6,
        "ops_compared": 36,
        "divergences": 0,
        "first": None,
        "errors": [None, None],
        "streams_equal": True,
        "ok": True,
    }
    return {**row, **change}


def test_mesh_rank_failures_fail_the_row():
    """Pins: one rank's diverging trace, stream mismatch, error, or its unsharded twin failing
    the reference oracle being lost when the ranks fold into one row."""
    job = Job("steady_decode", "int32", True, dp=2, tp=2)
    clean = mesh_job_result(job, [_rank_row(0), _rank_row(1)], [None, None])
    assert clean.ok and clean.ops_compared == 72 and clean.to_json()["dp"] == 2
    bad = [
        ([_rank_row(0), _rank_row(1, divergences=2, first="op 5", ok=False)], [None, None]),
        ([_rank_row(0), _rank_row(1, streams_equal=False, ok=False)], [None, None]),
        ([_rank_row(0, errors=[None, "boom"], ok=False), _rank_row(1)], [None, None]),
        ([_rank_row(0), _rank_row(1)], [None, "request 3, stream entry 0: got 1, reference 2"]),
    ]
    for rows, oracle in bad:
        assert not mesh_job_result(job, rows, oracle).ok, (rows, oracle)


def test_failing_mesh_row_exits_1(monkeypatch, capsys):
    """Pins: a mesh run whose rows fail (here: a collective in the HLO) still exiting 0."""
    import parity.runner

    failing = mesh_check_result(CHECK_JOB, {**CLEAN_CHECK, "resharded": True}, 30)

    def fake_run_jobs(jobs, progress=None):
        assert all(j.dp == 4 and j.tp == 2 for j in jobs)
        return [failing for _ in jobs]

    monkeypatch.setattr(parity.runner, "run_jobs", fake_run_jobs)
    assert cli.main(["--dp", "4", "--tp", "2", "--scenario", "idle_steps", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "another sharding" in out


def test_plain_report_keeps_its_schema():
    """Pins: unsharded rows growing the mesh keys (the existing JSON schema must not change)."""
    r = ScenarioResult("idle_steps", "int32", False, 5, 40, 0, True)
    assert set(r.to_json()) == SCENARIO_KEYS
