"""fm-parity end to end: arguments, table, JSON schema, exit status (the report's fields:
docs/parity.md; what they compare: docs/CONTRACT.md)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from fm_parity import cli
from fm_parity.mutations import MUTATIONS

SCENARIO_KEYS = {
    "name",
    "spec_kernel",
    "dtype",
    "debug",
    "steps",
    "ops_compared",
    "divergences",
    "oracle_ok",
    "protocol",
}


def test_console_script_is_installed():
    """`fm-parity` (the README's first command) must resolve to fm_parity.cli:main."""
    try:
        importlib.metadata.distribution("fm-jax")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fm-jax is not installed (run from the source tree): no console scripts")
    proc = subprocess.run(
        ["fm-parity", "--list"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "long_run" in proc.stdout and "spec_decode" in proc.stdout


def test_cli_end_to_end_with_int64_worker_and_json(tmp_path, capsys):
    """int32 runs here and int64 in the x64 worker process (token ids above 2**32, bf16 NaN
    payloads), each under both relay protocols and a spec scenario under both spec kernels
    by default; the table prints with protocol and kernel columns and the JSON has
    exactly the report schema; exit 0."""
    out = tmp_path / "report.json"
    code = cli.main(
        [
            "--scenario",
            "idle_steps",
            "--scenario",
            "spec_decode",
            "--steps",
            "14",
            "--debug",
            "off",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    header = stdout.splitlines()[0].split()
    assert header[:5] == ["scenario", "protocol", "kernel", "dtype", "debug"]
    assert "oracle" in header
    doc = json.loads(out.read_text())
    assert set(doc) == {"device", "scenarios", "mutations"} and doc["device"] == "cpu"
    assert [(s["name"], s["protocol"], s["spec_kernel"], s["dtype"]) for s in doc["scenarios"]] == [
        (name, protocol, kernel, dtype)
        for name in ("idle_steps", "spec_decode")
        for protocol in ("sentinel", "gather")
        for kernel in (("xla", "pallas") if name == "spec_decode" else ("xla",))
        for dtype in ("int32", "int64")
    ]
    for s in doc["scenarios"]:
        assert set(s) == SCENARIO_KEYS
        assert s["steps"] == 14 and s["ops_compared"] > 0
        assert s["divergences"] == 0 and s["oracle_ok"] is True and s["debug"] is False
    assert doc["mutations"] == []


@pytest.mark.slow  # every mutation through the CLI; each is also caught in test_parity_mutations
def test_cli_mutations_are_all_caught(tmp_path, capsys):
    """`--mutations` (fm_jax mutated) reports which detectors caught each variant, each
    under its own protocol; none may be null, and parity must be among them (fm_jax
    differs from fm_torch), or for a resolve that syncs the 'sync' check. The gather
    protocol's MIXED and spec mistakes need a MIXED and a spec scenario (spec MIXED: a
    gather-only one), a lost verified id a spec scenario relaying them, a one-row view
    batches of one row (in debug mode, the only one where it shows), a confidence
    generation not snapshotted the confidence relay's scenario, zeroed kept rows a
    scenario of partial stashes."""
    out = tmp_path / "m.json"
    code = cli.main(
        [
            "--scenario",
            "retire_reuse",
            "--scenario",
            "mixed_batches",
            "--scenario",
            "spec_decode",
            "--scenario",
            "spec_verified",
            "--scenario",
            "spec_mixed",
            "--scenario",
            "one_row",
            "--scenario",
            "spec_confidence",
            "--scenario",
            "spec_partial",
            "--dtype",
            "int32",
            "--debug",
            "off",
            "--mutations",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert len(doc["mutations"]) == len(MUTATIONS) >= 11
    for m in doc["mutations"]:
        assert set(m) == {"name", "protocol", "caught_by"} and m["caught_by"], m
        assert m["protocol"] == MUTATIONS[m["name"]].judged_under
        # A resolve that syncs changes no value: the 'sync' check alone sees it; a read of
        # lengths waiting twice neither: the debug 'fresh publish' check alone.
        want = {"host_copy_syncs": "sync", "reads_lengths_twice": "debug"}.get(m["name"], "parity")
        assert want in m["caught_by"].split("+"), m
    assert {m["protocol"] for m in doc["mutations"]} == {"sentinel", "gather"}
    assert "caught by" in capsys.readouterr().out


def test_cli_rejects_unknown_scenario_and_missing_gpu(capsys):
    """Bad arguments and an absent GPU exit 2 with a message naming the problem."""
    assert cli.main(["--scenario", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert cli.main(["--device", "cuda", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "--device cuda" in err and ("no CUDA" in err or "no GPU" in err)
