"""Bad host-side input to fm_jax gets a FutureMapError before anything is written.

Each case snapshots every buffer's bytes, makes the bad call, and checks that the error
names what was wrong, that no buffer was donated away and that no byte changed.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fm_jax as fj

R = 6
DECODE = fj.ForwardMode.DECODE
SPEC = fj.SpecConfig(topk=2, hidden=3, hidden_dtype=jnp.dtype(jnp.bfloat16))


@pytest.fixture(scope="module")
def plain() -> fj.FutureMap:
    fm = fj.FutureMap(R, batch_buckets=(2,), token_buckets=(2, 4))
    fm.publish(np.array([1, 2]), np.array([5, 6]))
    fm.stash(np.array([1, 2]), np.array([7, 8]))
    return fm


@pytest.fixture(scope="module")
def spec() -> fj.FutureMap:
    fm = fj.FutureMap(R, spec=SPEC, batch_buckets=(2,), token_buckets=(2,))
    fm.stash(np.array([1, 2]), draft(2))
    return fm


def draft(rows: int, **changes: object) -> fj.DraftPayload:
    d = fj.DraftPayload(
        np.arange(rows, dtype=np.int32),
        np.full((rows, SPEC.topk), 0.5, np.float32),
        np.ones((rows, SPEC.topk), np.int32),
        np.ones((rows, SPEC.hidden), jnp.bfloat16),
    )
    return d._replace(**changes)


def dev(*xs: int, dtype: object = np.int32) -> jax.Array:
    return jax.device_put(np.array(xs, dtype), jax.devices()[0])


def assert_rejected(fm: fj.FutureMap, call: Callable[[], object], match: str) -> None:
    """`call` raises FutureMapError matching `match`; the buffers are intact."""
    before = {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}
    state = fm.state
    with pytest.raises(fj.FutureMapError, match=match):
        call()
    assert fm.state is state
    assert not any(b.is_deleted() for b in fm.buffers().values())
    assert {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()} == before


def batch(idx, ids, lens, draft_idx=None, mode=DECODE) -> fj.Batch:  # noqa: ANN001
    return fj.Batch(mode, idx, ids, lens, draft_idx)


PLAIN_CASES = {
    "float_indices": (lambda fm: fm.publish(np.array([1.0]), np.array([3])), "integer dtype"),
    "2d_indices": (lambda fm: fm.publish(np.array([[1]]), np.array([3])), "1-D"),
    "lens_rows": (lambda fm: fm.publish(np.array([1, 2]), np.array([3])), "rows"),
    "float_lens": (lambda fm: fm.publish(np.array([1]), np.array([3.0])), "integer dtype"),
    "slot_too_big": (lambda fm: fm.publish(np.array([R]), np.array([3])), r"outside \[0, 6\)"),
    "negative_slot": (lambda fm: fm.stash(np.array([-1]), np.array([3])), r"outside \[0, 6\)"),
    "duplicate_live": (lambda fm: fm.stash(np.array([3, 3]), np.array([1, 2])), "more than once"),
    "len_not_int32": (
        lambda fm: fm.publish(np.array([1]), np.array([2**31], np.int64)),
        "do not fit",
    ),
    "token_not_int32": (
        lambda fm: fm.stash(np.array([1]), np.array([-(2**31) - 1], np.int64)),
        "do not fit",
    ),
    "tokens_rows": (lambda fm: fm.stash(np.array([1]), np.array([1, 2])), "rows"),
    "draft_on_plain": (lambda fm: fm.stash(np.array([1]), draft(1)), "without spec"),
    "jax_not_a_bucket": (lambda fm: fm.publish(dev(1, 2, 3), dev(1, 2, 3)), "not a bucket"),
    "jax_float_indices": (lambda fm: fm.stash(dev(1, 2, dtype=np.float32), dev(1, 2)), "integer"),
    "jax_float_tokens": (
        lambda fm: fm.stash(dev(1, 2), dev(1, 2, dtype=np.float32)),
        "integer dtype",
    ),
    "jax_payload_rows": (lambda fm: fm.stash(dev(1, 2), dev(1, 2, 3, 4)), "rows"),
    "too_many_rows": (lambda fm: fm.publish(np.array([1, 2, 3]), np.array([1, 1, 1])), "exceeds"),
    "too_many_tokens": (
        lambda fm: fm.resolve(batch(np.array([1]), np.arange(5), np.array([5]))),
        "exceeds",
    ),
    "ids_2d": (lambda fm: fm.resolve(batch(np.array([1]), np.ones((1, 1), int), [1])), "1-D"),
    "seq_lens_rows": (lambda fm: fm.resolve(batch(np.array([1]), [-1], [1, 2])), "rows"),
    "sentinel_range": (lambda fm: fm.resolve(batch(np.array([1]), [-R], [-1])), "sentinel"),
    "resolve_slot_range": (lambda fm: fm.resolve(batch(np.array([R]), [1], [1])), "outside"),
    "draft_indices_plain": (
        lambda fm: fm.resolve(batch(np.array([1]), [-1], [-1], np.array([1]))),
        "without spec",
    ),
    "invalidate_range": (lambda fm: fm.invalidate(batch([1], [1], [1]), np.array([R])), "outside"),
    # A host mode is a ForwardMode: int() would make DECODE of 1.7, True and "1".
    "mode_float": (lambda fm: fm.resolve(batch([1], [-1], [-1], mode=1.7)), "ForwardMode"),
    "mode_bool": (lambda fm: fm.resolve(batch([1], [-1], [-1], mode=True)), "ForwardMode"),
    "mode_str": (lambda fm: fm.resolve(batch([1], [-1], [-1], mode="1")), "ForwardMode"),
    "mode_unknown": (lambda fm: fm.resolve(batch([1], [-1], [-1], mode=7)), "ForwardMode"),
    "mode_traced_float": (
        lambda fm: fm.resolve(batch([1], [-1], [-1], mode=jnp.float32(1))),
        "int32",
    ),
    "object_tokens": (lambda fm: fm.stash(np.array([1]), np.array([None])), "not a numeric array"),
    "rank_key_bool": (lambda fm: fm.stash({True: np.array([1])}, {True: [1]}), "DP rank"),
    "rank_key_float": (lambda fm: fm.stash({1.0: np.array([1])}, {1.0: [1]}), "DP rank"),
    "foreign_rank": (lambda fm: fm.stash({1: np.array([1])}, {1: [1]}), "DP rank 1"),
    "rows_not_a_bucket": (lambda fm: fm.publish(np.array([1]), np.array([3]), rows=3), "bucket"),
}


@pytest.mark.parametrize("case", PLAIN_CASES)
def test_plain_map_rejects_bad_input(plain: fj.FutureMap, case: str) -> None:
    """Each malformed non-spec input must raise a FutureMapError naming the problem and
    leave every buffer byte (and the undonated state) as it was."""
    call, match = PLAIN_CASES[case]
    assert_rejected(plain, lambda: call(plain), match)


SPEC_CASES = {
    "tokens_on_spec": (lambda fm: fm.stash(np.array([1]), np.array([3])), "DraftPayload"),
    "wrong_k": (
        lambda fm: fm.stash(np.array([1]), draft(1, topk_p=np.zeros((1, 3), np.float32))),
        r"topk_p must have shape \(2, 2\)",
    ),
    "topk_p_f64": (
        lambda fm: fm.stash(np.array([1]), draft(1, topk_p=np.zeros((1, 2)))),
        "topk_p has dtype float64",
    ),
    "topk_index_float": (
        lambda fm: fm.stash(np.array([1]), draft(1, topk_index=np.zeros((1, 2), np.float32))),
        "integer dtype",
    ),
    "hidden_dtype": (
        lambda fm: fm.stash(np.array([1]), draft(1, hidden_states=np.zeros((1, 3), np.float32))),
        "hidden_states has dtype float32, declared bfloat16",
    ),
    "hidden_width": (
        lambda fm: fm.stash(np.array([1]), draft(1, hidden_states=np.zeros((1, 4), jnp.bfloat16))),
        r"hidden_states must have shape \(2, 3\)",
    ),
    "bonus_missing": (
        lambda fm: fm.stash(np.array([1]), draft(1, bonus_tokens=None)),
        "bonus_tokens is missing: a consume-tracked field",
    ),
    "topk_half": (
        lambda fm: fm.stash(np.array([1]), draft(1, topk_p=None)),
        "topk_index given without draft.topk_p",
    ),
    "bonus_rows": (
        lambda fm: fm.stash(np.array([1]), draft(1, bonus_tokens=np.array([1, 2], np.int32))),
        "rows",
    ),
    "draft_slot_range": (
        lambda fm: fm.resolve(batch(np.array([1]), [-1], [-1], np.array([R]))),
        "outside",
    ),
}


@pytest.mark.parametrize("case", SPEC_CASES)
def test_spec_map_rejects_bad_draft(spec: fj.FutureMap, case: str) -> None:
    """A draft payload that does not match the declared SpecConfig (K, H, dtypes) must
    raise a FutureMapError before anything is written."""
    call, match = SPEC_CASES[case]
    assert_rejected(spec, lambda: call(spec), match)


def test_hidden_given_when_spec_declares_none() -> None:
    """hidden_states on a map whose spec declares hidden=0 must be refused."""
    fm = fj.FutureMap(R, spec=SPEC._replace(hidden=0), batch_buckets=(2,), token_buckets=(2,))
    assert_rejected(fm, lambda: fm.stash(np.array([1]), draft(1)), "hidden=0")


def test_padding_slot_may_repeat(plain: fj.FutureMap) -> None:
    """Slot 0 twice (padding rows) is valid input, not a duplicate live slot."""
    plain.stash(np.array([0, 0]), np.array([1, 2]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pool_size": 1}, "pool_size"),
        ({"pool_size": 4, "spec": fj.SpecConfig(topk=-1)}, "topk"),
        ({"pool_size": 4, "spec": fj.SpecConfig(topk=0, bonus_tokens=False)}, "no field"),
        ({"pool_size": 4, "spec": fj.SpecConfig(2, 3, jnp.dtype(jnp.int8))}, "hidden_dtype"),
    ],
)
def test_bad_configuration(kwargs: dict, match: str) -> None:
    """A bad pool size or SpecConfig must be refused when the ops are built."""
    with pytest.raises(fj.FutureMapError, match=match):
        fj.future_map(**kwargs)


def test_pure_ops_check_structure_when_traced() -> None:
    """The pure ops must refuse wrong rank, row count and payload shape at trace time,
    jitted or not."""
    ops = fj.future_map(R, spec=SPEC)
    st = ops.init()
    idx = jnp.array([1, 2], jnp.int32)
    for fn in (ops.publish, jax.jit(ops.publish)):
        with pytest.raises(fj.FutureMapError, match="1-D"):
            fn(st, idx[None], idx[None])
        with pytest.raises(fj.FutureMapError, match="rows"):
            fn(st, idx, idx[:1])
    bad = fj.DraftPayload(
        idx,
        jnp.zeros((2, 5), jnp.float32),
        jnp.zeros((2, 2), jnp.int32),
        jnp.zeros((2, 3), jnp.bfloat16),
    )
    for fn in (ops.stash, jax.jit(ops.stash)):
        with pytest.raises(fj.FutureMapError, match="topk_p must have shape"):
            fn(st, idx, bad)


def test_a_declared_int_field_takes_jax_rows_only_in_a_dtype_it_holds() -> None:
    """A spec field declared int16 (an engine's extra) given jax rows: an int dtype whose
    every value fits (int8) is stored; int32, which would need a value check, and a float
    are refused naming the field and the dtypes, and nothing is written."""
    spec = fj.SpecConfig(topk=0, hidden=0, extra=(fj.RelayField("e", (), np.int16),))
    fm = fj.FutureMap(8, spec=spec, batch_buckets=(2,), token_buckets=(2,))
    slots = jnp.array([1, 2], jnp.int32)

    def draft_with(e: jax.Array) -> fj.DraftPayload:
        return fj.DraftPayload(jnp.array([3, 4], jnp.int32), extras={"e": e})

    fm.stash(slots, draft_with(jnp.array([5, 6], jnp.int8)))
    stored = np.asarray(fm.buffers()["extras"]["e"])
    assert stored.dtype == np.int16 and stored[1:3].tolist() == [5, 6]
    for e, message in (
        (jnp.array([7, 8], jnp.int32), "draft.e has dtype int32, which the map's int16 buffers"),
        (jnp.array([7, 8], jnp.float32), "draft.e must have an integer dtype, got float32"),
    ):
        with pytest.raises(fj.FutureMapError, match=message):
            fm.stash(slots, draft_with(e))
        np.testing.assert_array_equal(np.asarray(fm.buffers()["extras"]["e"]), stored)


def test_jax_slots_and_lengths_come_only_in_a_dtype_the_buffers_hold() -> None:
    """A device array's values are not read on the host: uint32 slots or lengths (which an
    int32 buffer holds only after a value check) are refused naming the field, and nothing
    is written; int16 ones are taken."""
    fm = fj.FutureMap(8, batch_buckets=(2,), token_buckets=(2,))
    before = np.asarray(fm.buffers()["new_seq_lens"]).copy()
    u32 = jnp.array([1, 2], jnp.uint32)
    i32 = jnp.array([1, 2], jnp.int32)
    for call, name in (
        (lambda: fm.publish(u32, i32), "indices"),
        (lambda: fm.publish(i32, u32), "new_seq_lens"),
    ):
        with pytest.raises(fj.FutureMapError, match=f"^{name} has dtype uint32, which the map's "):
            call()
        np.testing.assert_array_equal(np.asarray(fm.buffers()["new_seq_lens"]), before)
    fm.publish(i32, jnp.array([5, 6], jnp.int16))
    assert np.asarray(fm.buffers()["new_seq_lens"])[1:3].tolist() == [5, 6]


def _recording_step(declared: list[fj.StepInput]) -> fj.EngineStep:
    """An engine step whose forward returns its declared inputs as placed (its `out`)."""
    fm = fj.FutureMap(8, batch_buckets=(2,), token_buckets=(2,))

    def forward(res: fj.Resolved, batch: fj.Batch, inputs: dict[str, jax.Array]) -> fj.StepOutput:
        return fj.StepOutput(res.seq_lens + 1, res.input_ids[: res.seq_lens.shape[0]], inputs)

    return fm.engine_step(forward, inputs=declared)


def test_an_engine_step_input_is_cast_only_where_no_value_changes() -> None:
    """A float32 input of rows of shape (2,) given float16 rows is cast (numpy's safe
    cast: no value changes) and reaches the forward as float32; rows of another shape are
    refused naming both shapes."""
    step = _recording_step([fj.StepInput("t", "row", (2,), np.float32)])
    batch = fj.Batch(fj.ForwardMode.EXTEND, np.array([1, 2]), np.array([3, 4]), np.array([1, 1]))
    out = step(batch, inputs={"t": np.full((2, 2), 1.5, np.float16)}).out
    assert out["t"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out["t"]), np.full((2, 2), 1.5, np.float32))
    with pytest.raises(
        fj.FutureMapError,
        match=r"inputs\['t'\] has rows of shape \[3\], declared rows of shape \[2\]",
    ):
        step(batch, inputs={"t": np.ones((2, 3), np.float32)})


def test_an_idle_step_pads_a_declared_int_input_in_its_declared_dtype() -> None:
    """Every rank idle (an empty mapping of ranks): a declared int16 input given for no
    rank is all padding, zeros in int16, as a rank's own rows would be padded."""
    step = _recording_step([fj.StepInput("k", "row", (), np.int16)])
    out = step({}, inputs={"k": {}}).out
    assert out["k"].dtype == jnp.int16
    np.testing.assert_array_equal(np.asarray(out["k"]), [0, 0])


def test_a_declared_int16_field_takes_host_ints_that_fit_and_refuses_the_rest() -> None:
    """An engine's int16 field given host int32 rows: values that fit int16 are cast and
    stored, a value that does not (40000) is refused naming the int16 buffer, and nothing
    is written. Three times, so that the layout's recorded plan judges it too."""
    spec = fj.SpecConfig(topk=0, hidden=0, extra=(fj.RelayField("e", (), np.int16),))
    fm = fj.FutureMap(8, spec=spec, batch_buckets=(2,), token_buckets=(2,))
    slots = np.array([1, 2], np.int32)

    def draft_with(e: list[int]) -> fj.DraftPayload:
        return fj.DraftPayload(np.array([3, 4], np.int32), extras={"e": np.array(e, np.int32)})

    for _ in range(3):  # the general path, the call that records the plan, the plan
        fm.stash(slots, draft_with([-5, 30000]))
        stored = np.asarray(fm.buffers()["extras"]["e"])
        assert stored.dtype == np.int16 and stored[1:3].tolist() == [-5, 30000]
        with pytest.raises(
            fj.FutureMapError, match="draft.e holds values that do not fit the int16"
        ):
            fm.stash(slots, draft_with([1, 40000]))
        np.testing.assert_array_equal(np.asarray(fm.buffers()["extras"]["e"]), stored)


def test_a_float_field_relays_negative_values() -> None:
    """Only tokens and lengths (and consume-tracked ints) must be >= 0: an engine's float
    field keeps the negative values it is given, on the general path and on the plan its
    layout recorded from non-negative rows."""
    spec = fj.SpecConfig(topk=0, hidden=0, extra=(fj.RelayField("h", (2,), np.float32),))
    fm = fj.FutureMap(8, spec=spec, batch_buckets=(2,), token_buckets=(2,))
    positive = np.array([[1.5, 2.0], [0.0, 3.25]], np.float32)
    negative = np.array([[-1.5, 2.0], [-0.0, -3.25]], np.float32)
    for h in (negative, positive, positive, negative):  # general, general + record, plan
        fm.stash(np.array([1, 2]), fj.DraftPayload(np.array([3, 4]), extras={"h": h}))
        stored = np.asarray(fm.buffers()["extras"]["h"])[1:3]
        assert stored.tobytes() == h.tobytes()


def test_a_spec_decode_batch_passes_its_ids_through_however_many() -> None:
    """A spec DECODE batch's ids pass through as given (CONTRACT, 'Batch kinds'): more ids
    than rows, or fewer, are no refusal; only a non-spec decode row carries one id."""
    fm = fj.FutureMap(16, spec=fj.SpecConfig(topk=2), batch_buckets=(2,), token_buckets=(2, 4))
    slots = np.array([1, 2], np.int32)
    draft = fj.DraftPayload(
        np.array([3, 4]), np.ones((2, 2), np.float32), np.zeros((2, 2), np.int32)
    )
    fm.stash(slots, draft)
    fm.publish(slots, np.array([5, 6], np.int32))
    for ids in ([7, 8, 9, 10], [7]):
        res = fm.resolve(fj.Batch(DECODE, slots, np.array(ids, np.int32), -slots, slots))
        assert np.asarray(res.input_ids)[: len(ids)].tolist() == ids
