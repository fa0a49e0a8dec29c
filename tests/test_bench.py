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

from fm_bench import cli
from fm_parity.exchange import to_numpy

ROW_KEYS = {
    "impl",
    "op",
    "batch",
    "pool",
    "spec",
    "dtype",
    "protocol",
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
    "floor_state",
}


@pytest.fixture(scope="module")
def tiny_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], Path, list[dict[str, Any]]]:
    """The tiny plan in process, and its int64 part in an x64 child running alongside."""
    out = tmp_path_factory.mktemp("bench")
    child_json = out / "int64.json"
    env = dict(os.environ, JAX_ENABLE_X64="1")
    cmd = [sys.executable, "-m", "fm_bench.cli", "--child-int64", "--plan", "tiny"]
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
        assert r["protocol"] == "sentinel"  # the sweeps; the protocol groups are apart
        assert isinstance(r["debug"], bool) and isinstance(r["spec"], bool)
        assert r["p10_us"] <= r["median_us"] <= r["p90_us"]
        # Host time with one step in flight, and that loop's wall time per step (a fused
        # row's are marginal: step minus baseline, and may come out <= 0).
        assert isinstance(r["host_us"], float) and isinstance(r["pipe_us"], float), r
        if r["impl"] != "fm_jax_fused":
            assert r["host_us"] > 0 and r["pipe_us"] > 0, r
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
        # The target judges the host-time ratio; the waited one is kept beside it.
        # (a figure about device work growing with R is judged on the waited medians).
        assert {"host_ratio", "waited_ratio", "numerator_host_us", "judged_on"} <= set(f)
        assert f["ratio"] == f[f"{f['judged_on']}_ratio"]
        assert (f["judged_on"] == "waited") == (
            " vs R=" in f["figure"] or "speed-up" in f["figure"]
        )
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


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_inplace_check_sees_no_rewrite_and_no_thread_split_in_fm_jax_ops(
    protocol: str, tmp_path: Path
) -> None:
    """The in-place table's claims at a pool where XLA:CPU splits ops by default (1 MB),
    under either protocol; each op's HLO is written where asked."""
    import jax

    from fm_bench import inplace
    from fm_bench.workload import Config

    got = inplace.check(Config(64, 1 << 18, protocol=protocol), debug=False, dump=tmp_path)
    assert set(got) == {"publish", "stash", "resolve_decode", "finish", "fused step"}
    assert len(list(tmp_path.glob("*.hlo.txt"))) == len(got)
    assert all(v["kernels"] >= 1 for v in got.values())
    assert all(v["whole_buffer_ops"] == 0 and v["aliased"] for v in got.values())
    if jax.default_backend() == "cpu":
        assert all(v["thread_splits"] == 0 for v in got.values())


def test_whole_buffer_ops_counts_the_naive_copy() -> None:
    """The control for the test above: an undonated scatter copies the whole map."""
    import jax
    import jax.numpy as jnp

    from fm_bench import inplace

    pool = 1 << 12

    def naive(m: jax.Array, i: jax.Array) -> jax.Array:
        return m.at[i].set(i, mode="drop")

    hlo = jax.jit(naive).lower(jnp.zeros(pool, jnp.int32), jnp.arange(8)).compile().as_text()
    assert inplace.whole_buffer_ops(hlo, pool)


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
    from fm_bench.workload import Config, host_data

    cfg = Config(8, 64, spec=spec, hidden=16) if spec else Config(8, 64)
    return cfg, host_data(cfg)


STEP_CASES = [
    ("fm_jax", "sentinel"),
    ("fm_jax_host", "sentinel"),
    ("sglang_torch", "sentinel"),
    ("sglang_jax", "sentinel"),
    ("fm_jax", "gather"),
    ("fm_jax_host", "gather"),
    ("sglang_torch", "gather"),
]


@pytest.mark.parametrize(("impl", "protocol"), STEP_CASES)
def test_each_step_resolves_what_the_previous_step_stashed(impl: str, protocol: str) -> None:
    """Two steps in a row: each resolve returns the tokens (and lengths) stashed before;
    in the gather protocol the ids are gathered and the lengths are the host's."""
    from dataclasses import replace

    import numpy as np

    from fm_bench import run

    cfg, data = _tiny()
    cfg = replace(cfg, protocol=protocol)
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
        np.testing.assert_array_equal(to_numpy(ids)[: cfg.batch], data.tokens)
        if lens is not None:
            np.testing.assert_array_equal(to_numpy(lens)[: cfg.batch], data.lens)


def test_sglang_torch_spec_step_relays_the_draft() -> None:
    """Spec: the step's resolve gathers exactly the draft that the previous stash wrote."""
    import numpy as np
    import torch

    from fm_bench.impls import sglang_torch

    cfg, data = _tiny(spec=True)
    step = sglang_torch.build(cfg, data, False, ("step",))["step"]
    for _ in range(2):
        step.setup()
        _, lens, draft = step.run()
        np.testing.assert_array_equal(to_numpy(lens), data.lens)
        np.testing.assert_array_equal(to_numpy(draft.bonus_tokens), data.tokens)
        np.testing.assert_array_equal(to_numpy(draft.topk_p), data.topk_p)
        np.testing.assert_array_equal(to_numpy(draft.topk_index), data.topk_index)
        want = torch.as_tensor(data.hidden).to(torch.bfloat16)
        assert torch.equal(draft.hidden_states.cpu(), want)


def test_sglang_torch_ci_mode_catches_a_read_without_a_write() -> None:
    """SGLang's CI mode: a gather that finds no stash since the last read fails; the
    production map (debug off) has no check and returns the stale token."""
    import torch

    from fm_bench.impls.sglang_torch import Batch, SGLangFutureMap

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

    from fm_bench.impls import sglang_jax as sj

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
    from fm_bench.impls import sglang_jax

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

    from fm_bench.impls import floor

    calls: list[tuple[Any, ...]] = []
    real = floor.noop

    def counting(*arrays: Any) -> Any:
        calls.append(arrays)
        return real(*arrays)

    monkeypatch.setattr(floor, "noop", counting)
    cfg, data = _tiny()
    build = floor.build_host if host else floor.build
    build(cfg, data, False, ("step",))["step"].run()
    assert [len(a) for a in calls] == [3, 3]
    kind = np.ndarray if host else jax.Array
    assert all(isinstance(x, kind) for a in calls for x in a)
    np.testing.assert_array_equal(np.asarray(calls[0][1]), -data.idx)
    np.testing.assert_array_equal(np.asarray(calls[1][2]), data.tokens)
    # Every argument reaches the executable (and a numpy one is transferred): jit's default
    # drops the arguments a function does not read.
    for a in calls:
        assert real.lower(*a).compile().as_text().count("parameter(") == len(a)


def test_floor_state_carries_the_state_through_the_head_and_the_tail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """floor_state: the step's two no-ops take the map's state as the class's calls do:
    the head reads it (nothing donated), the tail donates it and gets it back, and the
    next step's head reads what the tail gave back."""
    import jax

    from fm_bench.impls import floor

    seen: list[tuple[str, Any]] = []
    read, write = floor.noop_read, floor.noop_write

    def reading(state: Any, *arrays: Any) -> Any:
        seen.append(("read", state))
        return read(state, *arrays)

    def writing(state: Any, *arrays: Any) -> Any:
        seen.append(("write", state))
        return write(state, *arrays)

    monkeypatch.setattr(floor, "noop_read", reading)
    monkeypatch.setattr(floor, "noop_write", writing)
    cfg, data = _tiny()
    step = floor.build_state(cfg, data, False, ("step",))["step"]
    step.run()
    step.run()
    assert [k for k, _ in seen] == ["read", "write", "read", "write"]
    first = jax.tree.leaves(seen[0][1])
    assert len(first) == 2 and all(x.shape == (cfg.pool,) for x in first)
    assert seen[0][1] is seen[1][1] and seen[2][1] is seen[3][1]  # one state per step
    assert seen[2][1] is not seen[0][1]  # the tail's, given back
    assert all(x.is_deleted() for x in jax.tree.leaves(seen[1][1]))  # donated
    assert floor.build_state(cfg, data, True, ("step",)) == {}  # no debug variant


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


# ------------------------------------------------------------------------------ protocols


def test_protocol_groups_compare_every_impl_op_and_map(tiny_run) -> None:
    """The tiny run's protocol groups: every FutureMap implementation has both protocols'
    rows for each op it implements (no invalidate in gather), and each comparison's ratio
    is the median of its runs' ratios; the report prints the table."""
    import statistics

    from fm_bench.plan import PROTOCOL_IMPLS, get

    doc, out, _ = tiny_run
    runs = get("tiny").protocols.runs
    rows = doc["protocol_results"]
    assert rows and all(set(r) >= ROW_KEYS and len(r["run_medians_us"]) == runs for r in rows)
    # Every row has its host and pipe figures: each run's, and their median.
    for r in rows:
        for f in ("host_us", "pipe_us"):
            assert len(r["run_" + f]) == runs
            assert r[f] == pytest.approx(statistics.median(r["run_" + f]), abs=0.01)
    assert {r["protocol"] for r in rows} == {"sentinel", "gather"}
    assert not any(r["op"] == "invalidate" for r in rows)
    plain = {("stash", False), ("resolve_decode", False), ("resolve_mixed", False)}
    every = plain | {("step", False), ("resolve_spec", True), ("step", True)}
    want = {impl: every for impl in PROTOCOL_IMPLS}
    want["fm_jax_fused"] = {("step", False), ("step", True)}
    comps = doc["protocols"]
    got: dict[str, set[tuple[str, bool]]] = {}
    for c in comps:
        got.setdefault(c["impl"], set()).add((c["op"], c["spec"]))
    assert got == want
    by = {(r["impl"], r["op"], r["spec"], r["protocol"]): r for r in rows}
    for c in comps:
        if c["ratio"] is None:  # a fused marginal cost <= 0 in every run
            continue
        s = by[(c["impl"], c["op"], c["spec"], "sentinel")]["run_medians_us"]
        g = by[(c["impl"], c["op"], c["spec"], "gather")]["run_medians_us"]
        ratios = [b / a for a, b in zip(s, g, strict=True) if a > 0]
        assert c["ratio"] == pytest.approx(statistics.median(ratios), abs=1e-3)
        assert c["ratio_range"][0] <= c["ratio"] <= c["ratio_range"][1]
        assert c["runs"] == runs
    for c in comps:  # the same comparison on host time
        if c["host_ratio"] is None:
            continue
        s = by[(c["impl"], c["op"], c["spec"], "sentinel")]["run_host_us"]
        g = by[(c["impl"], c["op"], c["spec"], "gather")]["run_host_us"]
        ratios = [b / a for a, b in zip(s, g, strict=True) if a > 0]
        assert c["host_ratio"] == pytest.approx(statistics.median(ratios), abs=1e-3)
        assert c["host_sentinel_us"] == pytest.approx(statistics.median(s), abs=0.01)
    md = (out / "results.md").read_text()
    assert "Protocols: gather vs sentinel" in md and "| host µs: sentinel |" in md


def test_protocols_only_writes_its_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--protocols-only --out` writes protocols_<platform>.{json,md} (never results.*) with
    the command that made them; one implementation and one run keep it quick."""
    from dataclasses import replace

    import jax

    from fm_bench import plan

    tiny = plan.PLANS["tiny"]

    def one_impl() -> plan.Plan:
        p = tiny()
        assert p.protocols is not None
        return replace(p, protocols=replace(p.protocols, impls=("sglang_torch",), runs=1))

    monkeypatch.setitem(plan.PLANS, "tiny", one_impl)
    assert cli.main(["--plan", "tiny", "--protocols-only", "--out", str(tmp_path)]) == 0
    stem = f"protocols_{jax.devices()[0].platform}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.json", f"{stem}.md"]
    doc = json.loads((tmp_path / f"{stem}.json").read_text())
    assert doc["meta"]["plan"] == "tiny, protocols only"
    assert doc["meta"]["command"].startswith("fm-bench --plan tiny --protocols-only")
    assert not doc["results"] and not doc["headline"] and not doc["startup"]
    assert {c["impl"] for c in doc["protocols"]} == {"sglang_torch"}
    assert all(c["runs"] == 1 for c in doc["protocols"])
    md = (tmp_path / f"{stem}.md").read_text()
    assert "fm-bench --plan tiny --protocols-only" in md and "| sglang_torch |" in md


def test_gather_configs_have_no_invalidate_and_sentinel_only_impls_build_nothing() -> None:
    """A gather configuration measures no invalidate; the implementations that relay by
    placeholders only (sglang_jax, naive_jax, the floors) build nothing for it."""
    from fm_bench import run
    from fm_bench.workload import Config, host_data

    for spec in (False, True):
        cfg = Config(8, 64, spec=spec, hidden=16, protocol="gather")
        assert "invalidate" not in cfg.ops() and "step" in cfg.ops()
        data = host_data(cfg)
        for impl in ("sglang_jax", "naive_jax", "floor", "floor_host"):
            assert run.BUILDERS[impl](cfg, data, False, cfg.ops()) == {}, impl
    with pytest.raises(ValueError, match="protocol"):
        Config(8, 64, protocol="sentinels")


def test_gather_mixed_batch_is_the_sentinel_batch_relaid() -> None:
    """The MIXED batch's gather layouts name the same rows as its sentinels: fm_torch's
    (prefill ids, running slots) and fm_jax's per-token ids and slots."""
    import numpy as np

    _, data = _tiny()
    sentinel = data.mixed_ids < 0
    np.testing.assert_array_equal(data.mixed_prefill, data.mixed_ids[~sentinel])
    np.testing.assert_array_equal(data.mixed_running, -data.mixed_ids[sentinel])
    ids, slots = data.mixed_token_slots()
    np.testing.assert_array_equal(slots, np.where(sentinel, -data.mixed_ids, 0))
    np.testing.assert_array_equal(ids, np.where(sentinel, 0, data.mixed_ids))


def _resolved(out: Any) -> tuple[Any, Any, Any]:
    """(input ids, lengths, bonus tokens or None) of a resolve op's output, any impl."""

    draft = getattr(out, "draft", None) or getattr(out, "spec_info", None)
    bonus = None
    if draft is not None:
        payload = getattr(draft, "payload", draft)
        bonus = to_numpy(payload.bonus_tokens)
    ids = None if out.input_ids is None else to_numpy(out.input_ids)
    return ids, to_numpy(out.seq_lens), bonus


@pytest.mark.parametrize("impl", ["fm_jax", "fm_jax_host", "fm_torch", "sglang_torch"])
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_each_resolve_op_builds_the_forwards_inputs(impl: str, protocol: str) -> None:
    """What each resolve op measures is a correct resolve in either protocol: DECODE ids
    are the stashed tokens (lengths the published ones), MIXED ids the prefill ids then
    the running rows' tokens, and a spec resolve the published lengths and bonus tokens."""
    import numpy as np

    from fm_bench import run
    from fm_bench.workload import Config, host_data

    for cfg in (
        Config(8, 64, protocol=protocol),
        Config(8, 64, True, hidden=16, protocol=protocol),
    ):
        data = host_data(cfg)
        ops = run.BUILDERS[impl](cfg, data, False, cfg.ops())
        want_mixed = np.concatenate([data.mixed_prefill, data.tokens[cfg.batch // 2 :]])
        names = ("resolve_spec",) if cfg.spec else ("resolve_decode", "resolve_mixed")
        for name in names:
            ops[name].setup()
            ids, lens, bonus = _resolved(ops[name].run())
            b = cfg.batch
            if name == "resolve_mixed":
                np.testing.assert_array_equal(ids[: len(want_mixed)], want_mixed)
                np.testing.assert_array_equal(lens[:b], data.mixed_lens)
            else:
                np.testing.assert_array_equal(lens[:b], data.lens)
            if name == "resolve_decode":
                np.testing.assert_array_equal(ids[:b], data.tokens)
            if name == "resolve_spec":
                np.testing.assert_array_equal(bonus[:b], data.tokens)


def test_sglang_torch_gather_model_follows_the_current_class() -> None:
    """SGLang's current relay: DECODE gathers ids at req_pool_indices (the batch brings
    none), MIXED appends the running rows' tokens to the staged prefill ids, spec gathers
    the lengths at the future indices; there is no invalidate; CI mode catches a second
    read, the production map returns the stale token."""
    import torch

    from fm_bench.impls.sglang_torch import Draft, DraftInfo
    from fm_bench.impls.sglang_torch_gather import Batch, SGLangGatherFutureMap

    cpu = torch.device("cpu")
    idx = torch.tensor([3, 5])
    assert not hasattr(SGLangGatherFutureMap, "invalidate")
    for debug in (False, True):
        fm = SGLangGatherFutureMap(8, cpu, debug=debug)
        fm.publish(idx, torch.tensor([4, 9]))
        fm.stash(idx, torch.tensor([11, 0]))  # token 0 is a token, not a poison
        b = Batch(idx, torch.tensor([4, 9]))
        fm.resolve(b)
        assert b.input_ids.tolist() == [11, 0] and b.seq_lens.tolist() == [4, 9]
        fm.stash(idx, torch.tensor([12, 13]))
        mixed = Batch(
            torch.tensor([2, 5]),
            torch.tensor([2, 9]),
            prefill_input_ids_cpu=torch.tensor([7, 8]),
            mix_running_indices=torch.tensor([5]),
        )
        fm.resolve(mixed)
        assert mixed.input_ids.tolist() == [7, 8, 13]
        assert mixed.prefill_input_ids_cpu is None and mixed.mix_running_indices is None
        again = Batch(torch.tensor([5]), torch.tensor([9]))
        if debug:
            with pytest.raises(RuntimeError):
                fm.resolve(again)  # read, read: no stash in between
        else:
            fm.resolve(again)
            assert again.input_ids.tolist() == [13]
    spec = SGLangGatherFutureMap(8, cpu, spec=(2, 4, torch.bfloat16))
    spec.publish(idx, torch.tensor([6, 2]))
    hidden = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    spec.stash(idx, Draft(torch.tensor([21, 22]), torch.ones(2, 2), torch.zeros(2, 2), hidden))
    b = Batch(idx, torch.tensor([0, 0]), spec_info=DraftInfo(torch.tensor([5, 3])))
    spec.resolve(b)
    assert b.seq_lens.tolist() == [2, 6] and b.input_ids is None
    assert b.spec_info is not None and b.spec_info.bonus_tokens.tolist() == [22, 21]
    assert torch.equal(b.spec_info.hidden_states, hidden.flip(0))


def test_sglang_torch_gather_host_lengths_follow_needs_cpu_seq_lens(monkeypatch: Any) -> None:
    """SGLang's `resolve_seq_lens_cpu` off CUDA: a spec publish records the publish event;
    resolve gathers the same device lengths either way; with `needs_cpu_seq_lens` (the
    default) it adds a host copy by `.cpu()` and its sum, without it no host copy at all."""
    import torch

    from fm_bench.impls.sglang_torch import Draft, DraftInfo
    from fm_bench.impls.sglang_torch_gather import Batch, SGLangGatherFutureMap

    cpu = torch.device("cpu")
    idx = torch.tensor([3, 5])
    copies: list[torch.Tensor] = []
    to_host = torch.Tensor.cpu

    def counted(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        copies.append(self)
        return to_host(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    plain = SGLangGatherFutureMap(8, cpu)
    plain.publish(idx, torch.tensor([6, 2]))
    assert plain.needs_cpu_seq_lens and plain.publish_ready is None  # no spec: no event
    for needs in (True, False):
        fm = SGLangGatherFutureMap(8, cpu, spec=(2, 4, torch.bfloat16), needs_cpu_seq_lens=needs)
        fm.publish(idx, torch.tensor([6, 2]))
        assert fm.publish_ready is not None
        hidden = torch.zeros(2, 4, dtype=torch.bfloat16)
        fm.stash(idx, Draft(torch.tensor([21, 22]), torch.ones(2, 2), torch.zeros(2, 2), hidden))
        fi = torch.tensor([5, 3])
        b = Batch(fi, torch.tensor([0, 0]), spec_info=DraftInfo(fi), req_pool_indices_cpu=fi)
        copies.clear()
        fm.resolve(b)
        assert b.seq_lens.tolist() == [2, 6] and b.seq_lens.device == cpu
        if needs:
            assert len(copies) == 1 and b.seq_lens_cpu is not None
            assert b.seq_lens_cpu.tolist() == [2, 6] and b.seq_lens_sum == 8
        else:
            assert not copies and b.seq_lens_cpu is None and b.seq_lens_sum is None


def test_sglang_torch_gather_ci_mode_consumes_each_publish() -> None:
    """CI mode: a spec resolve consumes its publish (the lengths read go back to -1; a
    second resolve with no publish in between fails) in both host-copy modes; the bench's
    ops republish in each setup, so they run in any order and keep the lengths on the
    device."""
    import numpy as np
    import torch

    from fm_bench.impls import sglang_torch_gather
    from fm_bench.impls.sglang_torch import Draft, DraftInfo
    from fm_bench.impls.sglang_torch_gather import Batch, SGLangGatherFutureMap
    from fm_bench.workload import Config, host_data

    idx = torch.tensor([3, 5])
    for needs in (True, False):
        spec = (2, 4, torch.bfloat16)
        fm = SGLangGatherFutureMap(
            8, torch.device("cpu"), spec=spec, debug=True, needs_cpu_seq_lens=needs
        )
        assert (fm.new_seq_lens == -1).all()
        fm.publish(idx, torch.tensor([6, 2]))
        hidden = torch.zeros(2, 4, dtype=torch.bfloat16)
        draft = Draft(torch.tensor([21, 22]), torch.ones(2, 2), torch.zeros(2, 2), hidden)
        fm.stash(idx, draft)
        fm.resolve(Batch(idx, idx, spec_info=DraftInfo(idx), req_pool_indices_cpu=idx))
        assert fm.new_seq_lens[idx].tolist() == [-1, -1]
        fm.stash(idx, draft)
        with pytest.raises(RuntimeError, match="fresh publish"):
            fm.resolve(Batch(idx, idx, spec_info=DraftInfo(idx), req_pool_indices_cpu=idx))
    cfg = Config(8, 64, spec=True, hidden=16, protocol="gather")
    data = host_data(cfg)
    ops = sglang_torch_gather.build(cfg, data, True, cfg.ops())
    for name in ("resolve_spec", "step", "resolve_spec", "step", "step"):
        ops[name].setup()
        out = ops[name].run()
        lens = out[1] if name == "step" else out.seq_lens
        np.testing.assert_array_equal(to_numpy(lens), data.lens)
        if name == "resolve_spec":
            assert out.seq_lens_cpu is None and out.seq_lens_sum is None


def test_engine_step_bench_runs_and_reports_three_figures_per_series() -> None:
    """fm_bench.engine_step at a tiny size: every series has host, pipe and waited figures."""
    from fm_bench.engine_step import RATIOS, markdown, run

    res = run(8, [64], runs=1, steps=5, waited=2, log=lambda _: None)
    names = {r["impl"] for r in res["rows"]}
    assert {"fm_jax_step", "no_map_packed", "fm_jax_fused", "sglang_jax_fused"} <= names
    assert "fm_jax_class" in names
    for r in res["rows"]:
        assert r["host_us"] > 0 and r["pipe_us"] > 0 and r["waited_us"] > 0
    assert len(res["figures"]) == len(RATIOS)
    assert "fm_jax_step" in markdown(res)


def test_cli_engine_step_only_writes_its_rows(tmp_path: Any) -> None:
    """`fm-bench --engine-step-only --json`: the engine-step group's rows carry host_us,
    pipe_us and waited_us, its figures the ratios; nothing else runs."""
    path = tmp_path / "step.json"
    assert cli.main(["--plan", "tiny", "--engine-step-only", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["meta"]["plan"] == "tiny, engine step only"
    assert not doc["results"] and not doc["headline"] and not doc["startup"]
    rows = doc["engine_step"]["rows"]
    assert {r["impl"] for r in rows} >= {"fm_jax_step", "fm_jax_class"}
    assert all(r[f] > 0 for r in rows for f in ("host_us", "pipe_us", "waited_us"))
    assert any(
        f["figure"].startswith("fm_jax_step marginal host") for f in doc["engine_step"]["figures"]
    )


def test_baseline_packing_round_trips_in_one_int32_buffer() -> None:
    """fm_bench.packing, the packed baselines' own: every leaf end to end in one int32
    buffer (one transfer), each back at its shape, dtype and bits inside the jit; a leaf it
    cannot pack is refused, not packed wrong."""
    import jax
    import numpy as np

    from fm_bench.packing import pack, unpack

    tree = (
        np.arange(-4, 4, dtype=np.int32),
        {"a": np.arange(6, dtype=np.uint32).reshape(2, 3), "b": np.float32([0.5, -1e30])},
    )
    layout, buf = pack(tree)
    assert buf.dtype == np.int32 and buf.shape == (8 + 6 + 2,)
    got = jax.jit(lambda p: unpack(layout, p))(buf)
    for want, have in zip(jax.tree.leaves(tree), jax.tree.leaves(got), strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape
        np.testing.assert_array_equal(np.asarray(have), want)
    for bad in (np.arange(3, dtype=np.int64), np.zeros(3, np.int16)):
        with pytest.raises(TypeError):
            pack((bad,))


def test_host_lengths_bench_runs_at_a_tiny_size() -> None:
    """fm_bench.host_lengths: both fm_jax modes' waits and SGLang's (its host copy read the
    published lengths, or the run raises), each forward alone, as a markdown page."""
    from fm_bench.host_lengths import markdown, measure

    res = measure(8, 64, 32, 3)
    keys = ("wait_ms_copy", "wait_ms_gather", "wait_ms_sglang", "forward_ms", "forward_ms_torch")
    for key in keys:
        assert res[key]["min"] <= res[key]["median"] <= res[key]["max"]
    page = markdown(res)
    assert "needs_cpu_seq_lens" in page and "SGLang's class" in page


# ------------------------------------------------------------------------------ host path


def test_host_path_splits_each_class_step_and_writes_its_files(tmp_path: Path) -> None:
    """`python -m fm_bench.host_path`: every series of both protocols (floor, ops and class,
    debug off and on, the numpy-fed class) has its three figures, and the split's parts add
    up to the class's host time."""
    import json

    from fm_bench import host_path

    host_path.main(["--batch", "4", "--pool", "16", "--runs", "1", "--reps", "3", "--steps", "3",
                    "--out", str(tmp_path), "--tag", "t"])  # fmt: skip
    res = json.loads((tmp_path / "host_path_t.json").read_text())
    got = {(r["protocol"], r["series"], r["debug"]) for r in res["rows"]}
    kinds = {("floor", False), ("class_host", False)} | {
        (k, d) for k in ("ops", "class") for d in (False, True)
    }
    assert got == {(p, k, d) for p in ("sentinel", "gather") for k, d in kinds}
    assert all(r[f] > 0 for r in res["rows"] for f in host_path.FIGURES)
    md = (tmp_path / "host_path_t.md").read_text()
    get = {(r["protocol"], r["series"], r["debug"]): r["host_us"] for r in res["rows"]}
    floor, ops, cls = (get[("gather", k, False)] for k in ("floor", "ops", "class"))
    assert f"| gather | off | {floor:.1f} | {ops - floor:.1f} | {cls - ops:.1f} | {cls:.1f} |" in md


def test_packed_layout_probe_resolves_the_same_bytes_and_counts_kernels(tmp_path: Path) -> None:
    """`python -m fm_bench.packed_layout`: both layouts of the spec extras and fm_jax's
    Pallas kernel (interpreted here, so not timed) resolve the same bytes, and the kernel's
    stash leaves the same buffers (the probe checks before it times); each timed op has
    its kernels and figures; a resolve of rows kept packed is one gather."""
    import json

    from fm_bench import packed_layout

    packed_layout.main(["--batch", "4", "--pool", "16", "--topk", "2", "--hidden", "6",
                        "--reps", "3", "--out", str(tmp_path), "--tag", "t"])  # fmt: skip
    res = json.loads((tmp_path / "packed_layout_t.json").read_text())
    ops = {r["op"]: r for r in res["rows"]}
    assert set(ops) == {
        "fields stash", "fields resolve", "packed stash", "packed resolve",
        "packed_rows stash", "packed_rows resolve",
    }  # fmt: skip
    assert all(r["kernels"] >= 1 and r["host_us"] > 0 for r in res["rows"])
    assert ops["packed_rows resolve"]["kernels"] == 1
    assert res["width_words"] == 1 + 2 * 2 + 6 // 2


def test_packed_layout_split_inverts_the_rows_bit_for_bit() -> None:
    """The probe's row of words round-trips every field's bytes (NaN payloads, -0.0)."""
    import jax.numpy as jnp
    import numpy as np

    import fm_jax as fj
    from fm_bench.packed_layout import Packed

    p = Packed(8, 2, 4)
    hidden = np.array([[np.nan, -0.0, 1.5, -2.0]] * 3, np.float32)
    d = fj.DraftPayload(
        jnp.array([1, -2, 3], jnp.int32),
        jnp.array([[0.5, -0.0], [np.nan, 1.0], [2.0, 3.0]], jnp.float32),
        jnp.array([[7, 8], [9, 10], [11, 12]], jnp.int32),
        jnp.asarray(hidden, jnp.bfloat16),
    )
    idx = jnp.array([5, 1, 3], jnp.int32)
    got = p.split(p.stash(p.init(), idx, d)[idx], d)
    for g, w in zip(got[:4], d[:4], strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
