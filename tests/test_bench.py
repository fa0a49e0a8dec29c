"""fm-bench runs end to end on tiny sizes and writes the documented JSON schema.

No timing assertions: speed is what the benchmark reports, not what a test checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import cli

ROW_KEYS = {
    "impl",
    "op",
    "batch",
    "pool",
    "spec",
    "dtype",
    "debug",
    "median_us",
    "p10_us",
    "p90_us",
}
IMPLS = {"fm_jax", "fm_jax_fused", "fm_torch", "naive_jax", "floor"}


@pytest.fixture(scope="module")
def tiny_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], Path, list[dict[str, Any]]]:
    """The tiny plan in process, and its int64 part in an x64 child running alongside."""
    out = tmp_path_factory.mktemp("bench")
    child_json = out / "int64.json"
    env = dict(os.environ, JAX_ENABLE_X64="1")
    cmd = [sys.executable, "-m", "bench.cli", "--child-int64", "--plan", "tiny"]
    child = subprocess.Popen(
        [*cmd, "--json", str(child_json)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=Path(cli.__file__).parents[1],
    )
    rc = cli.main(
        ["--plan", "tiny", "--no-int64", "--json", str(out / "r.json"), "--out", str(out)]
    )
    _, err = child.communicate(timeout=300)
    assert rc == 0
    assert child.returncode == 0, err.decode()[-2000:]
    int64_rows = json.loads(child_json.read_text())["results"]
    return json.loads((out / "r.json").read_text()), out, int64_rows


def test_json_rows_follow_the_schema(tiny_run: tuple[dict[str, Any], Path]) -> None:
    """Pins a renamed or missing JSON field, or an impl name outside the documented five."""
    doc, _, _ = tiny_run
    assert isinstance(doc["device"], str) and doc["device"]
    rows = doc["results"]
    assert rows
    for r in rows:
        assert set(r) >= ROW_KEYS, r
        assert r["impl"] in IMPLS
        assert r["dtype"] in ("int32", "int64")
        assert isinstance(r["debug"], bool) and isinstance(r["spec"], bool)
        assert r["p10_us"] <= r["median_us"] <= r["p90_us"]
    assert {r["impl"] for r in rows} == IMPLS
    ops = {r["op"] for r in rows}
    for op in ("publish", "stash", "stash_spec", "resolve_decode", "resolve_mixed"):
        assert op in ops
    assert {"resolve_spec", "invalidate", "step"} <= ops
    # fm_jax debug rows are impl fm_jax with debug true; the fused step is op "step".
    assert any(r["impl"] == "fm_jax" and r["debug"] for r in rows)
    assert all(r["op"] == "step" for r in rows if r["impl"] == "fm_jax_fused")


def test_headline_figures_and_files_are_written(tiny_run: tuple[dict[str, Any], Path]) -> None:
    """Pins a run that drops the headline table, the markdown report or a plot."""
    doc, out, _ = tiny_run
    figs = doc["headline"]
    assert any("vs fm_torch eager" in f["figure"] for f in figs)
    for f in figs:
        assert {"figure", "ratio", "target", "pass", "numerator_us", "denominator_us"} <= set(f)
    md = (out / "results.md").read_text()
    assert "Headline figures" in md and "| fm_jax |" not in md.split("Headline")[0]
    assert (out / "cost_vs_batch.png").stat().st_size > 0
    assert (out / "cost_vs_pool.png").stat().st_size > 0


def test_int64_runs_in_an_x64_child(
    tiny_run: tuple[dict[str, Any], Path, list[dict[str, Any]]],
) -> None:
    """Pins the int64 part: it must run under JAX_ENABLE_X64=1 and report int64 rows."""
    _, _, rows = tiny_run
    assert rows and all(r["dtype"] == "int64" for r in rows)
    assert {"fm_jax", "fm_torch", "naive_jax"} <= {r["impl"] for r in rows}
    assert all(set(r) >= ROW_KEYS for r in rows)


def test_single_thread_xla_is_set_before_jax_starts() -> None:
    """Pins --xla-cpu-threads 1 being applied too late or silently ignored: in a fresh
    process it must put the single-thread flags into XLA_FLAGS before jax is imported, and
    in a process that already runs JAX it must refuse rather than measure the wrong setup."""
    code = (
        "import os, sys\n"
        "from bench import cli\n"
        "cli.single_thread_xla()\n"
        "print('jax' in sys.modules, os.environ['XLA_FLAGS'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(cli.__file__).parents[1],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    jax_loaded, flags = proc.stdout.split(" ", 1)
    assert jax_loaded == "False" and "intra_op_parallelism_threads=1" in flags
    import jax  # noqa: F401  (this process runs JAX already)

    with pytest.raises(SystemExit):
        cli.main(["--xla-cpu-threads", "1", "--plan", "tiny"])
