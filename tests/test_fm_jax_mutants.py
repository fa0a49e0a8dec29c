"""fm_jax behaviours that mutation testing (scripts/mutation.sh) found no test pinning.

Each test states one behaviour of the contract; docs/mutation.md lists what is left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import fm_jax as fj

R = 6
DECODE, EXTEND = fj.ForwardMode.DECODE, fj.ForwardMode.EXTEND


def i32(*xs: int) -> jax.Array:
    return jnp.asarray(np.array(xs, dtype=np.int32).reshape(-1))


def checked(fn):  # noqa: ANN001, ANN201
    """`fn` jitted under checkify with fm_jax's user checks (what debug-mode ops need)."""
    return jax.jit(checkify.checkify(fn, errors=checkify.user_checks))


def violation(err: checkify.Error) -> fj.InvariantViolation:
    with pytest.raises(fj.InvariantViolation) as info:
        fj.raise_if_violated(err)
    return info.value


def spec_draft(bonus: list[int], k: int, h: int = 0, seed: int = 0) -> fj.DraftPayload:
    rng = np.random.default_rng(seed)
    rows = len(bonus)
    return fj.DraftPayload(
        bonus_tokens=i32(*bonus),
        topk_p=jnp.asarray(rng.random((rows, k), dtype=np.float32)),
        topk_index=jnp.asarray(rng.integers(0, 1000, (rows, k), dtype=np.int32)),
        hidden_states=None
        if h == 0
        else jnp.asarray(rng.standard_normal((rows, h)).astype(np.float32)).astype(jnp.bfloat16),
    )


def spec_decode(slots: list[int]) -> fj.Batch:
    idx = i32(*slots)
    return fj.Batch(jnp.asarray(np.int32(DECODE)), idx, -idx, -idx, idx)


# ------------------------------------------------------------------ static configuration
def test_two_slots_is_the_smallest_pool() -> None:
    """R = 2 (padding slot 0 and one live slot) builds and relays; R < 2 and a pool size
    that is not an int are refused."""
    ops = fj.future_map(2)
    st = ops.publish(ops.init(), i32(1), i32(9))
    st = ops.stash(st, i32(1), i32(4))
    _, out = ops.resolve(st, fj.Batch(jnp.asarray(np.int32(DECODE)), i32(1), i32(-1), i32(-1)))
    assert out.input_ids.tolist() == [4] and out.seq_lens.tolist() == [9]
    for bad in (1, 0, -3, 4.0, "6"):
        with pytest.raises(fj.FutureMapError, match="pool_size"):
            fj.future_map(bad)  # type: ignore[arg-type]


def test_spec_widths_of_one_are_the_smallest() -> None:
    """topk = 1 and hidden = 1 relay their extras bit for bit; topk = 0 relays no top-k
    fields (an n-gram draft's); topk < 0 or hidden < 0 are refused."""
    ops = fj.future_map(R, spec=fj.SpecConfig(topk=1, hidden=1))
    payload = spec_draft([5, 6], k=1, h=1)
    st = ops.stash(ops.init(), i32(2, 3), payload)
    _, out = ops.resolve(st, spec_decode([3, 2]))
    assert out.draft is not None and out.draft.hidden_states is not None
    assert payload.hidden_states is not None
    assert out.draft.bonus_tokens.tolist() == [6, 5]
    np.testing.assert_array_equal(out.draft.topk_p, np.asarray(payload.topk_p)[::-1])
    np.testing.assert_array_equal(out.draft.topk_index, np.asarray(payload.topk_index)[::-1])
    np.testing.assert_array_equal(
        np.asarray(out.draft.hidden_states).view(np.uint16),
        np.asarray(payload.hidden_states)[::-1].view(np.uint16),
    )
    none = fj.future_map(R, spec=fj.SpecConfig(topk=0, hidden=4)).init()
    assert none.topk_p is None and none.topk_index is None and none.hidden_states is not None
    for bad in (fj.SpecConfig(topk=-1), fj.SpecConfig(topk=-1, hidden=4), fj.SpecConfig(2, -1)):
        with pytest.raises(fj.FutureMapError, match="topk >= 0 and hidden >= 0"):
            fj.future_map(R, spec=bad)


def test_an_int32_map_keeps_its_dtypes_under_x64() -> None:
    """The map's int dtype is the one it was built with, and topk_p holds float32's bits
    (uint32), also while JAX's x64 mode (whose default ints and floats are 64-bit) is on."""
    with jax.enable_x64(True):
        for debug in (False, True):
            ops = fj.future_map(R, spec=fj.SpecConfig(topk=2), debug=debug)
            st = ops.init()
            assert st.output_tokens.dtype == jnp.int32, debug
            assert st.new_seq_lens.dtype == jnp.int32, debug
            assert st.topk_index is not None and st.topk_index.dtype == jnp.int32
            assert st.topk_p is not None and st.topk_p.dtype == jnp.uint32
            assert st.output_tokens.tolist() == [fj.POISON if debug else 0] * R
    assert not jax.config.read("jax_enable_x64")


# ------------------------------------------------------------------------ consume tracking
def test_a_one_row_spec_resolve_consumes_its_slot() -> None:
    """Debug spec: a draft resolve of a single slot poisons that slot, so reading it again
    with no stash between is an RR, caught and naming the slot."""
    ops = fj.future_map(R, spec=fj.SpecConfig(topk=2), debug=True)
    st = ops.publish(ops.init(), i32(4), i32(3))
    st = ops.stash(st, i32(4), spec_draft([8], k=2))
    resolve = checked(ops.resolve)
    err, (st, out) = resolve(st, spec_decode([4]))
    fj.raise_if_violated(err)
    assert out.draft is not None and out.draft.bonus_tokens.tolist() == [8]
    assert st.output_tokens.tolist()[4] == st.new_seq_lens.tolist()[4] == fj.POISON
    st = ops.publish(st, i32(4), i32(5))  # its length again: only the token is read twice
    err, _ = resolve(st, spec_decode([4]))
    bad = violation(err)
    assert bad.invariant == "consume (WRWR)" and "slot 4" in str(bad)


def test_seq_lens_at_clips_an_out_of_range_slot_and_never_wraps() -> None:
    """seq_lens_at reads a slot outside [0, R) at the nearest end (a negative slot reads
    slot 0, never slot R-1 as Python's negative indexing would)."""
    ops = fj.future_map(R)
    st = ops.publish(ops.init(), i32(*range(R)), i32(*(10 + s for s in range(R))))
    got = ops.seq_lens_at(st, i32(-1, -R, R, R + 4, 2))
    assert got.tolist() == [10, 10, 10 + R - 1, 10 + R - 1, 12]


# ------------------------------------------------------------------- debug: relayed values
@pytest.mark.parametrize("spec", [False, True])
def test_debug_stash_reports_a_negative_token_and_its_slot(spec: bool) -> None:
    """Debug: a stashed token id < 0 (it would read as the consume poison) is reported as
    'stashed tokens >= 0', naming the field and the slot; the other rows are fine."""
    ops = fj.future_map(R, spec=fj.SpecConfig(topk=2) if spec else None, debug=True)
    payload = spec_draft([5, -1, 6], k=2) if spec else i32(5, -1, 6)
    err, _ = checked(ops.stash)(ops.init(), i32(1, 3, 4), payload)
    bad = violation(err)
    assert bad.invariant == "stashed tokens >= 0"
    field = "draft.bonus_tokens" if spec else "tokens"
    assert f"{field} holds a negative value for slot 3" in str(bad), str(bad)


def test_debug_publish_reports_a_negative_length_and_its_slot() -> None:
    """Debug: a published length < 0 (it would read as a sentinel) is reported as
    'published lengths >= 0', naming the field and the slot."""
    ops = fj.future_map(R, debug=True)
    err, _ = checked(ops.publish)(ops.init(), i32(2, 5), i32(-4, 3))
    bad = violation(err)
    assert bad.invariant == "published lengths >= 0"
    assert "new_seq_lens holds a negative value for slot 2" in str(bad), str(bad)
    err, _ = checked(ops.publish)(ops.init(), i32(2, 5), i32(0, 3))
    fj.raise_if_violated(err)  # a length of 0 is not negative


# ------------------------------------------------------------- refusals name the field
def i64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def wide(*xs: int) -> jax.Array:
    return i32(*xs).reshape(1, -1)  # 2-D: refused by the rank check


OPS = fj.future_map(R)
SPEC = fj.future_map(R, spec=fj.SpecConfig(topk=2, hidden=3))


def _resolve(**change: object) -> object:
    ops = SPEC if "draft_indices" in change else OPS
    good: dict[str, object] = dict(
        forward_mode=jnp.asarray(np.int32(DECODE)),
        req_pool_indices=i32(1),
        input_ids=i32(-1),
        seq_lens=i32(-1),
    )
    return ops.resolve(ops.init(), fj.Batch(**{**good, **change}))  # type: ignore[arg-type]


GATHER = fj.future_map(R, protocol="gather")
MIXED = fj.ForwardMode.MIXED


def _gather_mixed(**change: object) -> object:
    """A gather-protocol MIXED resolve: rows 1 and 2, three tokens, the last two taken from
    the slots' stashed tokens (token slots 1 and 2)."""
    good: dict[str, object] = dict(
        forward_mode=MIXED,
        req_pool_indices=i32(1, 2),
        input_ids=i32(5, 0, 0),
        seq_lens=i32(3, 4),
        token_slots=i32(0, 1, 2),
    )
    return GATHER.resolve(GATHER.init(), fj.Batch(**{**good, **change}))  # type: ignore[arg-type]


def _stash_draft(**change: object) -> object:
    good = spec_draft([4], k=2, h=3)._asdict()
    return SPEC.stash(SPEC.init(), i32(1), fj.DraftPayload(**{**good, **change}))


# (call, the field its refusal must name first); the int64 cases run under x64, where an
# int64 array exists and does not fit the int32 map.
REFUSALS = {
    "publish indices rank": (lambda: OPS.publish(OPS.init(), wide(1), i32(4)), "indices"),
    "publish lengths rank": (lambda: OPS.publish(OPS.init(), i32(1), wide(4)), "new_seq_lens"),
    "publish lengths rows": (lambda: OPS.publish(OPS.init(), i32(1), i32(4, 4)), "new_seq_lens"),
    "publish indices int64": (lambda: OPS.publish(OPS.init(), i64(1), i32(4)), "indices"),
    "publish lengths int64": (lambda: OPS.publish(OPS.init(), i32(1), i64(4)), "new_seq_lens"),
    "stash tokens rank": (lambda: OPS.stash(OPS.init(), i32(1), wide(4)), "tokens"),
    "stash tokens rows": (lambda: OPS.stash(OPS.init(), i32(1, 2), i32(4)), "tokens"),
    "stash tokens int64": (lambda: OPS.stash(OPS.init(), i32(1), i64(4)), "tokens"),
    "stash bonus rank": (lambda: _stash_draft(bonus_tokens=wide(4)), "draft.bonus_tokens"),
    "stash bonus rows": (lambda: _stash_draft(bonus_tokens=i32(4, 4)), "draft.bonus_tokens"),
    "stash bonus int64": (lambda: _stash_draft(bonus_tokens=i64(4)), "draft.bonus_tokens"),
    "stash topk_p shape": (lambda: _stash_draft(topk_p=jnp.ones((1, 3))), "draft.topk_p"),
    "stash topk_index dtype": (
        lambda: _stash_draft(topk_index=jnp.ones((1, 2), jnp.float32)),
        "draft.topk_index",
    ),
    "stash topk_index int64": (
        lambda: _stash_draft(topk_index=np.ones((1, 2), np.int64)),
        "draft.topk_index",
    ),
    "stash hidden shape": (
        lambda: _stash_draft(hidden_states=jnp.ones((1, 2), jnp.bfloat16)),
        "draft.hidden_states",
    ),
    "resolve indices rank": (lambda: _resolve(req_pool_indices=wide(1)), "req_pool_indices"),
    "resolve indices int64": (lambda: _resolve(req_pool_indices=i64(1)), "req_pool_indices"),
    "resolve mode rank": (lambda: _resolve(forward_mode=i32(1)), "forward_mode"),
    "resolve host mode value": (lambda: _resolve(forward_mode=7), "forward_mode"),
    "resolve ids rank": (lambda: _resolve(input_ids=wide(-1)), "input_ids"),
    "resolve ids int64": (lambda: _resolve(input_ids=i64(-1)), "input_ids"),
    "resolve lens rank": (lambda: _resolve(seq_lens=wide(-1)), "seq_lens"),
    "resolve lens rows": (lambda: _resolve(seq_lens=i32(-1, -1)), "seq_lens"),
    "resolve lens int64": (lambda: _resolve(seq_lens=i64(-1)), "seq_lens"),
    "resolve draft rank": (lambda: _resolve(draft_indices=wide(1)), "draft_indices"),
    "invalidate rank": (
        lambda: OPS.invalidate(fj.Batch(DECODE, i32(1), i32(5), i32(3)), wide(1)),
        "indices",
    ),
    "invalidate int64": (
        lambda: OPS.invalidate(fj.Batch(DECODE, i32(1), i32(5), i32(3)), i64(1)),
        "indices",
    ),
    "seq_lens_at rank": (lambda: OPS.seq_lens_at(OPS.init(), wide(1)), "indices"),
    "stash draft on a non-spec map": (
        lambda: OPS.stash(OPS.init(), i32(1), spec_draft([4], k=2)),
        "stash",
    ),
    "stash tokens on a spec map": (lambda: SPEC.stash(SPEC.init(), i32(1), i32(4)), "stash"),
    "stash hidden on hidden=0": (
        lambda: fj.future_map(R, spec=fj.SpecConfig(topk=2)).stash(
            SPEC.init(), i32(1), spec_draft([4], k=2, h=3)
        ),
        "draft.hidden_states",
    ),
    "resolve draft on a non-spec map": (
        lambda: OPS.resolve(OPS.init(), spec_decode([1])),
        "batch.draft_indices",
    ),
    "seq_lens_at int64": (lambda: OPS.seq_lens_at(OPS.init(), i64(1)), "indices"),
    "resolve token_slots on a sentinel map": (
        lambda: _resolve(token_slots=i32(0)),
        "batch.token_slots",
    ),
    "gather token_slots rank": (lambda: _gather_mixed(token_slots=wide(0, 1, 2)), "token_slots"),
    "gather token_slots rows": (lambda: _gather_mixed(token_slots=i32(0, 1)), "token_slots"),
    "gather token_slots int64": (lambda: _gather_mixed(token_slots=i64(0, 1, 2)), "token_slots"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refusal_names_the_bad_field_as_its_subject(case: str) -> None:
    """The pure ops refuse a bad input when traced with a message whose subject is the
    field at fault, spelt as the caller passes it (an int64 array into an int32 map too,
    under x64, where such an array exists)."""
    call, name = REFUSALS[case]
    with jax.enable_x64("int64" in case), pytest.raises(fj.FutureMapError) as err:
        call()
    assert str(err.value).startswith(name + " "), str(err.value)


# ------------------------------------------------------------------- resolve: kinds, dtypes
@pytest.mark.parametrize("traced", [False, True])
def test_a_non_decode_batch_keeps_its_own_lengths(traced: bool) -> None:
    """EXTEND and MIXED rows carry real lengths: resolve passes them through and never reads
    the published ones, whether the mode is known on the host or traced."""
    st = OPS.publish(OPS.init(), i32(1, 2), i32(40, 50))
    st = OPS.stash(st, i32(1, 2), i32(4, 5))
    for kind in (fj.ForwardMode.EXTEND, fj.ForwardMode.MIXED):
        mode = jnp.asarray(np.int32(kind)) if traced else kind
        _, out = OPS.resolve(st, fj.Batch(mode, i32(1, 2), i32(9, 9, -2), i32(7, 8)))
        assert out.seq_lens.tolist() == [7, 8], kind
        assert out.input_ids.tolist() == [9, 9, 5], kind


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
@pytest.mark.parametrize("traced", [False, True])
def test_resolved_arrays_are_in_the_map_dtype(traced: bool, protocol: str) -> None:
    """An int64 map (x64) resolves int32 inputs into int64 ids and lengths, DECODE or not,
    in either protocol: what it returns is in its own dtype, like what it stores."""
    with jax.enable_x64(True):
        ops = fj.future_map(R, dtype=jnp.int64, protocol=protocol)
        st = ops.publish(ops.init(), i32(1), i32(6))
        st = ops.stash(st, i32(1), i32(3))
        for kind in (DECODE, EXTEND):
            mode = jnp.asarray(np.int32(kind)) if traced else kind
            if protocol == "sentinel":  # sentinels resolved from the map
                batch = fj.Batch(mode, i32(1), i32(-1), i32(-1 if kind else 2))
            else:  # DECODE ids gathered; lengths (and EXTEND ids) as the host gives them
                batch = fj.Batch(mode, i32(1), i32(0 if kind else 3), i32(6 if kind else 2))
            _, out = ops.resolve(st, batch)
            assert out.input_ids.dtype == jnp.int64 and out.seq_lens.dtype == jnp.int64, kind
            assert out.input_ids.tolist() == [3], kind
            assert out.seq_lens.tolist() == ([6] if kind == DECODE else [2]), kind


def test_debug_reports_a_traced_mode_outside_forward_mode() -> None:
    """Debug: a traced forward_mode that is no ForwardMode (7) is reported, naming the
    value as the int it is."""
    ops = fj.future_map(R, debug=True)
    batch = fj.Batch(jnp.asarray(np.int32(7)), i32(1), i32(5), i32(3))
    err, _ = checked(ops.resolve)(ops.init(), batch)
    bad = violation(err)
    assert bad.invariant == "forward mode"
    assert "forward_mode 7 is not a ForwardMode" in str(bad), str(bad)


def test_spec_hidden_dtype_must_be_a_float_the_map_stores() -> None:
    """hidden_dtype is bf16, f16 or f32: any other dtype is refused, naming the field."""
    for ok in (jnp.bfloat16, jnp.float16, jnp.float32):
        ops = fj.future_map(R, spec=fj.SpecConfig(topk=1, hidden=2, hidden_dtype=jnp.dtype(ok)))
        st = ops.init()
        assert st.hidden_states is not None and st.hidden_states.shape == (R, 2)
    for bad in (jnp.float64, jnp.int16, jnp.uint8):
        with pytest.raises(fj.FutureMapError, match="^spec.hidden_dtype must be"):
            fj.future_map(R, spec=fj.SpecConfig(topk=1, hidden=2, hidden_dtype=np.dtype(bad)))


def test_ops_expose_their_static_configuration() -> None:
    """FutureMapOps carries the configuration it was built with (pool size, int dtype,
    normalised spec, debug), for an engine that sizes its own arrays from it."""
    cfg = fj.SpecConfig(topk=3, hidden=2, hidden_dtype=jnp.float16)
    ops = fj.future_map(R, spec=cfg, debug=True)
    assert (ops.pool_size, ops.dtype, ops.debug) == (R, np.dtype(np.int32), True)
    assert ops.spec == fj.SpecConfig(topk=3, hidden=2, hidden_dtype=np.dtype(np.float16))
    plain = fj.future_map(R)
    assert plain.spec is None and plain.debug is False


def test_token_zero_is_a_token_not_a_reference() -> None:
    """Input id 0 is the real token 0 (sentinels are <= -1): resolve keeps it, whatever the
    padding slot 0 holds, and in debug mode it is never checked or consumed."""
    for debug in (False, True):
        ops = fj.future_map(R, debug=debug)
        st = ops.stash(ops.init(), i32(0, 2), i32(77, 5))  # slot 0: padding garbage
        batch = fj.Batch(jnp.asarray(np.int32(EXTEND)), i32(1, 2), i32(0, 3, 0, -2), i32(3, 1))
        err, (st, out) = checked(ops.resolve)(st, batch)
        fj.raise_if_violated(err)
        assert out.input_ids.tolist() == [0, 3, 0, 5], debug


def test_debug_a_sentinel_naming_a_slot_outside_the_batch_consumes_that_slot() -> None:
    """Debug: a read consumes the slot it reads, even one outside the batch's slots, so a
    second read of it is an RR, caught and naming the slot (as fm_torch does)."""
    ops = fj.future_map(R, debug=True)
    st = ops.stash(ops.init(), i32(1, 2), i32(4, 5))
    resolve = checked(ops.resolve)
    extend = jnp.asarray(np.int32(EXTEND))
    err, (st, out) = resolve(st, fj.Batch(extend, i32(2), i32(-1), i32(3)))
    fj.raise_if_violated(err)
    assert out.input_ids.tolist() == [4]
    assert st.output_tokens.tolist()[1:3] == [fj.POISON, fj.POISON]
    err, _ = resolve(st, fj.Batch(extend, i32(3), i32(-1), i32(3)))
    bad = violation(err)
    assert bad.invariant == "consume (WRWR)" and "slot 1" in str(bad), str(bad)


def test_debug_an_idle_resolve_checks_and_changes_nothing() -> None:
    """Debug: an idle rank's resolve (no rows) reports nothing and leaves every buffer."""
    for spec in (None, fj.SpecConfig(topk=2)):
        ops = fj.future_map(R, spec=spec, debug=True)
        st = ops.stash(ops.init(), i32(1), spec_draft([4], k=2) if spec else i32(4))
        empty = i32()
        batch = fj.Batch(jnp.asarray(np.int32(fj.ForwardMode.IDLE)), empty, empty, empty)
        if spec:
            batch = batch._replace(draft_indices=empty)
        err, (after, out) = checked(ops.resolve)(st, batch)
        fj.raise_if_violated(err)
        assert out.input_ids.shape == (0,)
        for name, buf in st._asdict().items():
            if buf is not None:
                np.testing.assert_array_equal(getattr(after, name), buf, err_msg=name)


def test_debug_spec_prefill_checks_its_sentinels() -> None:
    """Debug spec: a batch with no draft input (prefill) is still checked: a sentinel that
    names a slot outside [0, R) is reported; a clean one is not."""
    ops = fj.future_map(R, spec=fj.SpecConfig(topk=2), debug=True)
    resolve = checked(ops.resolve)
    extend = jnp.asarray(np.int32(EXTEND))
    err, (_, out) = resolve(ops.init(), fj.Batch(extend, i32(1), i32(7, 8), i32(2)))
    fj.raise_if_violated(err)
    assert out.draft is None and out.input_ids.tolist() == [7, 8]
    err, _ = resolve(ops.init(), fj.Batch(extend, i32(1), i32(7, -R - 2), i32(2)))
    bad = violation(err)
    assert bad.invariant == "sentinel range" and f"slot {R + 2}" in str(bad), str(bad)


def test_an_int64_spec_map_relays_int64_top_k_ids() -> None:
    """Under x64, an int64 map takes int64 top-k ids and relays values beyond int32."""
    big = 2**40 + 7
    with jax.enable_x64(True):
        ops = fj.future_map(R, dtype=jnp.int64, spec=fj.SpecConfig(topk=2))
        payload = spec_draft([4], k=2)._replace(topk_index=np.array([[big, 3]], np.int64))
        st = ops.stash(ops.init(), i32(2), payload)
        _, out = ops.resolve(st, spec_decode([2]))
        assert out.draft is not None and out.draft.topk_index.tolist() == [[big, 3]]


@pytest.mark.parametrize("slots", [[R + 3], [2, R + 3, 1], [R + 3, 1, 2, -2]])
@pytest.mark.parametrize(
    ("op", "field"),
    [
        ("publish", "indices"),
        ("stash", "indices"),
        ("resolve", "req_pool_indices"),
        ("draft", "draft_indices"),
        ("seq_lens_at", "indices"),
    ],
)
def test_debug_slot_range_names_the_field_and_the_slot(
    op: str, field: str, slots: list[int]
) -> None:
    """Debug: a slot outside [0, R) is reported as 'slot range', naming the field it came
    in and the slot, in a batch of one row or of several, wherever the slot sits (one too
    large is named before one below 0)."""
    ops = fj.future_map(R, spec=fj.SpecConfig(topk=2), debug=True)
    good = list(range(1, len(slots) + 1))
    st = ops.publish(ops.init(), i32(*good), i32(*[3] * len(good)))
    st = ops.stash(st, i32(*good), spec_draft([4] * len(good), k=2))
    bad = i32(*slots)
    calls = {
        "publish": lambda: checked(ops.publish)(st, bad, i32(*[3] * len(slots))),
        "stash": lambda: checked(ops.stash)(st, bad, spec_draft([4] * len(slots), k=2)),
        "resolve": lambda: checked(ops.resolve)(
            st, spec_decode(slots)._replace(draft_indices=i32(*good))
        ),
        "draft": lambda: checked(ops.resolve)(st, spec_decode(good)._replace(draft_indices=bad)),
        "seq_lens_at": lambda: checked(ops.seq_lens_at)(st, bad),
    }
    err, _ = calls[op]()
    report = violation(err)
    assert report.invariant == "slot range"
    assert f"{field} holds slot {R + 3} outside [0, {R})" in str(report), str(report)


def test_debug_a_batch_that_reads_no_token_consumes_nothing() -> None:
    """Debug: a batch whose rows carry no token ids reads nothing from output_tokens, so it
    is clean and consumes nothing (the slots' stashed tokens stay readable)."""
    ops = fj.future_map(R, debug=True)
    st = ops.publish(ops.init(), i32(1, 2), i32(3, 3))
    st = ops.stash(st, i32(1, 2), i32(4, 5))
    resolve = checked(ops.resolve)
    err, (st, out) = resolve(
        st, fj.Batch(jnp.asarray(np.int32(EXTEND)), i32(1, 2), i32(), i32(3, 3))
    )
    fj.raise_if_violated(err)
    assert out.input_ids.shape == (0,)
    assert st.output_tokens.tolist()[1:3] == [4, 5]


def test_debug_sentinel_range_names_a_huge_bad_sentinel_exactly() -> None:
    """Debug: the sentinel-range report names the slot a bad sentinel points at exactly,
    also one far beyond any float32's exact integers (2**27 + 3)."""
    ops = fj.future_map(R, debug=True)
    batch = fj.Batch(jnp.asarray(np.int32(EXTEND)), i32(1, 2), i32(5, -(2**27 + 3), 6), i32(3, 3))
    err, _ = checked(ops.resolve)(ops.init(), batch)
    report = violation(err)
    assert report.invariant == "sentinel range"
    assert f"slot {2**27 + 3}," in str(report), str(report)


@pytest.mark.parametrize("ids", [[-R], [5, -R], [-(R + 1), 4, 6]])
def test_debug_sentinel_range_starts_at_minus_r(ids: list[int]) -> None:
    """Debug: -R is the first sentinel out of range (slots end at R-1), in a batch of one
    token or more."""
    ops = fj.future_map(R, debug=True)
    rows = i32(*range(1, len(ids) + 1))
    batch = fj.Batch(jnp.asarray(np.int32(EXTEND)), rows, i32(*ids), rows)
    err, _ = checked(ops.resolve)(ops.init(), batch)
    report = violation(err)
    assert report.invariant == "sentinel range"
    assert f"slot {-min(ids)}," in str(report), str(report)
    st = ops.stash(ops.init(), i32(R - 1), i32(8))
    ok = fj.Batch(jnp.asarray(np.int32(EXTEND)), i32(R - 1), i32(-(R - 1)), i32(1))
    err, (_, out) = checked(ops.resolve)(st, ok)
    fj.raise_if_violated(err)
    assert out.input_ids.tolist() == [8]


@pytest.mark.parametrize("slots", [[1, 3, 3], [3, 2, 1, 2], [4, 0, 0, 4, 2]])
def test_debug_a_repeated_live_slot_is_named_wherever_it_sorts(slots: list[int]) -> None:
    """Debug: a live slot given twice in one batch is reported as 'duplicate live slot'
    naming it, whichever slots sort before it; slot 0 (padding) may repeat."""
    ops = fj.future_map(R, debug=True)
    dup = max(s for s in slots if slots.count(s) > 1 and s != 0)
    err, _ = checked(ops.publish)(ops.init(), i32(*slots), i32(*[3] * len(slots)))
    report = violation(err)
    assert report.invariant == "duplicate live slot"
    assert f"holds live slot {dup} more than once" in str(report), str(report)


def test_debug_one_row_ops_are_checked() -> None:
    """Debug: a batch of a single row gets every check a larger one gets: its slot range,
    its relayed value and its restored length."""
    ops = fj.future_map(R, debug=True)
    cases = [
        (checked(ops.publish), (ops.init(), i32(R), i32(3)), "slot range"),
        (checked(ops.publish), (ops.init(), i32(2), i32(-3)), "published lengths >= 0"),
        (checked(ops.stash), (ops.init(), i32(2), i32(-1)), "stashed tokens >= 0"),
        (
            checked(ops.resolve),
            (ops.init(), fj.Batch(jnp.asarray(np.int32(DECODE)), i32(2), i32(-2), i32(-2))),
            "seq_lens > 0",
        ),
    ]
    for fn, args, invariant in cases:
        err, _ = fn(*args)
        assert violation(err).invariant == invariant


def test_debug_a_padding_row_relaying_a_negative_token_is_reported() -> None:
    """Debug: the relayed-value checks cover padding rows too (slot 0): a negative token
    stashed there is reported, naming slot 0."""
    ops = fj.future_map(R, debug=True)
    err, _ = checked(ops.stash)(ops.init(), i32(2, 0), i32(5, -1))
    report = violation(err)
    assert report.invariant == "stashed tokens >= 0"
    assert "tokens holds a negative value for slot 0" in str(report), str(report)


def test_debug_a_restored_length_of_one_is_positive() -> None:
    """Debug: `seq_lens > 0` holds for a length of 1 (a one-token sequence)."""
    ops = fj.future_map(R, debug=True)
    st = ops.publish(ops.init(), i32(1, 2), i32(1, 7))
    st = ops.stash(st, i32(1, 2), i32(4, 5))
    batch = fj.Batch(jnp.asarray(np.int32(DECODE)), i32(1, 2), i32(-1, -2), i32(-1, -2))
    err, (_, out) = checked(ops.resolve)(st, batch)
    fj.raise_if_violated(err)
    assert out.seq_lens.tolist() == [1, 7] and out.input_ids.tolist() == [4, 5]


# ------------------------------------------------------- host inputs (the FutureMap class)
def host_lens(fm: fj.FutureMap, slots: Any) -> list[int]:
    """resolve_seq_lens_cpu of host rows given as a global array: a list of lengths."""
    got = fm.resolve_seq_lens_cpu(slots)
    assert isinstance(got, np.ndarray), got
    return list(got.tolist())


@pytest.fixture(scope="module")
def host_map() -> fj.FutureMap:
    """A one-device map with small buckets, slots 1..3 published (lengths 11..13) and
    stashed (tokens 21..23)."""
    fm = fj.FutureMap(R, batch_buckets=(2, 4), token_buckets=(2, 4))
    fm.publish(np.array([1, 2, 3]), np.array([11, 12, 13]))
    fm.stash(np.array([1, 2, 3]), np.array([21, 22, 23]))
    return fm


HOST_REFUSALS = {
    # bad slots are listed in the order given; a single row is judged like several
    "slots out of range": (
        lambda fm: fm.publish(np.array([2, R, 0, -1]), np.array([3, 3, 3, 3])),
        f"indices holds slots [{R}, -1] outside [0, {R})",
    ),
    "one slot out of range": (
        lambda fm: fm.publish(np.array([R]), np.array([3])),
        f"indices holds slots [{R}] outside [0, {R})",
    ),
    "one negative slot": (
        lambda fm: fm.invalidate(fj.Batch(DECODE, i32(1), i32(-1), i32(-1)), np.array([-1])),
        f"indices holds slots [-1] outside [0, {R})",
    ),
    "repeated live slots": (
        lambda fm: fm.resolve_seq_lens_cpu(np.array([3, 0, 0, 3])),
        "indices holds live slots [3] more than once in one batch",
    ),
    "only the largest slot out of range": (
        lambda fm: fm.publish(np.array([2, 1, R]), np.array([3, 3, 3])),
        f"indices holds slots [{R}] outside [0, {R})",
    ),
    "lengths keyed by a non-int": (
        lambda fm: fm.publish({0: np.array([1])}, {"0": np.array([3])}),
        "new_seq_lens is keyed by DP rank (an int), got '0'",
    ),
    "a decode row with two ids": (
        lambda fm: fm.resolve(
            fj.Batch(DECODE, np.array([1, 2]), np.array([-1, -2, -2]), np.array([-1, -2]))
        ),
        "input_ids of a DECODE batch has 3 ids for 2 rows: a decode row carries one id",
    ),
    "a list of slots": (
        lambda fm: fm.resolve_seq_lens_cpu([2, R + 1]),
        f"indices holds slots [{R + 1}] outside [0, {R})",
    ),
    "sentinels out of range": (
        lambda fm: fm.resolve(
            fj.Batch(fj.ForwardMode.EXTEND, np.array([1]), np.array([-R, 4, -9, -5]), np.array([4]))
        ),
        f"input_ids holds sentinels [-{R}, -9] naming slots outside [0, {R})",
    ),
    "int64 beyond int32": (
        lambda fm: fm.resolve(
            fj.Batch(fj.ForwardMode.EXTEND, np.array([1]), np.array([5]), np.array([2**31]))
        ),
        "seq_lens holds values that do not fit the int32 buffer",
    ),
    "int64 below int32": (
        lambda fm: fm.resolve(
            fj.Batch(fj.ForwardMode.EXTEND, np.array([1]), np.array([5]), np.array([-(2**31) - 1]))
        ),
        "seq_lens holds values that do not fit the int32 buffer",
    ),
    "float slots": (
        lambda fm: fm.publish(np.array([1.0]), np.array([3])),
        "indices must have an integer dtype, got float64",
    ),
    "float lengths": (
        lambda fm: fm.publish(np.array([1]), np.array([3.0])),
        "new_seq_lens must have an integer dtype, got float64",
    ),
    "negative lengths": (
        lambda fm: fm.publish(np.array([1, 2, 3, 4]), np.array([-2, 0, 3, -2])),
        "new_seq_lens holds negative values [-2]:",
    ),
    "2-D slots": (
        lambda fm: fm.publish([[1, 2]], [3, 3]),
        "indices must be 1-D, got shape (1, 2)",
    ),
    "an object for slots": (
        lambda fm: fm.publish({1, 2}, [3, 3]),
        "indices is not a numeric array",
    ),
    "a mapping of a non-array": (
        lambda fm: fm.publish({0: {1, 2}}, {0: np.array([3, 3])}),
        "indices is not a numeric array",
    ),
    "a mapping keyed by a non-int": (
        lambda fm: fm.publish({"0": np.array([1])}, {"0": np.array([3])}),
        "indices is keyed by DP rank (an int), got '0'",
    ),
    "a mapping keyed by True": (
        lambda fm: fm.publish({True: np.array([1])}, {True: np.array([3])}),
        "indices is keyed by DP rank (an int), got True",
    ),
    "a mapping with another rank": (
        lambda fm: fm.publish({1: np.array([1])}, {1: np.array([3])}),
        "indices has rows for DP rank 1, which is not one of this process's ranks [0]",
    ),
    "lengths not given like the slots": (
        lambda fm: fm.publish({0: np.array([1])}, np.array([3])),
        "new_seq_lens must be given like the indices: a mapping DP rank -> rows",
    ),
    "lengths as a mapping for global slots": (
        lambda fm: fm.publish(np.array([1]), {0: np.array([3])}),
        "new_seq_lens must be given like the indices: global rows",
    ),
    "rows not a bucket": (
        lambda fm: fm.publish(np.array([1]), np.array([3]), rows=3),
        "rows=3 is not one of the buckets (2, 4)",
    ),
    "rows below the batch": (
        lambda fm: fm.publish(np.array([1, 2, 3]), np.array([3, 3, 3]), rows=2),
        "rows=2 is smaller than a rank's 3 entries",
    ),
    "too many rows": (
        lambda fm: fm.publish(np.arange(1, 6), np.full(5, 3)),
        "rows of 5 exceeds the largest bucket 4",
    ),
    "too many rows as a list": (
        lambda fm: fm.stash([1, 2, 3, 4, 5], [3, 3, 3, 3, 3]),
        "rows of 5 exceeds the largest bucket 4",
    ),
    "tokens below the ids": (
        lambda fm: fm.resolve(
            fj.Batch(fj.ForwardMode.EXTEND, np.array([1]), np.array([5, 5, 5]), np.array([4])),
            tokens=2,
        ),
        "tokens=2 is smaller than a rank's 3 entries",
    ),
    "tokens below the ids as lists": (
        lambda fm: fm.resolve(fj.Batch(fj.ForwardMode.EXTEND, [1], [5, 5, 5], [4]), tokens=2),  # type: ignore[arg-type]
        "tokens=2 is smaller than a rank's 3 entries",
    ),
    "sentinels as a list": (
        lambda fm: fm.resolve(fj.Batch(fj.ForwardMode.EXTEND, [1], [5, -9], [4])),  # type: ignore[arg-type]
        f"input_ids holds sentinels [-9] naming slots outside [0, {R})",
    ),
    "a scalar for slots": (
        lambda fm: fm.resolve_seq_lens_cpu(3),
        "indices must be 1-D, got shape ()",
    ),
    "jax slots not a bucket": (
        lambda fm: fm.publish(i32(1, 2, 3), i32(3, 3, 3)),
        "indices has 3 entries, not a bucket size (2, 4) (any bucket for each of 1 DP rank(s))",
    ),
    "jax slots not the rows asked for": (
        lambda fm: fm.publish(i32(1, 2), i32(3, 3), rows=4),
        "indices has 2 entries, not a bucket size (2, 4) (4 for each of 1 DP rank(s))",
    ),
    "jax slots of a float dtype": (
        lambda fm: fm.publish(jnp.ones(2), i32(3, 3)),
        "indices must be a 1-D integer array, got (2,) float32",
    ),
    "jax lengths of another row count": (
        lambda fm: fm.publish(i32(1, 2), i32(3, 3, 3, 3)),
        "new_seq_lens has (4,) rows, indices have (2,)",
    ),
    "jax lengths of a float dtype": (
        lambda fm: fm.publish(i32(1, 2), jnp.ones(2)),
        "new_seq_lens must have an integer dtype, got float32",
    ),
    "host lengths not an array for jax slots": (
        lambda fm: fm.publish(i32(1, 2), {3, 4}),
        "new_seq_lens is not a numeric array",
    ),
    "host lengths for jax slots": (
        lambda fm: fm.publish(i32(1, 2), np.array([3, 3, 3])),
        "new_seq_lens has (3,) rows, indices have (2,)",
    ),
}


@pytest.mark.parametrize("case", list(HOST_REFUSALS))
def test_host_input_refusals_say_what_is_wrong(host_map: fj.FutureMap, case: str) -> None:
    """The class refuses bad host input before anything reaches the device, with a message
    that names the field and lists exactly the offending values (in the order given)."""
    call, message = HOST_REFUSALS[case]
    with pytest.raises(fj.FutureMapError) as err:
        call(host_map)
    assert str(err.value).startswith(message), str(err.value)
    assert host_lens(host_map, np.array([1, 2, 3])) == [11, 12, 13]


def test_host_inputs_at_the_edges_of_their_ranges_are_taken(host_map: fj.FutureMap) -> None:
    """What the checks refuse starts just past the edges: slot 0 and R-1, sentinel -(R-1),
    slot 0 twice, and every int32 value as a length carried through an EXTEND batch."""
    assert len(host_lens(host_map, np.array([0]))) == 1
    assert len(host_lens(host_map, np.array([R - 1, 0, 0]))) == 3
    edges = np.array([-(2**31), 2**31 - 1], np.int64)
    out = host_map.resolve(
        fj.Batch(fj.ForwardMode.EXTEND, np.array([1, 2]), np.array([-(R - 1), 0]), edges)
    )
    assert np.asarray(out.seq_lens)[:2].tolist() == edges.tolist()
    assert host_lens(host_map, np.array([3, 1], np.uint64)) == [13, 11]


def test_host_inputs_in_every_form_are_relayed_alike() -> None:
    """A numpy array, a list, a mapping {0: rows} and a bucket-sized jax array are the same
    rows on one device: each relays the same values, and the results come back in the form
    the slots were given (a mapping for a mapping, padding removed for host rows)."""
    forms: dict[str, Callable[[list[int]], Any]] = {
        "numpy": lambda xs: np.array(xs, np.int64),
        "list": lambda xs: list(xs),
        "mapping": lambda xs: {0: np.array(xs, np.int16)},
    }
    for name, form in forms.items():
        fm = fj.FutureMap(R, batch_buckets=(2, 4), token_buckets=(2, 4))
        fm.publish(form([3, 1, 2]), form([30, 10, 20]))
        fm.stash(form([3, 1, 2]), form([33, 11, 22]))
        got = fm.resolve_seq_lens_cpu(form([1, 3]))
        if name == "mapping":
            assert isinstance(got, dict) and list(got) == [0], name
            got = got[0]
        assert np.asarray(got).tolist() == [10, 30], name
        batch = fj.Batch(DECODE, form([2, 3]), form([-2, -3]), form([-2, -3]))
        out = fm.resolve(batch)
        assert np.asarray(out.input_ids)[:2].tolist() == [22, 33], name
        assert np.asarray(out.seq_lens)[:2].tolist() == [20, 30], name
    fm = fj.FutureMap(R, batch_buckets=(2, 4), token_buckets=(2, 4))
    fm.publish(i32(3, 1), i32(30, 10), rows=2)
    fm.stash(i32(3, 1), np.array([33, 11]))
    assert host_lens(fm, i32(1, 3)) == [10, 30]
    out = fm.resolve(fj.Batch(DECODE, i32(1, 3), np.array([-1, -3]), np.array([-1, -3])))
    assert np.asarray(out.input_ids).tolist() == [11, 33]
    assert np.asarray(out.seq_lens).tolist() == [10, 30]


def test_an_idle_mapping_relays_nothing() -> None:
    """A mapping with no rank (every local rank idle) publishes and stashes nothing, and
    its lengths come back per local rank, with no rows."""
    fm = fj.FutureMap(R, batch_buckets=(2,), token_buckets=(2,))
    fm.publish(np.array([1]), np.array([5]))
    fm.publish({}, {})
    fm.stash({}, {})
    assert host_lens(fm, np.array([1])) == [5]
    idle = fm.resolve_seq_lens_cpu({})
    assert isinstance(idle, dict) and {r: v.tolist() for r, v in idle.items()} == {0: []}
    out = fm.resolve({})  # every rank idle: padding rows only
    assert np.asarray(out.input_ids).tolist() == [0, 0]


def test_resolve_pads_to_the_buckets_asked_for() -> None:
    """A resolve is padded to the rows= and tokens= buckets it is given (those of a warmed
    executable); an idle resolve (no rows) to the smallest buckets; an idle invalidate of
    host slots returns their real rows: none."""
    fm = fj.FutureMap(R, batch_buckets=(1, 2, 4), token_buckets=(1, 2, 4))
    fm.publish(np.array([1, 2]), np.array([5, 6]))
    fm.stash(np.array([1, 2]), np.array([7, 8]))
    batch = fj.Batch(DECODE, np.array([1, 2]), np.array([-1, -2]), np.array([-1, -2]))
    out = fm.resolve(batch, rows=4, tokens=4)
    assert np.asarray(out.input_ids).tolist() == [7, 8, 0, 0]
    assert np.asarray(out.seq_lens).tolist()[:2] == [5, 6] and out.seq_lens.shape == (4,)
    empty = np.zeros(0, np.int32)
    idle = fm.resolve(fj.Batch(fj.ForwardMode.IDLE, empty, empty, empty))
    assert idle.input_ids.shape == (1,) and idle.seq_lens.shape == (1,)
    sentinels = fm.invalidate(fj.Batch(fj.ForwardMode.IDLE, empty, empty, empty), empty)
    assert np.asarray(sentinels.input_ids).tolist() == []  # host slots: their real rows


def test_host_rows_as_lists_are_padded_to_the_buckets_asked_for() -> None:
    """Lists take the general path of host rows: rows= and tokens= pad them as they pad
    numpy rows."""
    fm = fj.FutureMap(R, batch_buckets=(2, 4), token_buckets=(2, 4))
    fm.publish([1, 2], [5, 6], rows=4)
    fm.stash([1, 2], [7, 8], rows=4)
    out = fm.resolve(fj.Batch(DECODE, [1, 2], [-1, -2], [-1, -2]), rows=4, tokens=4)  # type: ignore[arg-type]
    assert np.asarray(out.input_ids).tolist() == [7, 8, 0, 0]
    assert np.asarray(out.seq_lens).tolist()[:2] == [5, 6] and out.seq_lens.shape == (4,)


@pytest.fixture(scope="module")
def spec_host_map() -> fj.FutureMap:
    return fj.FutureMap(
        R, spec=fj.SpecConfig(topk=2, hidden=3), batch_buckets=(2, 4), token_buckets=(2, 4)
    )


def test_a_draft_of_jax_rows_is_relayed(spec_host_map: fj.FutureMap) -> None:
    """A DraftPayload of bucket-sized jax arrays is taken as it is and relayed bit for bit."""
    payload = spec_draft([4, 9], k=2, h=3, seed=3)
    spec_host_map.stash(i32(3, 5), payload)
    out = spec_host_map.resolve(fj.Batch(DECODE, i32(5, 3), i32(-5, -3), i32(-5, -3), i32(5, 3)))
    spec_host_map.check()
    assert out.draft is not None and out.draft.hidden_states is not None
    assert payload.hidden_states is not None
    assert np.asarray(out.draft.bonus_tokens).tolist() == [9, 4]
    np.testing.assert_array_equal(out.draft.topk_p, np.asarray(payload.topk_p)[::-1])
    np.testing.assert_array_equal(
        np.asarray(out.draft.hidden_states).view(np.uint16),
        np.asarray(payload.hidden_states)[::-1].view(np.uint16),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"topk_p": jnp.ones((4, 2), jnp.float32)},
            "draft.topk_p has (4,) rows, indices have (2,)",
        ),
        (
            {"topk_index": jnp.ones((2, 2), jnp.float32)},
            "draft.topk_index must have an integer dtype, got float32",
        ),
        (
            {"topk_p": np.ones((2, 2), np.float64)},
            "draft.topk_p has dtype float64, declared float32",
        ),
        (
            {"topk_index": np.full((2, 2), 2**31, np.int64)},
            "draft.topk_index holds values that do not fit the int32 buffer",
        ),
        (
            {"topk_p": np.ones((3, 2), np.float32)},
            "draft.topk_p has (3,) rows, indices have (2,)",
        ),
        (
            {"bonus_tokens": np.array([3, -1])},
            "draft.bonus_tokens holds negative values [-1]",
        ),
    ],
)
def test_a_bad_draft_field_is_named(
    spec_host_map: fj.FutureMap, change: dict[str, Any], message: str
) -> None:
    """A draft field of the wrong rows or dtype is refused naming the field (draft.*),
    whether the slots are a jax array or host rows."""
    good = spec_draft([4, 9], k=2, h=3)._asdict()
    for slots in (i32(1, 2), np.array([1, 2])):  # jax slots, host slots
        with pytest.raises(fj.FutureMapError) as err:
            spec_host_map.stash(slots, fj.DraftPayload(**{**good, **change}))
        assert str(err.value).startswith(message), (type(slots), str(err.value))


def test_a_negative_length_refusal_lists_at_most_eight_values() -> None:
    """The refusal of negative lengths lists the distinct negative values, the first eight
    of them (sorted) when there are more."""
    fm = fj.FutureMap(16, batch_buckets=(16,), token_buckets=(16,))
    with pytest.raises(fj.FutureMapError) as err:
        fm.publish(np.arange(1, 11), np.array([-9, -8, -7, -6, -5, -4, -3, -2, -1, 4]))
    assert str(err.value).startswith(
        "new_seq_lens holds negative values [-9, -8, -7, -6, -5, -4, -3, -2]:"
    ), str(err.value)


def test_gather_pure_ops_judge_token_slots_by_the_batch_kind() -> None:
    """Gather protocol, mode known on the host: a MIXED batch takes its ids at its token
    slots (slot 0 keeps the host's id) and must have them; a DECODE batch must not (it
    gathers at its rows' slots). Both refusals are matched from their first word."""
    st = GATHER.stash(GATHER.init(), i32(1, 2), i32(11, 22))
    _, out = GATHER.resolve(
        st, fj.Batch(MIXED, i32(1, 2), i32(5, 0, 0), i32(3, 4), token_slots=i32(0, 1, 2))
    )
    assert out.input_ids.tolist() == [5, 11, 22]
    with pytest.raises(fj.FutureMapError, match=r"^a MIXED batch in the gather protocol needs"):
        _gather_mixed(token_slots=None)
    with pytest.raises(fj.FutureMapError, match=r"^token_slots given for a DECODE batch"):
        _gather_mixed(forward_mode=DECODE)


def test_debug_names_a_token_slot_outside_the_pool() -> None:
    """Debug, gather protocol: a token slot outside [0, R) is reported naming token_slots
    and the slot."""
    ops = fj.future_map(R, protocol="gather", debug=True)
    err, _ = checked(lambda st, b: ops.resolve(st, b))(
        ops.init(),
        fj.Batch(MIXED, i32(1, 2), i32(5, 0, 0), i32(3, 4), token_slots=i32(0, 1, R + 3)),
    )
    assert f"] token_slots holds slot {R + 3} outside [0, {R})" in str(violation(err))


def test_gather_decode_padding_rows_get_id_zero_whatever_slot_zero_holds() -> None:
    """Gather protocol, DECODE: a row's id is the token stashed at its slot (slot 1
    included); a padding row (slot 0) gets 0, not what a padded stash left in slot 0."""
    st = GATHER.stash(GATHER.init(), i32(0, 1, 2), i32(77, 11, 22))
    for mode in (DECODE, jnp.asarray(np.int32(DECODE))):
        _, out = GATHER.resolve(st, fj.Batch(mode, i32(2, 1, 0), i32(0, 0, 0), i32(3, 4, 5)))
        assert out.input_ids.tolist() == [22, 11, 0]


GATHER_SPEC = fj.future_map(R, spec=fj.SpecConfig(topk=2), protocol="gather")


@pytest.mark.parametrize("traced", [False, True])
def test_gather_spec_lengths_are_gathered_for_decode_only(traced: bool) -> None:
    """Gather protocol, spec map: a DECODE batch's lengths are the ones published at its
    draft slots; a batch of another kind with draft slots (a rank prefilling beside a spec
    decoding one) keeps the host's lengths."""
    st = GATHER_SPEC.publish(GATHER_SPEC.init(), i32(1, 2), i32(40, 50))
    st = GATHER_SPEC.stash(st, i32(1, 2), spec_draft([4, 5], k=2))
    for kind, want in ((DECODE, [50, 40]), (EXTEND, [7, 8])):
        mode = jnp.asarray(np.int32(kind)) if traced else kind
        b = fj.Batch(mode, i32(2, 1), i32(0, 0), i32(7, 8), draft_indices=i32(2, 1))
        _, out = GATHER_SPEC.resolve(st, b)
        assert out.seq_lens.tolist() == want, kind


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(draft_indices=wide(1, 2)), r"^draft_indices must be 1-D"),
        (dict(draft_indices=i32(1)), r"^draft_indices has 1 rows, indices have 2"),
    ],
)
def test_gather_spec_refuses_bad_draft_indices_by_name(change: dict, message: str) -> None:
    """Gather protocol, spec map: draft indices of the wrong rank or row count are refused
    when traced, naming draft_indices."""
    b = fj.Batch(DECODE, i32(2, 1), i32(0, 0), i32(7, 8), draft_indices=i32(2, 1))
    with pytest.raises(fj.FutureMapError, match=message):
        GATHER_SPEC.resolve(GATHER_SPEC.init(), b._replace(**change))


def test_debug_gather_names_a_draft_slot_outside_the_pool() -> None:
    """Debug, gather protocol, spec map: a draft slot outside [0, R) is reported naming
    draft_indices and the slot."""
    ops = fj.future_map(R, spec=fj.SpecConfig(topk=2), protocol="gather", debug=True)
    b = fj.Batch(DECODE, i32(2, 1), i32(0, 0), i32(7, 8), draft_indices=i32(2, R + 1))
    err, _ = checked(lambda st, b: ops.resolve(st, b))(ops.init(), b)
    assert f"] draft_indices holds slot {R + 1} outside [0, {R})" in str(violation(err))


def test_gather_invalidate_is_refused_with_its_whole_message() -> None:
    """The gather protocol has no invalidate: refused, saying why, message whole."""
    with pytest.raises(fj.FutureMapError, match=r"^invalidate: the gather protocol leaves no"):
        GATHER.invalidate(fj.Batch(DECODE, i32(1), i32(0), i32(3)), i32(1))


def test_debug_gather_poisons_exactly_the_live_slots_a_traced_mode_reads() -> None:
    """Debug, gather protocol, mode traced (both gathers run, each row selects): -1 is
    written at the live slots of the reads the batch's kind does, and nowhere else: not
    at slot 0 (padding), not at a slot the other kind's gather read. A token slot on a
    batch that is not MIXED is not read, so not consume-checked (slot 4, never stashed,
    holds -1): it is reported as a batch-fields violation instead."""
    ops = fj.future_map(R, protocol="gather", debug=True)
    resolve = checked(lambda st, b: ops.resolve(st, b))
    st = ops.stash(ops.init(), i32(0, 1, 2, 3), i32(77, 11, 22, 33))
    decode = jnp.asarray(np.int32(DECODE))
    mixed = jnp.asarray(np.int32(MIXED))
    err, (after, out) = resolve(
        st, fj.Batch(decode, i32(1, 0), i32(0, 0), i32(3, 4), token_slots=i32(0, 0))
    )
    fj.raise_if_violated(err)
    assert out.input_ids.tolist() == [11, 0]
    assert np.asarray(after.output_tokens)[:4].tolist() == [77, -1, 22, 33]
    err, (after, out) = resolve(
        st, fj.Batch(mixed, i32(1, 2), i32(5, 0), i32(3, 4), token_slots=i32(0, 3))
    )
    fj.raise_if_violated(err)
    assert out.input_ids.tolist() == [5, 33]
    assert np.asarray(after.output_tokens)[:4].tolist() == [77, 11, 22, -1]
    err, (after, _) = resolve(
        st, fj.Batch(decode, i32(1, 2), i32(0, 0), i32(3, 4), token_slots=i32(0, 4))
    )
    with pytest.raises(fj.InvariantViolation, match=r"\[batch fields\] token_slots name slot 4"):
        fj.raise_if_violated(err)
    assert np.asarray(after.output_tokens)[:5].tolist() == [77, -1, -1, 33, -1]


def test_debug_gather_spec_batch_poisons_its_token_slots_beside_its_draft() -> None:
    """Debug, gather protocol, spec map: a batch that reads both token slots and a draft
    consume-tracks both reads of the bonus tokens: the draft's slots and the token slot
    read are all written -1."""
    ops = fj.future_map(R, spec=fj.SpecConfig(topk=2), protocol="gather", debug=True)
    st = ops.publish(ops.init(), i32(1, 2, 3), i32(4, 5, 6))
    st = ops.stash(st, i32(1, 2, 3), spec_draft([11, 22, 33], k=2))
    b = fj.Batch(
        MIXED, i32(1, 3), i32(5, 0), i32(3, 4), token_slots=i32(0, 3), draft_indices=i32(1, 2)
    )  # a spec MIXED batch: its running row (slot 3) last
    err, (after, out) = checked(lambda st, b: ops.resolve(st, b))(st, b)
    fj.raise_if_violated(err)
    assert out.input_ids.tolist() == [5, 33]
    assert np.asarray(after.output_tokens)[1:4].tolist() == [-1, -1, -1]
