"""FutureMap.engine_step: the engine's own step with the relay inside.

The step must leave the same bytes as the class's one-op calls (resolve, then finish with
the same forward outside), in both protocols, with debug on and off, non-spec and spec, on
one device and on a mesh; keep the class's rules (value checks before anything runs, the
serving guard, debug errors at `check()`); and hand all of a call's host arrays to the
device as one buffer.
"""

from __future__ import annotations

import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_count import counting_compiles

import fm_jax as fj
from fm_bench.child import child_report

E, D, M = fj.ForwardMode.EXTEND, fj.ForwardMode.DECODE, fj.ForwardMode.MIXED


def _bytes(x: object) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).tobytes()


# ------------------------------------------------------------------------- a toy engine
def _model(ids: jax.Array, lens: jax.Array, pos: jax.Array, w: jax.Array) -> jax.Array:
    """A deterministic next token per row from its first token slot's id, length and pos."""
    b = lens.shape[0]
    return (ids[:b] * 7 + lens * 3 + pos + w) % 997


def _forward(res: fj.Resolved, batch: fj.Batch, inputs: dict, w: jax.Array, cache: jax.Array):
    tokens = _model(res.input_ids, res.seq_lens, inputs["pos"], w)
    cache = cache.at[batch.req_pool_indices].add(tokens)  # the engine's donated state
    return fj.StepOutput(res.seq_lens + 1, tokens, (cache, tokens))


def _script(protocol: str) -> list[tuple[fj.Batch, np.ndarray]]:
    """Prefill, a MIXED step (a new prefill beside the running rows), then decodes with a
    slot retired and reused; host arrays as an overlap scheduler builds them."""
    i32 = lambda *x: np.array(x, np.int32)  # noqa: E731
    gather = protocol == "gather"
    out = [(fj.Batch(E, i32(1, 2), i32(5, 9), i32(1, 1)), i32(0, 0))]
    # MIXED: slot 3 prefills 2 tokens, slots 1 and 2 decode (lengths known on the host).
    ids = i32(11, 12, 0, 0) if gather else i32(11, 12, -1, -2)
    slots = i32(0, 0, 1, 2) if gather else None
    out.append((fj.Batch(M, i32(3, 1, 2), ids, i32(2, 2, 2), token_slots=slots), i32(1, 1, 1)))
    for step in range(3):
        live = i32(1, 2, 3) if step < 2 else i32(2, 3)  # slot 1 retires
        lens = np.full(len(live), 3 + step, np.int32)
        batch = fj.Batch(D, live, None, lens) if gather else fj.Batch(D, live, -live, -live)
        out.append((batch, np.arange(len(live), dtype=np.int32)))
    out.append((fj.Batch(E, i32(1), i32(40, 41, 42), i32(3)), i32(2)))  # slot 1 reused
    return out


def _run_step(protocol: str, debug: bool):
    fm = fj.FutureMap(8, protocol=protocol, debug=debug, batch_buckets=[4], token_buckets=[4, 8])
    step = fm.engine_step(_forward, inputs=[fj.StepInput("pos", "row")], donate_argnums=(1,))
    cache, w, outs = jnp.zeros(8, jnp.int32), jnp.int32(5), []
    for batch, pos in _script(protocol):
        r = step(batch, w, cache, inputs={"pos": pos})
        cache, tokens = r.out
        outs.append(np.asarray(tokens)[: len(batch.req_pool_indices)])
    fm.check()
    return fm, outs, np.asarray(cache)


def _run_ops(protocol: str, debug: bool):
    fm = fj.FutureMap(8, protocol=protocol, debug=debug, batch_buckets=[4], token_buckets=[4, 8])
    cache, w, outs = np.zeros(8, np.int32), 5, []
    for batch, pos in _script(protocol):
        res = fm.resolve(batch)
        n = len(batch.req_pool_indices)
        b = res.seq_lens.shape[0]
        tokens = np.asarray(
            _model(res.input_ids, res.seq_lens, jnp.asarray(np.pad(pos, (0, b - n))), w)
        )
        fm.finish(batch, batch.req_pool_indices, np.asarray(res.seq_lens)[:n] + 1, tokens[:n])
        np.add.at(cache, batch.req_pool_indices, tokens[:n])
        outs.append(tokens[:n])
    fm.check()
    return fm, outs, cache


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_step_leaves_the_bytes_of_resolve_then_finish(protocol: str, debug: bool) -> None:
    fm_s, outs_s, cache_s = _run_step(protocol, debug)
    fm_o, outs_o, cache_o = _run_ops(protocol, debug)
    for a, b in zip(outs_s, outs_o, strict=True):
        assert _bytes(a) == _bytes(b)
    assert _bytes(cache_s[1:]) == _bytes(cache_o[1:])  # slot 0: padding rows
    for name, buf in fm_o.buffers().items():  # slot 0 holds padding rows' garbage
        assert _bytes(fm_s.buffers()[name][1:]) == _bytes(buf[1:]), name
    assert fm_s.step == fm_o.step == len(_script(protocol))


def test_sentinel_step_returns_the_invalidated_batch_and_gather_the_batch_as_given() -> None:
    """StepResult.batch: the gather protocol's the batch as given; the sentinel protocol's
    the sentinels -slot, for host slots a host array of their rows in the map's int dtype
    (whatever int dtype the slots came in), for jax slots the step's own, padded like them."""
    for protocol in ("sentinel", "gather"):
        fm = fj.FutureMap(8, protocol=protocol, batch_buckets=[4], token_buckets=[4])
        step = fm.engine_step(lambda r, b, i: fj.StepOutput(r.seq_lens, r.input_ids[:4]))
        batch = fj.Batch(
            E, np.array([3, 1], np.int32), np.array([4, 4], np.int32), np.ones(2, np.int32)
        )
        nxt = step(batch).batch
        if protocol == "gather":
            assert nxt is batch
        else:  # host slots: host sentinels of their rows (the batch is placed as a host one)
            assert type(nxt.input_ids) is np.ndarray and type(nxt.seq_lens) is np.ndarray
            assert nxt.input_ids.tolist() == nxt.seq_lens.tolist() == [-3, -1]
            assert nxt.input_ids.dtype == np.int32
            wide = step(batch._replace(req_pool_indices=np.array([3, 1], np.int64))).batch
            assert wide.input_ids.dtype == wide.seq_lens.dtype == np.int32
            assert wide.input_ids.tolist() == [-3, -1]
            # jax slots (padded by the caller): the step's own sentinels, padded like them
            jbatch = batch._replace(
                req_pool_indices=jnp.array([3, 1, 0, 0], jnp.int32),
                input_ids=jnp.array([4, 4, 0, 0], jnp.int32),
                seq_lens=jnp.ones(4, jnp.int32),
            )
            nxt = step(jbatch).batch
            assert isinstance(nxt.input_ids, jax.Array)
            assert np.asarray(nxt.input_ids).tolist() == [-3, -1, 0, 0]


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_spec_step_relays_the_draft_like_finish(kernel: str) -> None:
    """With either spec kernel, the step leaves the buffers the class's ops leave; warmed
    under the serving guard, it serves its DECODE reading the draft (warm-up covers the
    spec map's draft variants)."""
    spec = fj.SpecConfig(topk=2, hidden=4, hidden_dtype=jnp.bfloat16, kernel=kernel)
    slots = np.array([1, 2], np.int32)

    def draft(seed: int) -> fj.DraftPayload:
        rng = np.random.default_rng(seed)
        return fj.DraftPayload(
            rng.integers(0, 50, 2).astype(np.int32),
            rng.random((2, 2)).astype(np.float32),
            rng.integers(0, 50, (2, 2)).astype(np.int32),
            rng.random((2, 4)).astype(np.float32).astype(jnp.bfloat16),
        )

    def forward(res, batch, inputs, seed):
        d, b = res.draft, res.seq_lens.shape[0]
        if d is None:  # warm-up's variants without a draft
            i, f = jnp.zeros((b, 2), jnp.int32), jnp.zeros((b, 2), jnp.float32)
            d = fj.DraftPayload(i[:, 0], f, i, jnp.zeros((b, 4), jnp.bfloat16))
        nxt = fj.DraftPayload(
            (d.bonus_tokens + seed) % 50, d.topk_p * 0.5, d.topk_index + 1, d.hidden_states * 2
        )
        return fj.StepOutput(res.seq_lens + 2, nxt, nxt.bonus_tokens)

    maps = []
    for use_step in (True, False):
        fm = fj.FutureMap(4, spec=spec, protocol="gather", batch_buckets=[2], token_buckets=[2])
        fm.finish(fj.Batch(E, slots, slots, slots), slots, np.array([3, 4], np.int32), draft(0))
        batch = fj.Batch(D, slots, np.zeros(2, np.int32), np.zeros(2, np.int32), slots)
        step = fm.engine_step(forward)
        if use_step:
            step.warm_up(jnp.int32(0), guard=True, traced_modes=False)
        for k in range(3):
            if use_step:
                step(batch, jnp.int32(k))
            else:
                res = fm.resolve(batch)
                lens, nxt, *_ = jax.jit(lambda r, s: forward(r, None, None, s))(res, jnp.int32(k))
                fm.finish(batch, slots, lens, nxt)
        maps.append(fm)
    for name, buf in maps[1].buffers().items():
        assert _bytes(maps[0].buffers()[name][1:]) == _bytes(buf[1:]), name


# ---------------------------------------------------------------------- the class's rules
def _small_step(debug: bool = False, protocol: str = "sentinel"):
    fm = fj.FutureMap(8, debug=debug, protocol=protocol, batch_buckets=[2, 4], token_buckets=[4, 8])
    step = fm.engine_step(_forward, inputs=[fj.StepInput("pos", "row")], donate_argnums=(1,))
    return fm, step


def test_bad_input_is_refused_before_anything_runs_or_is_donated() -> None:
    fm, step = _small_step()
    slots = np.array([1, 2], np.int32)
    batch = fj.Batch(E, slots, np.array([3, 4], np.int32), np.ones(2, np.int32))
    cache = jnp.zeros(8, jnp.int32)
    before = {k: _bytes(v) for k, v in fm.buffers().items()}
    bad = [
        (batch, {"pos": slots.astype(np.float32)}, "pos.. must have an integer dtype, got float32"),
        (batch, {}, "missing \\['pos'\\]"),
        (batch, {"pos": slots, "temp": slots}, "undeclared \\['temp'\\]"),
        (batch, {"pos": np.zeros((2, 3), np.int32)}, "declared rows of shape"),
        (batch, {"pos": np.zeros(3, np.int32)}, "pos"),
        (
            batch._replace(req_pool_indices=np.array([1, 1], np.int32)),
            {"pos": slots},
            "more than once",
        ),
        (batch._replace(req_pool_indices=np.array([1, 9], np.int32)), {"pos": slots}, "outside"),
    ]
    for b, inputs, match in bad:
        with pytest.raises(fj.FutureMapError, match=match):
            step(b, jnp.int32(0), cache, inputs=inputs)
    assert not cache.is_deleted()
    assert fm.step == 0
    assert {k: _bytes(v) for k, v in fm.buffers().items()} == before


def test_each_step_of_a_map_checks_its_own_declared_inputs() -> None:
    # Two steps on one map declare `a` differently: a layout one step has placed must not
    # carry the other's checks (a float32 input fed int32 rows is refused, never cast).
    fm = fj.FutureMap(8, batch_buckets=[2], token_buckets=[2])
    seen = []

    def forward(res: fj.Resolved, b: fj.Batch, inputs: dict) -> fj.StepOutput:
        seen.append(inputs["a"].dtype)
        return fj.StepOutput(res.seq_lens + 1, res.input_ids[:2])

    ints = fm.engine_step(forward, inputs=[fj.StepInput("a", "row", dtype=np.int32)])
    floats = fm.engine_step(forward, inputs=[fj.StepInput("a", "row", dtype=np.float32)])
    slots = np.array([1, 2], np.int32)
    batch = fj.Batch(E, slots, np.array([3, 4], np.int32), np.ones(2, np.int32))
    ints(batch, inputs={"a": np.zeros(2, np.int32)})
    with pytest.raises(fj.FutureMapError, match=r"inputs\['a'\] has dtype int32, declared float32"):
        floats(batch, inputs={"a": np.zeros(2, np.int32)})
    floats(batch, inputs={"a": np.zeros(2, np.float32)})
    assert seen == [np.int32, np.float32]


def test_step_donates_the_map_state_and_the_named_args() -> None:
    fm, step = _small_step()
    slots = np.array([1, 2], np.int32)
    batch = fj.Batch(E, slots, np.array([3, 4], np.int32), np.ones(2, np.int32))
    cache, w = jnp.zeros(8, jnp.int32), jnp.int32(1)
    state = fm.state
    cache2, _ = step(batch, w, cache, inputs={"pos": slots}).out
    assert cache.is_deleted() and state.output_tokens.is_deleted()
    assert not w.is_deleted() and not cache2.is_deleted()


def test_a_forward_that_returns_no_step_output_is_named() -> None:
    fm = fj.FutureMap(8, batch_buckets=[2], token_buckets=[2])
    step = fm.engine_step(lambda r, b, i: (r.seq_lens, r.input_ids))
    batch = fj.Batch(E, np.array([1], np.int32), np.array([3], np.int32), np.ones(1, np.int32))
    with pytest.raises(fj.FutureMapError, match="must return a StepOutput"):
        step(batch)
    assert fm.step == 0


def test_step_declarations_are_checked_when_made() -> None:
    fm = fj.FutureMap(8)
    for inputs, match in [
        ([fj.StepInput("a", "col")], "per must be"),
        ([fj.StepInput("a", "row"), fj.StepInput("a", "token")], "distinct"),
        ([("a", "row")], "StepInputs"),
        ([fj.StepInput("a", "row", dtype=np.float64)], "x64"),
    ]:
        with pytest.raises(fj.FutureMapError, match=match):
            fm.engine_step(_forward, inputs=inputs)
    with pytest.raises(fj.FutureMapError, match="donate_argnums"):
        fm.engine_step(_forward, donate_argnums=(-1,))
    with pytest.raises(fj.FutureMapError, match="callable"):
        fm.engine_step(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_warm_up_covers_every_bucket_and_the_guard_refuses_the_rest(protocol: str) -> None:
    fm, step = _small_step(protocol=protocol)
    cache, w = jnp.zeros(8, jnp.int32), jnp.int32(0)
    rep = step.warm_up(w, cache, guard=True, traced_modes=False)
    # One executable per mode the forward may see (its mode fixed), none traced.
    modes = {"step_fixed_extend", "step_fixed_decode", "step_fixed_mixed", "step_fixed_idle"}
    assert rep.executables == sum(rep.by_op.values()) and set(rep.by_op) <= modes
    calls = [(_script(protocol)[i]) for i in range(len(_script(protocol)))]
    with counting_compiles() as counter:
        for batch, pos in calls:
            cache, _ = step(batch, w, cache, inputs={"pos": pos}).out
    assert counter.executables == 0
    # A traced mode was not warmed: refused, nothing ran.
    batch = fj.Batch(
        jnp.int32(0), np.array([1], np.int32), np.array([1], np.int32), np.ones(1, np.int32)
    )
    n = fm.step
    with pytest.raises(fj.FutureMapError, match="serving guard"):
        step(batch, w, cache, inputs={"pos": np.zeros(1, np.int32)})
    assert fm.step == n and not cache.is_deleted()


def test_warm_up_remembers_its_layouts_in_the_step_not_the_map() -> None:
    """An engine step's warm-up places its calls as serving does, into the step's own
    layouts (its declared inputs are its own): the map's layouts, which its resolves and
    tail ops look up, gain none."""
    fm, step = _small_step()
    step.warm_up(jnp.int32(0), jnp.zeros(8, jnp.int32), traced_modes=False)
    assert fm._placement._decided == {}
    assert len(step._decided) > 0
    assert {sig[0] for sig in step._decided} == {"step"}


def test_debug_violation_in_a_step_is_reported_at_check_with_step_and_op() -> None:
    fm, step = _small_step(debug=True)
    slots = np.array([1, 2], np.int32)
    cache, w = jnp.zeros(8, jnp.int32), jnp.int32(0)
    # A DECODE of slots never written: the consume check finds the poison.
    step(fj.Batch(D, slots, -slots, -slots), w, cache, inputs={"pos": slots})
    with pytest.raises(fj.InvariantViolation) as info:
        fm.check()
    assert info.value.step == 1 and info.value.op == "resolve"


def test_a_host_fed_step_is_one_executable_taking_one_host_buffer() -> None:
    """The compiled step's parameters: the state's buffers, one packed buffer, the args."""
    fm, step = _small_step()
    slots = np.array([1, 2], np.int32)
    batch = fj.Batch(E, slots, np.array([3, 4], np.int32), np.ones(2, np.int32))
    placed = fm._placement.resolve(batch, step=step.inputs, inputs={"pos": slots})
    packed, device = placed.args
    assert device == ()  # every host array of the call is in the one buffer
    fn = fm._registry.jitted(placed.key, placed.pack, 2, step._build)
    args = (fm.state, packed, device, jnp.int32(0), jnp.zeros(8, jnp.int32))
    n_params = len(jax.tree.leaves(fm.state)) + 1 + 2
    assert len(fn.trace(*args).lower().in_avals[0]) == n_params


# ---------------------------------------------------------------------------------- mesh
_MESH_CHILD = textwrap.dedent(
    """
    import json, numpy as np, jax, jax.numpy as jnp
    import fm_jax as fj
    E, D = fj.ForwardMode.EXTEND, fj.ForwardMode.DECODE
    mesh = jax.make_mesh((2, 2), ("dp", "tp"))
    out = {}
    for debug in (False, True):
        fm = fj.FutureMap(8, mesh=mesh, tp_axis="tp", debug=debug, batch_buckets=[2],
                          token_buckets=[2])
        def fwd(res, batch, inputs):
            tok = (res.input_ids * 7 + res.seq_lens + inputs["pos"]) % 97
            return fj.StepOutput(res.seq_lens + 1, tok, tok)
        step = fm.engine_step(fwd, inputs=[fj.StepInput("pos", "row")])
        ref = fj.FutureMap(8, mesh=mesh, tp_axis="tp", debug=debug, batch_buckets=[2],
                           token_buckets=[2])
        i32 = lambda *x: np.array(x, np.int32)
        B = fj.Batch
        seq = [
            {0: B(E, i32(1, 2), i32(5, 6), i32(1, 1)), 1: B(E, i32(3), i32(7), i32(2))},
            {0: B(D, i32(1, 2), i32(-1, -2), i32(-1, -2)), 1: B(E, i32(1), i32(9), i32(1))},
            {0: B(D, i32(1, 2), i32(-1, -2), i32(-1, -2)),
             1: B(D, i32(3, 1), i32(-3, -1), i32(-3, -1))},
        ]
        toks = []
        for batches in seq:
            pos = {r: np.arange(len(b.req_pool_indices), dtype=np.int32)
                   for r, b in batches.items()}
            toks.append(np.asarray(step(batches, inputs={"pos": pos}).out).tolist())
            res = ref.resolve(batches)
            want = (np.asarray(res.input_ids) * 7 + np.asarray(res.seq_lens)
                    + np.concatenate([np.pad(pos[r], (0, 2 - len(pos[r]))) for r in (0, 1)])) % 97
            idx = {r: b.req_pool_indices for r, b in batches.items()}
            lens = {r: np.asarray(res.seq_lens)[2 * r: 2 * r + len(idx[r])] + 1 for r in idx}
            tk = {r: want[2 * r: 2 * r + len(idx[r])].astype(np.int32) for r in idx}
            ref.publish(idx, lens); ref.stash(idx, tk)
        fm.check(); ref.check()
        live = lambda a: np.asarray(a).reshape(2, 8)[:, 1:].tobytes()  # slot 0 pads
        same = all(live(a) == live(ref.buffers()[k]) for k, a in fm.buffers().items())
        sharding_kept = fm.state.output_tokens.sharding == ref.state.output_tokens.sharding
        out[str(debug)] = {"same": same, "sharding": bool(sharding_kept), "tokens": toks}
    print("REPORT", json.dumps(out))
    """
)


def test_step_on_a_mesh_matches_the_class_ops_rank_by_rank() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from host_devices import cpu_devices_env

    report = child_report(["-c", _MESH_CHILD], cpu_devices_env(4), timeout=600)
    for debug, r in report.items():
        assert r["same"] and r["sharding"], (debug, r)
    assert report["False"]["tokens"] == report["True"]["tokens"]


# ---------------------------------------------------------------------- the host ring
def _heavy_forward(res: fj.Resolved, batch: fj.Batch, inputs: dict, a: jax.Array):
    """Tokens from a chain of 1024-wide matmuls: long enough that the step is still
    running when its call returns (XLA:CPU runs an executable this size off the caller)."""
    for _ in range(4):
        a = jnp.tanh(a @ a)
    tokens = (res.input_ids[: res.seq_lens.shape[0]] + (a[0, 0] > 2).astype(jnp.int32)) % 97
    return fj.StepOutput(res.seq_lens + 1, tokens, {"tokens": tokens, "a": a})


def test_the_host_ring_hands_each_steps_outputs_over_in_order_without_waiting() -> None:
    """Pins a read that blocks on a running step (None instead), steps read out of order or
    twice, or outputs other than the step's own: each step's picked tokens, read a step
    late, equal what its result holds."""
    fm = fj.FutureMap(8, batch_buckets=[2], token_buckets=[2])
    step = fm.engine_step(_heavy_forward, host_out=lambda out: out["tokens"])
    a = jnp.full((1024, 1024), 1e-3, jnp.float32)
    slots = np.array([1, 2], np.int32)
    first = step(fj.Batch(E, slots, np.array([3, 4], np.int32), np.ones(2, np.int32)), a)
    assert step.read_host(wait=True).step == 0
    results = []
    batch = first.batch._replace(forward_mode=D)
    for _ in range(3):
        r = step(batch, a)
        results.append(r)
        batch = r.batch._replace(forward_mode=D)
    assert step.read_host() is None  # the last step still runs: no wait
    got = [step.read_host(wait=True) for _ in results]
    assert [g.step for g in got] == [1, 2, 3]
    for g, r in zip(got, results, strict=True):
        assert type(g.out) is np.ndarray and _bytes(g.out) == _bytes(r.out["tokens"])
    assert step.read_host() is None and step.read_host(wait=True) is None  # all read


def test_a_full_host_ring_refuses_the_next_step_before_it_runs() -> None:
    """Pins unread steps piling up without bound, or a refusal that ran the step anyway:
    with host_ring=2 unread, the third step is refused by name and changes nothing."""
    fm = fj.FutureMap(8, batch_buckets=[2], token_buckets=[2])
    step = fm.engine_step(
        lambda r, b, i: fj.StepOutput(r.seq_lens + 1, r.input_ids, r.input_ids),
        host_out=lambda out: out,
        host_ring=2,
    )
    batch = fj.Batch(
        E, np.array([1, 2], np.int32), np.array([3, 4], np.int32), np.ones(2, np.int32)
    )
    step(batch)
    step(batch)
    before = {k: _bytes(v) for k, v in fm.buffers().items()}
    with pytest.raises(fj.FutureMapError, match="host ring holds 2 unread steps"):
        step(batch)
    assert fm.step == 2 and {k: _bytes(v) for k, v in fm.buffers().items()} == before
    assert step.read_host(wait=True).step == 0
    step(batch)
    assert [step.read_host(wait=True).step for _ in range(2)] == [1, 2]


def test_host_out_misuse_is_named_and_the_step_result_stands() -> None:
    """A host_out that is no function, a ring size that is no count, a read on a step
    without host_out, and a host_out that picks no array: each named; the last one when
    its step is read, the step itself served."""
    fm = fj.FutureMap(8, batch_buckets=[2], token_buckets=[2])
    fwd = lambda r, b, i: fj.StepOutput(r.seq_lens + 1, r.input_ids, {"n": 3})  # noqa: E731
    with pytest.raises(fj.FutureMapError, match="host_out must be callable"):
        fm.engine_step(fwd, host_out="tokens")
    for size in (0, True, 2.0):
        with pytest.raises(fj.FutureMapError, match="host_ring must be an int >= 1"):
            fm.engine_step(fwd, host_out=lambda out: out, host_ring=size)
    with pytest.raises(fj.FutureMapError, match="built without host_out"):
        fm.engine_step(fwd).read_host()
    step = fm.engine_step(fwd, host_out=lambda out: [out["n"], "tokens"])
    batch = fj.Batch(
        E, np.array([1, 2], np.int32), np.array([3, 4], np.int32), np.ones(2, np.int32)
    )
    r = step(batch)
    assert int(r.out["n"]) == 3 and fm.step == 1
    with pytest.raises(fj.FutureMapError, match="host_out failed on step 0: .*got \\['str'\\]"):
        step.read_host()
    assert step.read_host() is None
