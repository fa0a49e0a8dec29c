"""Recorded plans place a call exactly as the general path does, or refuse it alike.

A plan is the steady state of placement: a layout seen before is placed with only its
value checks, its padding and its packing (`fm_jax.host.plans`). These tests drive calls
of one layout with other values, valid and not, through both paths and compare what comes
out: the same key, packing layout and argument bytes, or the same refusal.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fm_jax as fj

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


def _both(placement: Any, method: str, general: str, *args: Any, **kwargs: Any) -> None:
    """The plan's placement (`method`) and the general path's (`general`, on the same
    call) agree: the same Placed, or the same error."""
    try:
        want = getattr(placement, general)(*args, **kwargs)
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
def test_a_resolve_plan_places_like_the_general_path(
    protocol: str, debug: bool, slots: list[int], ids: list[int], lens: list[int]
) -> None:
    """Pins a plan skipping a value check or padding differently from the first call of
    its layout: EXTEND batches of one layout, any values."""
    fm = _map(protocol, debug, spec=False)
    p = fm._placement
    first = fj.Batch(
        E, np.array([1, 2, 3], np.int32), np.arange(5, dtype=np.int32), np.ones(3, np.int32)
    )
    p.resolve(first)
    p.resolve(first)  # a layout's second call records its plan
    assert any(type(v).__name__ == "Plan" for v in p._plans.values())
    b = fj.Batch(E, np.array(slots, np.int32), np.array(ids, np.int32), np.array(lens, np.int32))
    _both(p, "resolve", "_place_resolve", b, None, None)


@settings(max_examples=40, deadline=None)
@given(
    debug=st.booleans(),
    slots=slots_strategy,
    toks=st.lists(st.integers(-2, 40), min_size=3, max_size=3),
    wide=st.booleans(),
)
def test_a_tail_plan_places_like_the_general_path(
    debug: bool, slots: list[int], toks: list[int], wide: bool
) -> None:
    """Pins a tail plan (finish, publish) skipping the relayed-values or slot checks, or
    casting int64 rows without the general path's fit check."""
    fm = _map("sentinel", debug, spec=False)
    p = fm._placement
    dt = np.int64 if wide else np.int32
    ok = np.array([1, 2, 3], dt)
    for op, payload in (("finish", ok), ("publish", None)):
        p.tail(op, ok, ok, payload)
        p.tail(op, ok, ok, payload)
        s, t = np.array(slots, dt), np.array(toks, dt)
        pay = None if payload is None else t
        _both(p, "tail", "_place_tail", op, s, t, pay, None)
    big = np.array([1, 2, 2**40], np.int64)
    if wide:
        _both(p, "tail", "_place_tail", "finish", ok, big, ok, None)


@pytest.mark.parametrize("debug", [False, True])
def test_a_step_plan_places_declared_inputs_and_device_leaves(debug: bool) -> None:
    """An engine step's plan: its declared inputs padded and packed, a traced mode and jax
    slots passed beside the buffer, as the general path does."""
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
            _both(p, "resolve", "_place_resolve", b, None, None, step=declared, inputs=inputs)
        # A MIXED batch whose token slots name no running row the batch holds last.
        if mode is M:
            bad = batch._replace(token_slots=np.array([0, 0, 2, 0], np.int32))
            _both(p, "resolve", "_place_resolve", bad, None, None, step=declared, inputs=inputs)


def test_a_layout_seen_before_takes_its_plan() -> None:
    """A steady-state call is placed by its recorded plan: the general path is not taken."""
    fm = _map("sentinel", False, spec=False)
    slots = np.array([1, 2], np.int32)
    for _ in range(2):  # the second call of a layout records its plan
        fm.resolve(fj.Batch(E, slots, np.array([3, 4], np.int32), np.ones(2, np.int32)))
    calls = []
    general = fm._placement._place_resolve
    fm._placement._place_resolve = lambda *a: calls.append(a) or general(*a)  # type: ignore[method-assign]
    fm.resolve(fj.Batch(E, slots, np.array([5, 6], np.int32), np.ones(2, np.int32)))
    assert calls == []
    fm.resolve(fj.Batch(E, slots, np.array([5, 6, 7], np.int32), np.ones(2, np.int32)))
    assert len(calls) == 1  # a new layout (three ids): the general path places it


@pytest.mark.parametrize("given", [None, {}], ids=["inputs=None", "inputs={}"])
def test_an_engine_step_without_declared_inputs_takes_its_plan(given: Any) -> None:
    """Pins an engine step declaring no inputs placed by the general path at every call
    (its call's inputs, None, were not read as `{}`: no layout, no plan), about 100 us of
    host time a step on the 2-core CI VM."""
    fm = _map("sentinel", False, spec=False)
    step = fm.engine_step(lambda r, b, i: fj.StepOutput(r.seq_lens + 1, r.input_ids, r.seq_lens))
    slots = np.array([1, 2], np.int32)
    batch = fj.Batch(E, slots, np.array([3, 4], np.int32), np.ones(2, np.int32))
    for _ in range(2):  # the second call of a layout records its plan
        step(batch, inputs=given)
    calls = []
    general = fm._placement._place_resolve
    fm._placement._place_resolve = lambda *a: calls.append(a) or general(*a)  # type: ignore[method-assign]
    out = step(batch._replace(input_ids=np.array([5, 6], np.int32)), inputs=given)
    assert calls == []
    assert np.asarray(out.out)[:2].tolist() == [1, 1]
