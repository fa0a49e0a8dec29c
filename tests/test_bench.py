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
IMPLS = {
    "fm_jax",
    "fm_jax_host",
    "fm_jax_fused",
    "fm_torch",
    "sglang_torch",
    "sglang_jax",
    "naive_jax",
    "floor",
    "floor_host",
}


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
    """Pins a renamed or missing JSON field, or an impl name outside the documented nine."""
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
    # sglang_jax has tokens only: no lengths, spec extras or debug mode.
    sj = [r for r in rows if r["impl"] == "sglang_jax"]
    assert {r["op"] for r in sj} == {
        "stash",
        "resolve_decode",
        "resolve_mixed",
        "invalidate",
        "step",
    }
    assert not any(r["spec"] or r["debug"] for r in sj)
    assert any(r["impl"] == "sglang_torch" and r["debug"] for r in rows)
    assert any(r["impl"] == "sglang_torch" and r["op"] == "resolve_spec" for r in rows)


def test_headline_figures_and_files_are_written(tiny_run: tuple[dict[str, Any], Path]) -> None:
    """Pins a run that drops the headline table, the markdown report or a plot."""
    doc, out, _ = tiny_run
    figs = doc["headline"]
    for peer in ("sglang_jax step", "sglang_torch step", "floor_host", "floor (2 dispatches"):
        assert any(peer in f["figure"] for f in figs), peer
    for f in figs:
        assert {"figure", "ratio", "target", "pass", "numerator_us", "denominator_us"} <= set(f)
    head = doc["headline_results"]
    assert head and all(r["op"] == "step" and set(r) >= ROW_KEYS for r in head)
    md = (out / "results.md").read_text()
    assert "Headline figures" in md and "| fm_jax |" not in md.split("Headline")[0]
    assert "Headline group: step" in md
    assert (out / "cost_vs_batch.png").stat().st_size > 0
    assert (out / "cost_vs_pool.png").stat().st_size > 0


def test_int64_runs_in_an_x64_child(
    tiny_run: tuple[dict[str, Any], Path, list[dict[str, Any]]],
) -> None:
    """Pins the int64 part: it must run under JAX_ENABLE_X64=1 and report int64 rows."""
    _, _, rows = tiny_run
    assert rows and all(r["dtype"] == "int64" for r in rows)
    want = {"fm_jax", "fm_jax_host", "fm_torch", "naive_jax", "sglang_torch", "sglang_jax"}
    assert want <= {r["impl"] for r in rows}
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


def test_headline_only_json_has_the_headline_group_in_the_row_schema(tmp_path: Path) -> None:
    """`--headline-only --json` writes the usual document: its results are the headline
    group's step rows, and no other file is written."""
    path = tmp_path / "h.json"
    assert cli.main(["--plan", "tiny", "--headline-only", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert {"device", "meta", "results", "headline"} <= set(doc)
    assert "headline only" in doc["meta"]["plan"]
    rows = doc["results"]
    assert rows and all(set(r) >= ROW_KEYS and r["op"] == "step" for r in rows)
    assert {r["impl"] for r in rows} == IMPLS
    named = {f["numerator"] for f in doc["headline"]} | {f["denominator"] for f in doc["headline"]}
    assert "sglang_jax step B=8 R=64" in named and "floor_host step B=8 R=64" in named
    assert [p.name for p in tmp_path.iterdir()] == ["h.json"]


# --------------------------------------------------------------------- baselines' values


def _tiny(spec: bool = False) -> tuple[Any, Any]:
    from bench.workload import Config, host_data

    cfg = Config(8, 64, spec=spec, hidden=16) if spec else Config(8, 64)
    return cfg, host_data(cfg)


@pytest.mark.parametrize("impl", ["fm_jax", "fm_jax_host", "sglang_torch", "sglang_jax"])
def test_each_step_resolves_what_the_previous_step_stashed(impl: str) -> None:
    """Two steps in a row: each resolve returns the tokens (and lengths) stashed before."""
    import numpy as np

    from bench import run

    cfg, data = _tiny()
    step = run.BUILDERS[impl](cfg, data, False, ("step",))["step"]
    for _ in range(2):
        step.setup()
        out = step.run()
        if impl == "sglang_jax":
            ids, lens = out, None
        elif impl == "sglang_torch":
            ids, lens = out[0], out[1]
        else:
            ids, lens = out.input_ids, out.seq_lens
        np.testing.assert_array_equal(np.asarray(ids)[: cfg.batch], data.tokens)
        if lens is not None:
            np.testing.assert_array_equal(np.asarray(lens)[: cfg.batch], data.lens)


def test_sglang_torch_spec_step_relays_the_draft() -> None:
    """Spec: the step's resolve gathers exactly the draft that the previous stash wrote."""
    import numpy as np
    import torch

    from bench.impls import sglang_torch

    cfg, data = _tiny(spec=True)
    step = sglang_torch.build(cfg, data, False, ("step",))["step"]
    for _ in range(2):
        step.setup()
        _, lens, draft = step.run()
        np.testing.assert_array_equal(lens.numpy(), data.lens)
        np.testing.assert_array_equal(draft.bonus_tokens.numpy(), data.tokens)
        np.testing.assert_array_equal(draft.topk_p.numpy(), data.topk_p)
        np.testing.assert_array_equal(draft.topk_index.numpy(), data.topk_index)
        want = torch.as_tensor(data.hidden).to(torch.bfloat16)
        assert torch.equal(draft.hidden_states, want)


def test_sglang_torch_ci_mode_catches_a_read_without_a_write() -> None:
    """SGLang's CI mode: a gather that finds no stash since the last read fails; the
    production map (debug off) has no check and returns the stale token."""
    import torch

    from bench.impls.sglang_torch import Batch, SGLangFutureMap

    idx = torch.tensor([3, 5], dtype=torch.int64)

    def decode() -> Batch:
        return Batch(True, idx, -idx, -idx)

    for debug in (False, True):
        fm = SGLangFutureMap(8, torch.device("cpu"), debug=debug)
        fm.publish(idx, torch.tensor([4, 9]))
        fm.stash(idx, torch.tensor([11, 0]))  # token 0 is a token, not a poison
        b = decode()
        fm.resolve(b)
        assert b.input_ids.tolist() == [11, 0] and b.seq_lens.tolist() == [4, 9]
        b = decode()
        if debug:
            with pytest.raises(RuntimeError):
                fm.resolve(b)  # read, read: no write in between
        else:
            fm.resolve(b)
            assert b.input_ids.tolist() == [11, 0]
    fresh = SGLangFutureMap(8, torch.device("cpu"), debug=True)
    fresh.publish(idx, torch.tensor([4, 9]))
    with pytest.raises(RuntimeError):
        fresh.resolve(decode())  # read before the first write


def test_sglang_jax_map_follows_the_peer() -> None:
    """Slots are req_pool_idx + 1 in a map of R + 2; padding rows are dropped and resolve
    to 0; real ids pass through; a set leaves the previous map intact (no donation)."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from bench.impls import sglang_jax as sj

    fm = sj.FutureTokenMap(6)
    assert fm.map.shape == (8,) and fm.map.dtype == np.int32
    assert fm.map.sharding.spec in (P(None), P())
    seq_lens = np.array([5, 0, 7, 2])  # row 1 is padding
    rpi = np.array([0, 0, 5, 2])
    slots = sj.future_slots(seq_lens, rpi, fm.size)
    assert slots.tolist() == [1, 8, 6, 3]
    before = fm.map
    fm.set(slots, fm.on_mesh(np.array([40, 41, 42, 43])))
    assert np.asarray(before).tolist() == [0] * 8
    assert np.asarray(fm.map).tolist() == [0, 40, 0, 43, 0, 0, 42, 0]
    ids = sj.placeholders(seq_lens, slots)
    assert ids.tolist() == [-1, 0, -6, -3]
    out = fm.resolve(fm.on_mesh(np.concatenate([[17, 0], ids[[0, 2]]])))
    assert np.asarray(out).tolist() == [17, 0, 40, 42]
    assert isinstance(out, jax.Array) and out.sharding.spec == P("data")


def test_sglang_jax_has_no_spec_lengths_or_debug() -> None:
    """The peer relays tokens only: a spec or debug configuration has nothing to measure."""
    from bench.impls import sglang_jax

    cfg, data = _tiny()
    assert sglang_jax.build(cfg, data, True, cfg.ops()) == {}
    assert "publish" not in sglang_jax.build(cfg, data, False, cfg.ops())
    scfg, sdata = _tiny(spec=True)
    assert sglang_jax.build(scfg, sdata, False, scfg.ops()) == {}


@pytest.mark.parametrize("host", [False, True])
def test_floor_step_is_two_dispatches_on_the_arrays_the_class_takes(
    host: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """floor (jax arrays) and floor_host (numpy arrays): a step is two no-op dispatches,
    resolve's batch then finish's slots, lengths and payload, as the class step is."""
    import jax
    import numpy as np

    from bench.impls import floor

    calls: list[tuple[Any, ...]] = []
    real = floor._noop

    def counting(*arrays: Any) -> Any:
        calls.append(arrays)
        return real(*arrays)

    monkeypatch.setattr(floor, "_noop", counting)
    cfg, data = _tiny()
    build = floor.build_host if host else floor.build
    build(cfg, data, False, ("step",))["step"].run()
    assert [len(a) for a in calls] == [3, 3]
    kind = np.ndarray if host else jax.Array
    assert all(isinstance(x, kind) for a in calls for x in a)
    np.testing.assert_array_equal(np.asarray(calls[0][1]), -data.idx)
    np.testing.assert_array_equal(np.asarray(calls[1][2]), data.tokens)


def test_startup_table_comes_from_fresh_processes(tiny_run) -> None:
    """The tiny run's start-up rows: each mode measured in its own process; the process
    that starts from the filled persistent cache compiles nothing and loads every
    executable; the report prints the table."""
    doc, out, _ = tiny_run
    rows = {r["mode"]: r for r in doc["startup"] if r["map"] == "plain"}
    assert set(rows) == {"no cache", "filling the cache", "from the cache"}
    assert all(r["runs"] == 1 and r["warm_up_s"] > 0 for r in rows.values())
    assert rows["no cache"]["compiled"] == rows["no cache"]["executables"] > 0
    assert rows["from the cache"]["compiled"] == 0
    assert rows["from the cache"]["from_cache"] == rows["from the cache"]["executables"]
    assert "## Start-up" in (out / "results.md").read_text()
