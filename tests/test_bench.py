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


def test_inplace_check_sees_no_rewrite_and_no_thread_split_in_fm_jax_ops() -> None:
    """The in-place table's claims at a pool where XLA:CPU splits ops by default (1 MB)."""
    import jax

    from bench import inplace
    from bench.workload import Config

    got = inplace.check(Config(64, 1 << 18), debug=False)
    assert set(got) == {"publish", "stash", "resolve_decode", "fused step"}
    assert all(v["whole_buffer_ops"] == 0 and v["aliased"] for v in got.values())
    if jax.default_backend() == "cpu":
        assert all(v["thread_splits"] == 0 for v in got.values())


def test_whole_buffer_ops_counts_the_naive_copy() -> None:
    """The control for the test above: an undonated scatter copies the whole map."""
    import jax
    import jax.numpy as jnp

    from bench import inplace

    pool = 1 << 12

    def naive(m: jax.Array, i: jax.Array) -> jax.Array:
        return m.at[i].set(i, mode="drop")

    hlo = jax.jit(naive).lower(jnp.zeros(pool, jnp.int32), jnp.arange(8)).compile().as_text()
    assert inplace.whole_buffer_ops(hlo, pool)


def test_thread_split_benchmark_runs_on_tiny_sizes() -> None:
    """bench.thread_split: both option sets measured per pool, splits counted."""
    from bench import thread_split

    rows = thread_split.measure(batch=8, pools=[64, 128], reps=3)
    assert [r["pool"] for r in rows] == [64, 128]
    assert all(r["default_us"] > 0 and r["fm_jax_us"] > 0 for r in rows)
    assert all(r["fm_jax_splits"] == 0 for r in rows)
