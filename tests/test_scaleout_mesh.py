"""The sharded FutureMap on one process with 8 virtual CPU devices (single process).

The pytest process has already started JAX with one device, so the 8-device checks run
once in a subprocess (`_inner`, this file run with XLA_FLAGS set) that prints a JSON
report; each test below asserts on its part of that report. Parity runs on a mesh go
through the same pipeline as on one device (fm_parity.suite.run_job): each DP rank of the
sharded map against fm_torch's map for that rank (docs/CONTRACT.md, 'What parity
compares').
"""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
import pytest

from fm_bench.child import call_in_child

SHAPES = [(4, 2), (8, 1), (1, 8), (2, 2)]  # (dp, tp)
DEBUG_SHAPES = [(2, 2)]
STEPS = 10
POOL = 8


# ------------------------------------------------------------------- inside the subprocess
def _parity_rows() -> dict[str, Any]:
    from fm_parity.suite import Job, run_job

    rows = []
    runs = [(dp, tp, False) for dp, tp in SHAPES] + [(dp, tp, True) for dp, tp in DEBUG_SHAPES]
    for dp, tp, debug in runs:
        r = run_job(Job("dp_overlap", "int32", debug, steps=STEPS, dp=dp, tp=tp))
        rows.append({**r.to_wire(), "ok": r.ok})
    return {"rows": rows}


def _one_byte_in_one_rank() -> dict[str, Any]:
    """One byte of rank 2's buffer flipped after one stash; the comparer must say where."""
    from fm_parity.driver import run_overlap
    from fm_parity.mutations import FlipByte
    from fm_parity.scenario import Kind, Scheduler
    from fm_parity.suite import Job, evaluate, lanes_for, make_twins

    job = Job("dp_overlap", "int32", False, steps=STEPS, dp=4, tp=2)
    lanes = lanes_for(job)
    rank, sched = 2, Scheduler(lanes[2])
    while (plan := sched.next_step()) is not None:
        if plan.step >= 3 and plan.kind is not Kind.IDLE:
            break
    assert plan is not None
    jax_twin, torch_twin = make_twins(lanes, job)
    runs = {
        "jax": run_overlap(lanes, FlipByte(jax_twin, rank, plan.step), "int32", STEPS),
        "torch": run_overlap(lanes, torch_twin, "int32", STEPS),
    }
    r = evaluate(job, lanes, runs)
    return {
        "step": plan.step,
        "slot": plan.rows[0].slot,
        "divergences": r.divergences,
        "first": r.first_divergence,
    }


def _idle_ranks_compile_nothing() -> dict[str, Any]:
    import jax

    from fm_jax import Batch, ForwardMode, FutureMap, per_rank
    from fm_parity.mesh import count_compiles, make_mesh

    fm = FutureMap(POOL, mesh=make_mesh(4, 2), dp_axis="dp", tp_axis="tp")
    sharding = fm.state.output_tokens.sharding

    def step(busy: list[int], n: int) -> None:
        slots = {d: np.arange(1, 3, dtype=np.int32) + (n % 3) for d in busy}
        batches = {
            d: Batch(int(ForwardMode.EXTEND), s, s * 10 + n, np.full(2, 3, np.int32))
            for d, s in slots.items()
        }
        # Host rows go to the devices inside the jit's dispatch (the host path); nothing
        # comes back to the host and nothing moves between devices.
        with (
            jax.transfer_guard_device_to_host("disallow"),
            jax.transfer_guard_device_to_device("disallow"),
        ):
            fm.resolve(batches, rows=4, tokens=4)
            fm.publish(slots, {d: np.full(2, 4, np.int32) for d in busy}, rows=4)
            fm.stash(slots, {d: s + n for d, s in slots.items()}, rows=4)

    with count_compiles() as warm:
        step([0, 1, 2, 3], 0)
    patterns = [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2], [2], [], [0, 1, 2, 3]]
    with count_compiles() as later:
        for n, busy in enumerate(patterns, 1):
            step(busy, n)
    return {
        "warm_compiles": len(warm),
        "later_compiles": len(later),
        "patterns": len(patterns),
        "same_sharding": fm.state.output_tokens.sharding == sharding,
        "final_tokens": {
            str(k): v.tolist()
            for k, v in per_rank(fm.buffers()["output_tokens"], fm.layout).items()
        },
    }


def _collective_counter_sees_resharding() -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from fm_parity.mesh import count_collectives, make_mesh

    mesh = make_mesh(4, 2)
    x = jax.device_put(np.arange(32, dtype=np.int32), NamedSharding(mesh, PartitionSpec("dp")))
    gather = jax.jit(lambda a: a + 1, out_shardings=NamedSharding(mesh, PartitionSpec()))
    local = jax.jit(lambda a: a + 1)
    return {
        "replicate": count_collectives(gather.lower(x).compile().as_text()),
        "local": count_collectives(local.lower(x).compile().as_text()),
    }


def _layout() -> dict[str, Any]:
    from fm_jax import FutureMap
    from fm_parity.mesh import make_mesh

    mesh = make_mesh(4, 2)
    fm = FutureMap(POOL, mesh=mesh, dp_axis="dp", tp_axis="tp")
    buf = fm.state.new_seq_lens
    held = {}
    for d in range(4):
        for t in range(2):
            dev = mesh.devices[d, t]
            sl = buf.sharding.devices_indices_map(buf.shape)[dev][0]
            held[f"{d},{t}"] = [sl.start, sl.stop]
    return {"shape": list(buf.shape), "held": held, "spec": str(buf.sharding.spec)}


def _debug_violation_names_rank() -> dict[str, Any]:
    from fm_jax import Batch, ForwardMode, FutureMap, InvariantViolation
    from fm_parity.mesh import make_mesh

    fm = FutureMap(POOL, mesh=make_mesh(4, 2), dp_axis="dp", tp_axis="tp", debug=True)
    ok = np.array([1], np.int32)
    fm.publish({0: ok, 2: ok}, {0: [5], 2: [5]})
    fm.stash({0: ok}, {0: [7]})  # rank 2's slot 1 gets a length but no token
    dec = Batch(int(ForwardMode.DECODE), ok, -ok, -ok)
    fm.resolve({0: dec, 2: dec})
    try:
        fm.check()
    except InvariantViolation as e:
        return {"raised": True, "message": str(e), "invariant": e.invariant}
    return {"raised": False}


def _bad_input_named() -> dict[str, Any]:
    from fm_jax import FutureMap, FutureMapError, per_rank
    from fm_parity.mesh import make_mesh

    fm = FutureMap(POOL, mesh=make_mesh(4, 2), dp_axis="dp", tp_axis="tp")
    before = per_rank(fm.buffers()["output_tokens"], fm.layout)
    msgs = {}
    for name, call in {
        "slot_range": lambda: fm.stash({1: np.array([2, POOL])}, {1: np.array([5, 6])}),
        "foreign_rank": lambda: fm.stash({4: np.array([1])}, {4: np.array([5])}),
        "row_mismatch": lambda: fm.publish({0: np.array([1, 2])}, {0: np.array([3])}),
        "duplicate": lambda: fm.stash({3: np.array([2, 2])}, {3: np.array([1, 1])}),
    }.items():
        try:
            call()
            msgs[name] = None
        except FutureMapError as e:
            msgs[name] = str(e)
    after = per_rank(fm.buffers()["output_tokens"], fm.layout)
    unchanged = all(np.array_equal(before[k], after[k]) for k in before)
    return {"messages": msgs, "unchanged": unchanged}


def _spec_draft_matches_per_rank() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from fm_jax import Batch, DraftPayload, ForwardMode, SpecConfig, future_map
    from fm_parity.mesh import make_mesh

    dp, b, k, h = 4, 4, 2, 3
    spec = SpecConfig(topk=k, hidden=h, hidden_dtype=jnp.bfloat16)
    mesh = make_mesh(dp, 2)
    ops = future_map(POOL, mesh=mesh, dp_axis="dp", tp_axis="tp", spec=spec)
    one = future_map(POOL, spec=spec)
    rng = np.random.default_rng(5)
    idx = np.concatenate([rng.permutation(np.arange(1, POOL))[:b] for _ in range(dp)])
    idx[b - 1] = 0  # rank 0: one padding row
    idx[3 * b : 4 * b] = 0  # rank 3 idle: all padding
    idx = idx.astype(np.int32)
    draft = DraftPayload(
        rng.integers(0, 1000, dp * b).astype(np.int32),
        rng.standard_normal((dp * b, k)).astype(np.float32),
        rng.integers(0, 1000, (dp * b, k)).astype(np.int32),
        jnp.asarray(rng.standard_normal((dp * b, h)), jnp.bfloat16),
    )
    modes = np.array([ForwardMode.DECODE] * 3 + [ForwardMode.IDLE], np.int32)
    sh = ops.layout.sharding
    put = lambda a: jax.device_put(a, sh)  # noqa: E731
    state = jax.jit(ops.stash)(jax.jit(ops.init)(), put(idx), jax.tree.map(put, draft))
    batch = Batch(put(modes), put(idx), put(-idx), put(-idx), put(idx))
    _, res = jax.jit(ops.resolve)(state, batch)
    same = True
    for d in range(dp):
        rows = slice(d * b, (d + 1) * b)
        part = DraftPayload(*(None if a is None else a[rows] for a in draft))
        s1 = one.stash(one.init(), idx[rows], part)
        b1 = Batch(jnp.int32(modes[d]), idx[rows], -idx[rows], -idx[rows], idx[rows])
        _, r1 = one.resolve(s1, b1)
        for got, want in zip(jax.tree.leaves(res), jax.tree.leaves(r1), strict=True):
            g = np.asarray(got)[d * got.shape[0] // dp : (d + 1) * got.shape[0] // dp]
            same &= g.tobytes() == np.asarray(want).tobytes()
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(s1), strict=True):
            g = np.asarray(got)[d * POOL : (d + 1) * POOL]
            same &= g.tobytes() == np.asarray(want).tobytes()
    return {"same": bool(same), "res_spec": str(res.draft.topk_p.sharding.spec)}


def _same_calls_one_device_and_mesh() -> dict[str, Any]:
    """One call sequence, global host arrays, on a one-device map and a 4x2 mesh map."""
    import jax

    from fm_jax import Batch, DraftPayload, ForwardMode, FutureMap, Resolved, SpecConfig
    from fm_parity.mesh import make_mesh

    spec = SpecConfig(topk=2, hidden=0)

    def run(fm: FutureMap, dp: int) -> list[Any]:
        slots = np.tile(np.array([1, 2], np.int32), dp)
        draft = DraftPayload(slots + 10, np.ones((2 * dp, 2), np.float32), slots[:, None] + [0, 1])
        got: list[Any] = []
        got.append(fm.publish(slots, slots + 4))
        got.append(fm.stash(slots, draft))
        batch = Batch(ForwardMode.DECODE, slots, -slots, -slots, slots)
        got.append(fm.resolve(batch))
        got.append(fm.finish(batch, slots, slots + 5, draft))
        got.append(fm.invalidate(batch, slots))
        got.append(fm.resolve_seq_lens_cpu(slots))
        got.append(fm.check())
        got.append(fm.buffers())
        return got

    one = run(FutureMap(POOL, spec=spec), 1)
    mesh = run(FutureMap(POOL, mesh=make_mesh(4, 2), dp_axis="dp", tp_axis="tp", spec=spec), 4)

    def kinds(x: Any) -> Any:
        return jax.tree.map(lambda a: type(a).__name__, x, is_leaf=lambda a: a is None)

    return {
        "one": str([kinds(x) for x in one]),
        "mesh": str([kinds(x) for x in mesh]),
        "resolved": isinstance(one[2], Resolved) and isinstance(mesh[2], Resolved),
        "lens_one": one[5].tolist(),
        "lens_mesh": mesh[5].tolist(),
        "ids_one": np.asarray(one[2].draft.bonus_tokens).tolist(),
        "ids_mesh": np.asarray(mesh[2].draft.bonus_tokens).tolist(),
    }


def _debug_on_make_mesh() -> dict[str, Any]:
    """A debug map on `jax.make_mesh` (Explicit axes): a violation is reported, not lost."""
    import jax

    from fm_jax import Batch, ForwardMode, FutureMap, InvariantViolation

    mesh = jax.make_mesh((4, 2), ("dp", "tp"))
    fm = FutureMap(8, mesh=mesh, dp_axis="dp", tp_axis="tp", debug=True)
    s = np.array([1, 2])
    fm.publish({2: s}, {2: np.array([4, 6])})
    fm.resolve({2: Batch(ForwardMode.DECODE, s, -s, -s)})
    try:
        fm.check()
    except InvariantViolation as e:
        return {"raised": True, "message": str(e), "rank": e.rank}
    return {"raised": False}


def _gather_protocol_per_rank() -> dict[str, Any]:
    """A gather-protocol map on a 4x2 mesh, ranks differing in kind in one resolve (DECODE,
    EXTEND, MIXED, idle); debug: a second read on rank 0 is reported with its rank, and a
    rank that read once is not."""
    from jax.sharding import Mesh

    import fm_jax as fj

    a = lambda *x: np.array(x, np.int32)  # noqa: E731
    mesh = Mesh(np.array(jax_devices()).reshape(4, 2), ("dp", "tp"))
    out: dict[str, Any] = {}
    for debug in (False, True):
        fm = fj.FutureMap(8, mesh=mesh, tp_axis="tp", protocol="gather", debug=debug)
        fm.publish({0: a(3, 5), 2: a(4)}, {0: a(4, 6), 2: a(2)})
        fm.stash({0: a(3, 5), 2: a(4)}, {0: a(30, 50), 2: a(40)})
        batches = {
            0: fj.Batch(fj.ForwardMode.DECODE, a(3, 5), None, a(5, 7)),
            1: fj.Batch(fj.ForwardMode.EXTEND, a(2), a(9, 9, 9), a(3)),
            2: fj.Batch(fj.ForwardMode.MIXED, a(6, 4), a(8, 0), a(1, 3), token_slots=a(0, 4)),
        }
        r = fm.resolve(batches)
        ids = {k: v.tolist() for k, v in fj.per_rank(r.input_ids, fm.layout).items()}
        out[f"ids_debug_{debug}"] = {str(k): v for k, v in ids.items()}
        if debug:
            fm.check()
            fm.resolve({0: batches[0]})  # rank 0 reads 3 and 5 again: no stash between
            try:
                fm.check()
                out["raised"] = False
            except fj.InvariantViolation as e:
                out.update(raised=True, message=str(e), rank=e.rank)
    return out


def _sentinels_fed_back_off_token_buckets() -> dict[str, Any]:
    """A 2-rank map whose batch bucket (4) is no token bucket (2, 8): a guarded warm-up of
    an engine step, its jax-fed EXTEND, the DECODE built from the batch it returns, and a
    class `finish` whose batch is resolved again."""
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import fm_jax as fj

    mesh = Mesh(np.array(jax_devices()[:2]), ("dp",))
    fm = fj.FutureMap(16, mesh=mesh, batch_buckets=(4,), token_buckets=(2, 8))

    def forward(res: Any, batch: Any, inputs: Any) -> Any:
        ids = res.input_ids.reshape(2, -1)[:, :4].reshape(-1)  # each rank's rows' ids
        return fj.StepOutput(res.seq_lens + 1, ids + 1, res.input_ids)

    step = fm.engine_step(forward)
    step.warm_up(guard=True)
    i32 = lambda *x: jnp.array(x, jnp.int32)  # noqa: E731
    slots, lens = i32(1, 2, 3, 0, 5, 6, 0, 0), i32(1, 1, 1, 0, 1, 1, 0, 0)
    ids = i32(5, 6, 7, 0, 0, 0, 0, 0, 8, 9, 0, 0, 0, 0, 0, 0)
    extend = fj.Batch(fj.ForwardMode.EXTEND, slots, ids, lens)
    first = step(extend)
    again = step(first.batch._replace(forward_mode=fj.ForwardMode.DECODE))
    after = fm.finish(extend, slots, lens + 1, i32(20, 21, 22, 0, 24, 25, 0, 0))
    res = fm.resolve(after._replace(forward_mode=fj.ForwardMode.DECODE))
    return {
        "sentinel_ids": np.asarray(first.batch.input_ids).tolist(),
        "sentinel_lens": np.asarray(first.batch.seq_lens).tolist(),
        "decode_ids": np.asarray(again.out).tolist(),
        "class_ids": np.asarray(res.input_ids).tolist(),
    }


def jax_devices() -> list[Any]:
    import jax

    return jax.devices()  # type: ignore[no-any-return]


CATALOGUE_RUNS = [("spec_decode", False), ("mixed_batches", True)]  # (scenario, debug), DP=2 x TP=2


def _catalogue_on_mesh() -> dict[str, Any]:
    from fm_parity.suite import Job, run_job

    rows = []
    for name, debug in CATALOGUE_RUNS:
        r = run_job(Job(name, "int32", debug, dp=2, tp=2))
        rows.append({**r.to_wire(), "ok": r.ok})
    return {"rows": rows}


CHECKS = {
    f.__name__.lstrip("_"): f
    for f in (
        _parity_rows,
        _one_byte_in_one_rank,
        _idle_ranks_compile_nothing,
        _collective_counter_sees_resharding,
        _layout,
        _debug_violation_names_rank,
        _bad_input_named,
        _spec_draft_matches_per_rank,
        _catalogue_on_mesh,
        _same_calls_one_device_and_mesh,
        _debug_on_make_mesh,
        _gather_protocol_per_rank,
        _sentinels_fed_back_off_token_buckets,
    )
}


def _inner() -> dict[str, Any]:
    import jax

    assert len(jax.devices()) == 8, jax.devices()
    report = {}
    for name, fn in CHECKS.items():
        try:
            report[name] = fn()
        except Exception:
            report[name] = {"error": traceback.format_exc()}
    return report


# ------------------------------------------------------------------------- in pytest
@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    # Imported here: the child runs this file without tests/ on its path.
    from host_devices import cpu_devices_env

    env = cpu_devices_env(8)
    return call_in_child(__file__, "_inner", env, timeout=300)  # type: ignore[no-any-return]


def _part(report: dict[str, Any], name: str) -> dict[str, Any]:
    part = report[name]
    assert "error" not in part, part.get("error")
    return part  # type: ignore[no-any-return]


def _row(report: dict[str, Any], dp: int, tp: int, debug: bool) -> dict[str, Any]:
    rows = [
        r
        for r in _part(report, "parity_rows")["rows"]
        if (r["dp"], r["tp"], r["debug"]) == (dp, tp, debug)
    ]
    assert len(rows) == 1
    return rows[0]


@pytest.mark.parametrize(
    "dp,tp,debug",
    [(dp, tp, False) for dp, tp in SHAPES] + [(dp, tp, True) for dp, tp in DEBUG_SHAPES],
)
def test_each_mesh_rank_is_bit_identical_to_its_torch_map(report, dp, tp, debug):
    """Pins: a rank's gather/scatter reaching another rank's pool, a TP replica diverging, or
    an idle rank's padding corrupting its live slots (any byte of any rank's trace against
    fm_torch's map for that rank, and every rank's streams against the reference loop)."""
    row = _row(report, dp, tp, debug)
    assert row["ok"], (row["first_divergence"], row["oracle_failures"], row["failures"])
    assert row["steps"] == STEPS and row["ops_compared"] > dp * STEPS
    assert row["errors"] == {}


@pytest.mark.parametrize("dp,tp", SHAPES)
def test_steps_neither_recompile_nor_reshard(report, dp, tp):
    """Pins: a call whose executable and shapes were seen before compiling again (e.g.
    because a rank went idle), the state coming back with another sharding, or the compiled
    ops moving buffers between devices (any all-gather / all-to-all / collective-permute in
    the HLO)."""
    extra = _row(report, dp, tp, False)["extra"]
    assert extra["recompiles"] == 0
    assert extra["compiles_total"] > 0  # the counter sees the map's compiles at all
    assert not extra["resharded"]
    assert extra["collectives"] == {"publish": 0, "stash": 0, "resolve": 0, "invalidate": 0}


def test_one_flipped_byte_in_one_rank_is_reported_where_it_is(report):
    """Pins: the shared comparer missing a one-byte difference in one DP rank of a mesh map,
    or reporting it without its rank, step, op, field and slot."""
    part = _part(report, "one_byte_in_one_rank")
    assert part["divergences"] >= 1
    where = f"rank 2, step {part['step']}, op stash, field output_tokens, slot {part['slot']}"
    assert where in part["first"], part["first"]


def test_rank_going_idle_compiles_nothing(report):
    """Pins: an idle rank changing the global batch's shape or dtype, which would recompile
    every time the set of busy ranks changes (tpu-inference's recompile storms)."""
    part = _part(report, "idle_ranks_compile_nothing")
    assert part["warm_compiles"] >= 3  # the counter sees compiles at all
    assert part["later_compiles"] == 0
    assert part["same_sharding"]
    # rank 2 was busy in the last step (n=7: slots 2, 3 get tokens 9, 10); all ranks were.
    assert part["final_tokens"]["2"][2:4] == [9, 10]


def test_collective_counter_is_not_blind(report):
    """Pins: the HLO collective count reading 0 because it cannot see collectives at all."""
    part = _part(report, "collective_counter_sees_resharding")
    assert part["replicate"] >= 1
    assert part["local"] == 0


def test_layout_gives_each_dp_row_its_own_pool_replicated_over_tp(report):
    """Pins: a layout other than the documented one (rank d owns rows [d*R, (d+1)*R) on both
    devices of its TP group)."""
    part = _part(report, "layout")
    assert part["shape"] == [4 * POOL]
    for d in range(4):
        for t in range(2):
            assert part["held"][f"{d},{t}"] == [d * POOL, (d + 1) * POOL]


def test_debug_violation_names_the_dp_rank(report):
    """Pins: a consume violation on one rank of a mesh reported without saying which rank."""
    part = _part(report, "debug_violation_names_rank")
    assert part["raised"]
    assert "DP rank 2" in part["message"]
    assert part["invariant"] == "consume (WRWR)"


def test_bad_sharded_input_is_named_and_writes_nothing(report):
    """Pins: a slot outside a rank's pool, a rank this process does not own, mismatched rows
    or a duplicate live slot being written (or silently dropped) instead of refused."""
    part = _part(report, "bad_input_named")
    m = part["messages"]
    assert "rank 1" in m["slot_range"] and str(POOL) in m["slot_range"]
    assert "DP rank 4" in m["foreign_rank"]
    assert "rows" in m["row_mismatch"]
    assert "rank 3" in m["duplicate"] and "more than once" in m["duplicate"]
    assert part["unchanged"]


def test_spec_draft_on_a_mesh_matches_each_ranks_own_ops(report):
    """Pins: the spec extras (top-k, bf16 hidden states) being gathered from or scattered to
    the wrong rank's rows, or losing bits on the way through shard_map."""
    part = _part(report, "spec_draft_matches_per_rank")
    assert part["same"]
    assert part["res_spec"] in ("P('dp',)", "PartitionSpec('dp',)")


@pytest.mark.parametrize("name,debug", CATALOGUE_RUNS)
def test_parity_catalogue_scenario_on_each_rank_matches_its_torch_map(report, name, debug):
    """Pins: a parity catalogue scenario (spec top-k and bf16 hidden states; debug consume
    tracking) run on the DP ranks of one shared sharded map diverging in any recorded byte,
    stream or error from fm_torch's maps, one per rank."""
    rows = [
        r
        for r in _part(report, "catalogue_on_mesh")["rows"]
        if (r["name"], r["debug"]) == (name, debug)
    ]
    assert len(rows) == 1 and (rows[0]["dp"], rows[0]["tp"]) == (2, 2)
    r = rows[0]
    assert r["ok"], r
    assert r["ops_compared"] > 100 and r["errors"] == {}


def test_one_device_and_mesh_maps_take_the_same_calls(report):
    """Pins the two map classes of old: the same call sequence (global host arrays) on a
    one-device map and a mesh map returns the same types, and each mesh rank relays what
    the one-device map relays."""
    part = _part(report, "same_calls_one_device_and_mesh")
    assert part["one"] == part["mesh"]
    assert part["resolved"]
    assert part["lens_one"] == [6, 7] and part["lens_mesh"] == [6, 7] * 4
    assert part["ids_one"] == [11, 12] and part["ids_mesh"] == [11, 12] * 4


def test_debug_check_on_an_explicit_axes_mesh_reports_the_violation(report):
    """Pins check() crashing with ShardingTypeError on a `jax.make_mesh` mesh (Explicit
    axes) after clearing its pending list, so that the violation was lost."""
    part = _part(report, "debug_on_make_mesh")
    assert part["raised"] and part["rank"] == 2
    assert "DP rank 2" in part["message"] and "consume" in part["message"]


def test_gather_protocol_on_a_mesh_resolves_each_rank_by_its_kind(report):
    """Gather protocol on a mesh: each rank's ids by its own kind in one resolve (DECODE
    gathers, EXTEND keeps, MIXED places the running row's token, an idle rank pads), the
    same with debug on; a second read on rank 0 is reported naming rank 0."""
    part = _part(report, "gather_protocol_per_rank")
    want = {"0": [30, 50], "1": [9, 9, 9], "2": [8, 40], "3": []}
    for debug in (False, True):
        ids = part[f"ids_debug_{debug}"]
        assert {k: v[: len(want[k])] for k, v in ids.items()} == want
        assert all(x == 0 for k, v in ids.items() for x in v[len(want[k]) :])
    assert part["raised"] and part["rank"] == 0
    assert "consume" in part["message"]


def test_sentinels_feed_back_on_a_mesh_where_the_batch_bucket_is_no_token_bucket(report):
    """On 2 DP ranks with batch bucket 4 and token buckets (2, 8): the sentinel ids of each
    rank come padded to 8, the lengths at 4; the DECODE built from them is served by a
    guarded warm-up and resolves each rank's stashed tokens, as does the class's."""
    part = _part(report, "sentinels_fed_back_off_token_buckets")
    pad = [0] * 4
    assert part["sentinel_ids"] == [-1, -2, -3, 0, *pad, -5, -6, 0, 0, *pad]
    assert part["sentinel_lens"] == [-1, -2, -3, 0, -5, -6, 0, 0]
    assert part["decode_ids"] == [6, 7, 8, 0, *pad, 9, 10, 0, 0, *pad]
    assert part["class_ids"] == [20, 21, 22, 0, *pad, 24, 25, 0, 0, *pad]


# ----------------------------------------------------------------- single device, in process
def test_mesh_layout_refuses_bad_axes():
    """Pins: a typo'd axis name or dp_axis == tp_axis silently replicating the whole pool."""
    import jax

    from fm_jax import FutureMapError, mesh_layout
    from fm_parity.mesh import make_mesh

    mesh = make_mesh(1, 1, jax.devices()[:1])
    with pytest.raises(FutureMapError, match="'data'"):
        mesh_layout(mesh, dp_axis="data")
    with pytest.raises(FutureMapError, match="differ"):
        mesh_layout(mesh, dp_axis="dp", tp_axis="dp")
    with pytest.raises(FutureMapError, match="Mesh"):
        mesh_layout("dp")  # type: ignore[arg-type]
    assert mesh_layout(mesh, "dp", "tp").dp == 1


def test_dp_scenario_has_ranks_idle_and_differing_in_kind_at_one_step():
    """Pins: a DP scenario in which no rank ever idles while another runs, or all busy ranks
    always share one batch kind (so a sharded map's traced-mode resolve is never run)."""
    from fm_parity.scenario import Kind, Scheduler
    from fm_parity.suite import Job, lanes_for

    lanes = lanes_for(Job("dp_overlap", "int32", False, dp=4))
    assert len({s.pool_size for s in lanes.values()}) == 1
    scheds = {d: Scheduler(s, STEPS) for d, s in lanes.items()}
    idle_beside_busy = kinds_differ = False
    for _ in range(STEPS):
        kinds = {d: p.kind for d, sc in scheds.items() if (p := sc.next_step()) is not None}
        busy = {k for k in kinds.values() if k is not Kind.IDLE}
        idle_beside_busy |= Kind.IDLE in kinds.values() and bool(busy)
        kinds_differ |= Kind.DECODE in busy and len(busy) > 1
    assert idle_beside_busy and kinds_differ
