"""A layout's decision, remembered, places a call exactly as a fresh decision does.

Placement decides a layout once (`fm_jax.host.decisions`); a later call of the layout runs
that decision: its value checks, its padding and its packing. These tests drive calls of
one layout with other values, valid and not, through the remembered decision and a fresh
one, and compare what comes out: the same key, packing layout and argument bytes, or the
same refusal. Warm-up, the class's calls and the serving guard key executables by one
typed key (`Key`).
"""

from __future__ import annotations

import os
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fm_jax as fj
from fm_bench.child import child_report
from fm_jax.host import decisions
from fm_jax.host.decisions import Key

E, D, M = fj.ForwardMode.EXTEND, fj.ForwardMode.DECODE, fj.ForwardMode.MIXED
R = 16


def _flat(x: Any) -> list[tuple[Any, ...]]:
    out = []
    for leaf in jax.tree_util.tree_leaves(x):
        if isinstance(leaf, jax.Array):
            out.append(("jax", id(leaf)))
        else:
            a = np.asarray(leaf)
            out.append((a.shape, a.dtype, a.tobytes()))
    return out


def _fresh_resolve(p: Any, batch: Any, rows: Any, tokens: Any, **kw: Any) -> Any:
    """The call placed by a decision made afresh for it."""
    decision, given = p.decide(batch, rows, tokens, kw.get("step"), kw.get("inputs"))
    return decision.run(given)


def _fresh_tail(p: Any, op: str, indices: Any, lens: Any, payload: Any, rows: Any) -> Any:
    """The tail call placed by a decision made afresh for it."""
    idx = p.inputs.flat("indices", indices, rows, slots=True)
    decision, given = p._decide_tail(op, idx, indices, lens, payload, None)
    return decision.run(given)


FRESH = {"resolve": _fresh_resolve, "tail": _fresh_tail}


def _both(placement: Any, method: str, *args: Any, **kwargs: Any) -> None:
    """The remembered decision's placement (`method`) and a fresh decision's (on the same
    call) agree: the same Placed, or the same error."""
    try:
        want = FRESH[method](placement, *args, **kwargs)
    except fj.FutureMapError as e:
        with pytest.raises(fj.FutureMapError) as err:
            getattr(placement, method)(*args, **kwargs)
        assert str(err.value) == str(e)
        return
    got = getattr(placement, method)(*args, **kwargs)
    assert got.key == want.key and got.pack == want.pack
    assert _flat(got.args) == _flat(want.args)
    assert got.idx.size == want.idx.size and got.idx.counts == want.idx.counts
    assert _flat(got.idx.array) == _flat(want.idx.array)
    assert _flat(got.lens) == _flat(want.lens)


def _map(protocol: str, debug: bool, spec: bool) -> fj.FutureMap:
    return fj.FutureMap(
        R,
        batch_buckets=[2, 4, 8],
        token_buckets=[4, 8, 16],
        protocol=protocol,
        debug=debug,
        spec=fj.SpecConfig(topk=2) if spec else None,
    )


slots_strategy = st.lists(st.integers(-2, R + 1), min_size=3, max_size=3)


@settings(max_examples=40, deadline=None)
@given(
    protocol=st.sampled_from(["sentinel", "gather"]),
    debug=st.booleans(),
    slots=slots_strategy,
    ids=st.lists(st.integers(-R - 1, 40), min_size=5, max_size=5),
    lens=st.lists(st.integers(-3, 40), min_size=3, max_size=3),
)
def test_a_remembered_resolve_decision_places_like_a_fresh_one(
    protocol: str, debug: bool, slots: list[int], ids: list[int], lens: list[int]
) -> None:
    """Pins a remembered decision skipping a value check or padding differently from
    the first call of its layout: EXTEND batches of one layout, any values."""
    fm = _map(protocol, debug, spec=False)
    p = fm._placement
    first = fj.Batch(
        E, np.array([1, 2, 3], np.int32), np.arange(5, dtype=np.int32), np.ones(3, np.int32)
    )
    p.resolve(first)  # a layout's first call is decided and remembered
    assert p._decided
    b = fj.Batch(E, np.array(slots, np.int32), np.array(ids, np.int32), np.array(lens, np.int32))
    _both(p, "resolve", b, None, None)


@settings(max_examples=40, deadline=None)
@given(
    debug=st.booleans(),
    slots=slots_strategy,
    toks=st.lists(st.integers(-2, 40), min_size=3, max_size=3),
    wide=st.booleans(),
)
def test_a_remembered_tail_decision_places_like_a_fresh_one(
    debug: bool, slots: list[int], toks: list[int], wide: bool
) -> None:
    """Pins a tail decision (finish, publish) skipping the relayed-values or slot checks, or
    casting int64 rows without a fresh decision's fit check."""
    fm = _map("sentinel", debug, spec=False)
    p = fm._placement
    dt = np.int64 if wide else np.int32
    ok = np.array([1, 2, 3], dt)
    for op, payload in (("finish", ok), ("publish", None)):
        p.tail(op, ok, ok, payload)
        p.tail(op, ok, ok, payload)
        s, t = np.array(slots, dt), np.array(toks, dt)
        pay = None if payload is None else t
        _both(p, "tail", op, s, t, pay, None)
    big = np.array([1, 2, 2**40], np.int64)
    if wide:
        _both(p, "tail", "finish", ok, big, ok, None)


@pytest.mark.parametrize("debug", [False, True])
def test_a_step_decision_places_declared_inputs_and_device_leaves(debug: bool) -> None:
    """An engine step's decision: its declared inputs padded and packed, a traced mode and
    jax slots passed beside the buffer, as a fresh decision does."""
    fm = _map("gather", debug, spec=False)
    p = fm._placement
    declared = (fj.StepInput("pos", "token"), fj.StepInput("temp", "row", (2,), np.float32))
    ids = np.array([5, 6, 0, 7], np.int32)
    slots = np.array([0, 0, 4, 0], np.int32)
    for mode in (M, jnp.int32(2)):
        batch = fj.Batch(
            mode, np.array([1, 2, 4], np.int32), ids, np.ones(3, np.int32), None, slots
        )
        inputs = {"pos": np.arange(4, dtype=np.int32), "temp": np.ones((3, 2), np.float32)}
        p.resolve(batch, step=declared, inputs=inputs)
        p.resolve(batch, step=declared, inputs=inputs)
        for s in ([1, 2, 4], [1, 1, 4], [1, 2, R]):
            b = batch._replace(req_pool_indices=np.array(s, np.int32))
            _both(p, "resolve", b, None, None, step=declared, inputs=inputs)
        # A MIXED batch whose token slots name no running row the batch holds last.
        if mode is M:
            bad = batch._replace(token_slots=np.array([0, 0, 2, 0], np.int32))
            _both(p, "resolve", bad, None, None, step=declared, inputs=inputs)


def test_a_layout_seen_before_is_not_decided_again() -> None:
    """A steady-state call is placed by its remembered decision: nothing is decided."""
    fm = _map("sentinel", False, spec=False)
    slots = np.array([1, 2], np.int32)
    for _ in range(2):  # the first call of a layout is decided and remembered
        fm.resolve(fj.Batch(E, slots, np.array([3, 4], np.int32), np.ones(2, np.int32)))
    calls = []
    decide = fm._placement.decide
    fm._placement.decide = lambda *a: calls.append(a) or decide(*a)  # type: ignore[method-assign]
    fm.resolve(fj.Batch(E, slots, np.array([5, 6], np.int32), np.ones(2, np.int32)))
    assert calls == []
    fm.resolve(fj.Batch(E, slots, np.array([5, 6, 7], np.int32), np.ones(2, np.int32)))
    assert len(calls) == 1  # a new layout (three ids): it is decided


@pytest.mark.parametrize("given", [None, {}], ids=["inputs=None", "inputs={}"])
def test_an_engine_step_without_declared_inputs_is_decided_once(given: Any) -> None:
    """Pins an engine step declaring no inputs decided afresh at every call (its call's
    inputs, None, were not read as `{}`: no layout), about 100 us of host time a step on
    the 2-core CI VM."""
    fm = _map("sentinel", False, spec=False)
    step = fm.engine_step(lambda r, b, i: fj.StepOutput(r.seq_lens + 1, r.input_ids, r.seq_lens))
    slots = np.array([1, 2], np.int32)
    batch = fj.Batch(E, slots, np.array([3, 4], np.int32), np.ones(2, np.int32))
    for _ in range(2):  # the first call of a layout is decided and remembered
        step(batch, inputs=given)
    calls = []
    decide = fm._placement.decide
    fm._placement.decide = lambda *a: calls.append(a) or decide(*a)  # type: ignore[method-assign]
    out = step(batch._replace(input_ids=np.array([5, 6], np.int32)), inputs=given)
    assert calls == []
    assert np.asarray(out.out)[:2].tolist() == [1, 1]


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_warm_up_and_serving_key_executables_by_one_typed_key(protocol: str) -> None:
    """Warm-up plans, the class's calls and the serving guard share one key type
    (`decisions.Key`): every planned key is one, and after a guarded warm-up each op of a
    serving loop finds its executable under the key the call builds (a key built apart,
    e.g. a bare tuple, would find nothing and be refused)."""
    fm = fj.FutureMap(8, batch_buckets=(2,), token_buckets=(4,), protocol=protocol)
    fm.warm_up(guard=True)
    serving = fm._registry._serving[fm._registry.default][0]
    assert serving is not None and all(type(k) is Key for k, _ in serving)
    slots = np.array([1, 2], np.int32)
    ids = None if protocol == "gather" else -slots
    fm.publish(slots, np.array([3, 4], np.int32))
    fm.stash(slots, np.array([5, 6], np.int32))
    fm.resolve(fj.Batch(fj.ForwardMode.DECODE, slots, ids, np.array([3, 4], np.int32)))
    assert (Key("publish", 2), None) in serving and (("publish", 2), None) not in serving


# ---------------------------------------- pack and unpack (fm_jax/host/decisions.py)
def _bytes(x: object) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def _complex_with_payload() -> np.ndarray:
    """complex64 rows whose parts hold a NaN payload, -0.0 and infinities."""
    z = np.array([[1 + 2j, -0.0 + 3j], [complex(np.inf, -np.inf), 0j]], np.complex64)
    z.view(np.uint32).reshape(-1)[1] = 0x7FC00123  # the first imaginary part: a NaN payload
    return z


def test_pack_round_trips_every_dtype_bit_for_bit() -> None:
    nan = np.array([np.nan, -0.0, 0.0, 1.5], np.float32)
    nan.view(np.uint32)[0] = 0x7FC00123  # a NaN with a payload
    tree = {
        "ints": np.arange(5, dtype=np.int32) - 2,
        "floats": nan,
        "bf16": np.array([1, 0x8000, 0x7FC1], np.uint16).view(jnp.bfloat16),
        "bytes": np.array([0, 255, 7], np.uint8),
        "flags": np.array([True, False, True]),
        "scalar": np.int32(3),
        "matrix": np.arange(6, dtype=np.int16).reshape(2, 3),
        "complex": _complex_with_payload(),
        "device": jnp.arange(3, dtype=jnp.int32),
        "none": None,
    }
    spec, packed, device = decisions.pack(tree)
    assert packed is not None and packed.dtype == np.uint32 and packed.ndim == 1
    assert spec.nbytes == packed.nbytes
    assert len(device) == 1  # the jax leaf passes on its own
    raw = packed.view(np.uint8)
    for leaf, want in zip(spec.leaves, jax.tree.leaves(tree), strict=True):
        if leaf is not None:  # each host leaf starts on a word, its bytes as they were
            offset, _, _ = leaf
            n = np.asarray(want).nbytes
            assert raw[4 * offset : 4 * offset + n].tobytes() == _bytes(want)
    got = jax.jit(lambda p, d: decisions.unpack(spec, p, d))(packed, device)
    for name, want in tree.items():
        if want is None:
            assert got[name] is None
            continue
        g = np.asarray(got[name])
        assert g.dtype == np.asarray(want).dtype and g.shape == np.shape(want), name
        assert _bytes(g) == _bytes(want), name


_X64_CHILD = textwrap.dedent(
    """
    import json, numpy as np, jax
    from fm_jax.host.decisions import pack, unpack
    tree = (np.array([1, -2, 2**40 + 3, -(2**62)], np.int64), np.array([1.5, -0.0]),
            np.array([7], np.int16), np.int64(-5), np.array([2**63 + 1], np.uint64))
    spec, packed, _ = pack(tree)
    got = jax.jit(lambda p: unpack(spec, p, ()))(packed)
    same = [np.asarray(g).dtype == np.asarray(w).dtype
            and np.asarray(g).tobytes() == np.asarray(w).tobytes() for g, w in zip(got, tree)]
    print("REPORT", json.dumps(same))
    """
)


def test_pack_round_trips_8_byte_leaves_bit_for_bit() -> None:
    """With JAX's x64 mode (a child process): int64, uint64 and float64 leaves (two words
    each) between 2-byte and scalar ones come back byte for byte."""
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    assert child_report(["-c", _X64_CHILD], env, timeout=300) == [True] * 5


def test_a_packed_word_leaf_costs_no_kernel_of_its_own() -> None:
    """A 4-byte leaf read twice from the packed buffer (a sentinel resolve's ids: compared,
    and an index) compiles to as many kernels as the same function on the leaf passed on
    its own: its unpacking fuses into the consumers."""
    from fm_bench.inplace import kernels

    x = (np.arange(256, dtype=np.int32) - 128,)
    spec, packed, _ = decisions.pack(x)
    table = jnp.arange(1024, dtype=jnp.int32)

    def use(v: jax.Array, t: jax.Array) -> jax.Array:
        return jnp.where(v < 0, t[-v], v)

    def count(f: object, *args: object) -> int:
        return kernels(jax.jit(f).lower(*args).compile().as_text())

    alone = count(use, x[0], table)
    assert count(lambda p, t: use(decisions.unpack(spec, p, ())[0], t), packed, table) == alone


def test_pack_layout_is_static_and_keys_by_shape_dtype_and_placement() -> None:
    a = decisions.pack((np.zeros(4, np.int32), np.ones(2, np.float32)))[0]
    b = decisions.pack((np.ones(4, np.int32), np.zeros(2, np.float32)))[0]
    assert a == b and hash(a) == hash(b)  # values do not matter
    assert a != decisions.pack((np.zeros(8, np.int32), np.ones(2, np.float32)))[0]
    assert a != decisions.pack((np.zeros(4, np.int64), np.ones(2, np.float32)))[0]
    assert a != decisions.pack((jnp.zeros(4, np.int32), np.ones(2, np.float32)))[0]
    spec, packed, device = decisions.pack((jnp.zeros(2), None))
    assert packed is None and spec.nbytes == 0 and len(device) == 1
