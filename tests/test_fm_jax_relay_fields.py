"""Relay fields declared, not hard-coded (docs/CONTRACT.md, 'Relay fields'): a spec map
relays what its SpecConfig declares (verified ids, an engine's own fields), stash, resolve
and the debug consume check follow the declaration, and a field given but not declared, or
declared but not given, is refused."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import fm_jax as fj

R = 8
D = fj.ForwardMode.DECODE
SCORE = fj.RelayField("score", (2,), np.float16, bits=True)  # an engine's own float rows
STEPS = fj.RelayField("steps", consumed=True)  # an engine's own consume-tracked int
SPEC = fj.SpecConfig(topk=2, verified_id=True, extra=(SCORE, STEPS))


def a(*x: int) -> np.ndarray:
    return np.array(x, np.int32)


def draft(bonus: list[int], vid: list[int], steps: list[int], score: np.ndarray) -> Any:
    n = len(bonus)
    return fj.DraftPayload(
        a(*bonus),
        np.full((n, 2), 0.5, np.float32),
        np.zeros((n, 2), np.int32),
        verified_id=a(*vid),
        extras={"score": score, "steps": a(*steps)},
    )


SCORES = np.array([[np.nan, -0.0], [1.5, np.inf]], np.float16)


def bits(x: Any) -> bytes:
    return np.asarray(x).tobytes()


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_declared_fields_are_stashed_and_gathered(protocol: str) -> None:
    """Verified ids and an engine's own fields go into their buffers at stash and come back
    at resolve, bit for bit (a NaN payload and -0.0 included), in either protocol."""
    fm = fj.FutureMap(R, spec=SPEC, protocol=protocol, debug=True)
    assert fm.state.verified_id is not None and fm.state.extras is not None
    assert sorted(fm.state.extras) == ["score", "steps"]
    assert fm.state.extras["score"].dtype == np.uint16  # a real float: its bits
    fm.publish(a(3, 5), a(4, 6))
    fm.stash(a(3, 5), draft([30, 50], [31, 51], [1, 2], SCORES))
    ids = a(0, 0) if protocol == "gather" else a(-3, -5)
    r = fm.resolve(fj.Batch(D, a(5, 3), ids, ids, draft_indices=a(5, 3)))
    assert r.draft is not None and r.draft.extras is not None
    assert np.asarray(r.draft.verified_id)[:2].tolist() == [51, 31]
    assert np.asarray(r.draft.extras["steps"])[:2].tolist() == [2, 1]
    assert bits(np.asarray(r.draft.extras["score"])[:2]) == bits(SCORES[::-1])
    assert r.draft.extras["score"].dtype == np.float16
    fm.check()


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
@pytest.mark.parametrize("field", ["verified_id", "steps"])
def test_every_consumed_field_is_poisoned_and_checked(field: str, protocol: str) -> None:
    """A consume-tracked declared field starts at -1 and is written -1 at the draft's slots
    after a resolve (a field not tracked, score, keeps its value); a read that finds -1 in
    that field alone (every other field restored) is reported. Both protocols."""
    ops = fj.future_map(R, spec=SPEC, debug=True, protocol=protocol)
    get = lambda st: st.verified_id if field == "verified_id" else st.extras["steps"]  # noqa: E731
    st = ops.init()
    assert np.asarray(get(st)).tolist() == [-1] * R
    st = ops.publish(st, a(3), a(4))
    st = ops.stash(
        st, a(3), jax.tree_util.tree_map(jnp.asarray, draft([30], [31], [7], SCORES[:1]))
    )
    ids = a(0) if protocol == "gather" else a(-3)
    b = fj.Batch(D, a(3), ids, ids, draft_indices=a(3))
    resolve = jax.jit(checkify.checkify(ops.resolve, errors=checkify.user_checks))
    err, (st, _) = resolve(st, b)
    err.throw()
    assert np.asarray(get(st))[3] == -1
    assert bits(np.asarray(st.extras["score"])[3]) == bits(SCORES[0].view(np.uint16))
    # Every consumed buffer but `field` written again at slot 3: only `field` reads -1.
    restored = st._replace(
        output_tokens=st.output_tokens.at[3].set(32), new_seq_lens=st.new_seq_lens.at[3].set(4)
    )
    if field == "verified_id":
        restored = restored._replace(extras={**st.extras, "steps": st.extras["steps"].at[3].set(8)})
    else:
        restored = restored._replace(verified_id=st.verified_id.at[3].set(33))
    err, _ = resolve(restored, b)
    with pytest.raises(checkify.JaxRuntimeError, match=r"consume \(WRWR\)\] slot 3"):
        err.throw()


def test_a_negative_consumed_value_is_refused_at_stash() -> None:
    """A consume-tracked field's stashed value must be >= 0 (a -1 would read as the
    poison): refused on the host, naming the field, nothing written."""
    fm = fj.FutureMap(R, spec=SPEC, debug=True)
    before = {k: bits(v) for k, v in jax.tree_util.tree_leaves_with_path(fm.state)}
    with pytest.raises(fj.FutureMapError, match="draft.verified_id"):
        fm.stash(a(3), draft([30], [-1], [1], SCORES[:1]))
    with pytest.raises(fj.FutureMapError, match="draft.steps"):
        fm.stash(a(3), draft([30], [1], [-4], SCORES[:1]))
    after = {k: bits(v) for k, v in jax.tree_util.tree_leaves_with_path(fm.state)}
    assert after == before


BAD_DRAFTS = {
    "verified id not declared": (
        fj.SpecConfig(topk=2),
        lambda d: d._replace(extras=None),
        "draft.verified_id given but spec does not declare it",
    ),
    "own field not declared": (
        fj.SpecConfig(topk=2, verified_id=True),
        lambda d: d,
        r"draft.extras\['score'\] is not a field the spec declares",
    ),
    "declared field missing": (SPEC, lambda d: d._replace(verified_id=None), "verified_id"),
    "own field missing": (SPEC, lambda d: d._replace(extras={"score": SCORES}), "draft.steps"),
    "own field of the wrong dtype": (
        SPEC,
        lambda d: d._replace(extras={"score": SCORES.astype(np.float32), "steps": a(1, 2)}),
        "draft.score",
    ),
    "own field of the wrong shape": (
        SPEC,
        lambda d: d._replace(extras={"score": SCORES[:, :1], "steps": a(1, 2)}),
        "draft.score",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_DRAFTS))
def test_a_draft_that_does_not_match_the_declaration_is_refused(case: str) -> None:
    """A field given but not declared is refused (never dropped silently), and so is a
    declared field missing or of the wrong shape or dtype: by the class and by the pure
    ops, with every buffer unchanged."""
    spec, change, message = BAD_DRAFTS[case]
    d = change(draft([30, 50], [31, 51], [1, 2], SCORES))
    fm = fj.FutureMap(R, spec=spec)
    before = [bits(x) for x in jax.tree_util.tree_leaves(fm.state)]
    with pytest.raises(fj.FutureMapError, match=message):
        fm.stash(a(3, 5), d)
    assert [bits(x) for x in jax.tree_util.tree_leaves(fm.state)] == before
    ops = fj.future_map(R, spec=spec)
    dev = jax.tree_util.tree_map(jnp.asarray, d)
    with pytest.raises(fj.FutureMapError, match=message):
        ops.stash(ops.init(), jnp.asarray(a(3, 5)), dev)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ((fj.RelayField("topk_p"),), "not a new identifier"),
        ((fj.RelayField("x"), fj.RelayField("x")), "not a new identifier"),
        ((fj.RelayField("x", (0,)),), "shape must hold ints >= 1"),
        ((fj.RelayField("x", dtype=np.float32, consumed=True),), "a consumed field is a signed"),
        ((fj.RelayField("x", dtype=np.int32, bits=True),), "bits=True stores a real float"),
        (("x",), "holds RelayFields"),
    ],
)
def test_a_bad_declaration_is_refused_when_the_map_is_built(extra: Any, message: str) -> None:
    """A field declaration that cannot be relayed is refused by name at build time."""
    with pytest.raises(fj.FutureMapError, match=message):
        fj.future_map(R, spec=fj.SpecConfig(topk=2, extra=extra))


def test_the_standard_configuration_is_one_declaration() -> None:
    """The EAGLE-style spec path is the declaration SpecConfig(topk, hidden) makes: bonus
    tokens and top-k, hidden states; its buffers are the ones the map had before fields were
    declared (no verified ids, no extras), the real floats' as their bits."""
    spec = fj.SpecConfig(topk=3, hidden=4)
    names = [(f.name, f.shape, f.consumed) for f in spec.fields()]
    assert names == [
        ("bonus_tokens", (), True),
        ("topk_p", (3,), False),
        ("topk_index", (3,), False),
        ("hidden_states", (4,), False),
    ]
    st = fj.future_map(R, spec=spec).init()
    assert st.verified_id is None and st.extras is None
    assert st.hidden_states is not None and st.hidden_states.dtype == np.uint16
    assert st.topk_p is not None and st.topk_p.dtype == np.uint32


def test_declared_fields_serve_from_warmed_executables() -> None:
    """warm_up plans the declared fields' payloads: a guarded spec loop with verified ids
    and an engine's fields runs without a compile, in the gather protocol."""
    fm = fj.FutureMap(R, spec=SPEC, protocol="gather", batch_buckets=(1, 2), token_buckets=(1, 2))
    fm.warm_up(guard=True)
    fm.publish(a(3, 5), a(4, 6))
    for n in range(3):
        fm.stash(a(3, 5), draft([30 + n, 50], [31, 51 + n], [1, 2], SCORES))
        r = fm.resolve(fj.Batch(D, a(3, 5), a(0, 0), a(0, 0), draft_indices=a(3, 5)))
    assert r.draft is not None and np.asarray(r.draft.verified_id).tolist() == [31, 53]


PATH = fj.RelayField("path", (3,), consumed=True)  # consume-tracked, several ints per row
PATH_SPEC = fj.SpecConfig(topk=2, extra=(PATH,))


def path_draft(paths: list[list[int]]) -> Any:
    n = len(paths)
    return fj.DraftPayload(
        jnp.asarray(a(*range(30, 30 + n))),
        jnp.full((n, 2), 0.5, jnp.float32),
        jnp.zeros((n, 2), jnp.int32),
        extras={"path": jnp.asarray(np.array(paths, np.int32))},
    )


def test_a_consumed_field_of_several_values_per_row_is_tracked_row_by_row() -> None:
    """A consume-tracked field with several ints per row: its buffer starts at -1 in every
    entry, a stashed row with one negative entry is refused naming that row's slot (a row
    reads as its smallest entry; the other row is clean), a resolve poisons whole rows at
    the slots read and gives the rows back in the order asked, and a read that finds one
    -1 entry in a row is reported for that row's slot."""
    ops = fj.future_map(R, spec=PATH_SPEC, debug=True)
    stash = jax.jit(checkify.checkify(ops.stash, errors=checkify.user_checks))
    resolve = jax.jit(checkify.checkify(ops.resolve, errors=checkify.user_checks))
    st = ops.init()
    assert st.extras is not None and st.extras["path"].shape == (R, 3)
    assert (np.asarray(st.extras["path"]) == -1).all()
    st = ops.publish(st, jnp.asarray(a(3, 5)), jnp.asarray(a(4, 6)))
    err, _ = stash(st, jnp.asarray(a(3, 5)), path_draft([[1, -1, 3], [4, 5, 6]]))
    with pytest.raises(
        checkify.JaxRuntimeError, match=r"draft.path holds a negative value for slot 3"
    ):
        err.throw()
    err, st = stash(st, jnp.asarray(a(3, 5, 6)), path_draft([[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
    err.throw()
    b = fj.Batch(D, a(5, 3), a(-5, -3), a(-5, -3), draft_indices=a(5, 3))
    err, (after, r) = resolve(st, b)
    err.throw()
    assert r.draft is not None and r.draft.extras is not None
    assert np.asarray(r.draft.extras["path"]).tolist() == [[4, 5, 6], [1, 2, 3]]
    path = np.asarray(after.extras["path"])
    assert path[[3, 5]].tolist() == [[-1, -1, -1]] * 2 and path[6].tolist() == [7, 8, 9]
    # Everything read restored but one entry of slot 3's path: that row reads as -1.
    restored = after._replace(
        output_tokens=after.output_tokens.at[jnp.asarray(a(3, 5))].set(1),
        new_seq_lens=after.new_seq_lens.at[jnp.asarray(a(3, 5))].set(4),  # consumed: again
        extras={"path": after.extras["path"].at[3].set(a(7, -1, 9)).at[5].set(a(1, 1, 1))},
    )
    err, _ = resolve(restored, b)
    with pytest.raises(checkify.JaxRuntimeError, match=r"consume \(WRWR\)\] slot 3"):
        err.throw()


@pytest.mark.parametrize("debug", [False, True])
def test_init_fills_only_consumed_fields_with_the_poison_and_only_in_debug(debug: bool) -> None:
    """A new spec map's buffers: the consume-tracked ones (bonus tokens, verified ids, an
    engine's consumed field) and the lengths hold -1 in debug mode and 0 otherwise; every
    other field holds 0 (bits included) in both modes."""
    st = fj.future_map(R, spec=SPEC, debug=debug).init()
    poison = -1 if debug else 0
    assert st.verified_id is not None and st.extras is not None
    for name, buf in [
        ("output_tokens", st.output_tokens),
        ("new_seq_lens", st.new_seq_lens),
        ("verified_id", st.verified_id),
        ("steps", st.extras["steps"]),
    ]:
        assert (np.asarray(buf) == poison).all(), name
    for name, buf in [
        ("topk_p", st.topk_p),
        ("topk_index", st.topk_index),
        ("score", st.extras["score"]),
    ]:
        assert (np.asarray(buf) == 0).all(), name


def test_the_ops_hold_one_canonical_spec_however_it_was_written() -> None:
    """A SpecConfig written with a dtype name or class and a truthy int for verified_id
    becomes the same spec (np.dtype, bool): equal, of equal hash, so two maps declared the
    same way share what is keyed on their spec."""
    one = fj.future_map(
        R, spec=fj.SpecConfig(topk=2, hidden=4, hidden_dtype="bfloat16", verified_id=1)
    )
    two = fj.future_map(
        R, spec=fj.SpecConfig(topk=2, hidden=4, hidden_dtype=jnp.bfloat16, verified_id=True)
    )
    assert one.spec is not None and two.spec is not None
    assert one.spec == two.spec and hash(one.spec) == hash(two.spec)
    assert isinstance(one.spec.hidden_dtype, np.dtype) and one.spec.verified_id is True


def test_a_scalar_field_of_its_own_dtype_is_relayed_and_a_missing_bonus_is_named() -> None:
    """An engine's field of one float per row (its own dtype, not the map's int) is checked
    as an array of that dtype, stashed and gathered bit for bit; a draft without its bonus
    tokens is refused naming them."""
    conf = fj.RelayField("conf", (), np.float32)
    ops = fj.future_map(R, spec=fj.SpecConfig(topk=2, extra=(conf,)))
    vals = np.array([np.nan, -0.0], np.float32)
    d = fj.DraftPayload(
        jnp.asarray(a(30, 50)),
        jnp.full((2, 2), 0.5, jnp.float32),
        jnp.zeros((2, 2), jnp.int32),
        extras={"conf": jnp.asarray(vals)},
    )
    st = ops.stash(ops.init(), jnp.asarray(a(3, 5)), d)
    _, r = ops.resolve(st, fj.Batch(D, a(5, 3), a(-5, -3), a(-5, -3), draft_indices=a(5, 3)))
    assert r.draft is not None and r.draft.extras is not None
    assert bits(r.draft.extras["conf"]) == bits(vals[::-1])
    with pytest.raises(fj.FutureMapError, match="draft.bonus_tokens is missing"):
        ops.stash(ops.init(), jnp.asarray(a(3, 5)), d._replace(bonus_tokens=None))


def test_a_declared_bf16_field_with_bits_relays_its_bytes() -> None:
    """Defect (reliability round two, 5): `bits=True` was refused for bfloat16 (numpy
    reports its kind as 'V'), so no engine-declared bf16 field could be bit-exact: XLA:CPU
    canonicalises NaN payloads of a bf16 scatter. Declared with bits, the rows resolve with
    their bytes: a NaN payload and -0.0 included."""
    field = fj.RelayField("h", (3,), jnp.bfloat16, bits=True)
    fm = fj.FutureMap(R, spec=fj.SpecConfig(topk=1, extra=(field,)), batch_buckets=(2,))
    rows = np.asarray(jnp.asarray([[1.0, -0.0, 2.0], [3.0, 4.0, 5.0]], jnp.bfloat16)).copy()
    rows.view(np.uint16)[0, 2] = 0x7FC1  # a NaN with a payload
    payload = fj.DraftPayload(
        a(1, 2), np.ones((2, 1), np.float32), np.ones((2, 1), np.int32), extras={"h": rows}
    )
    fm.stash(a(3, 5), payload)
    fm.publish(a(3, 5), a(2, 2))
    res = fm.resolve(fj.Batch(D, a(3, 5), a(-3, -5), a(-3, -5), draft_indices=a(3, 5)))
    assert res.draft is not None and res.draft.extras is not None
    assert np.asarray(res.draft.extras["h"])[:2].tobytes() == rows.tobytes()


def test_a_field_the_map_could_never_store_is_refused_when_declared() -> None:
    """Defect (reliability round two): a 64-bit field without x64 was accepted and then
    refused every stash. Declarations no stash could serve (a 64-bit dtype without x64, an
    object or string dtype, bits on an int) are refused when the map is built."""
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on: a 64-bit field is servable")
    for bad in (
        fj.RelayField("d", (), np.float64),
        fj.RelayField("n", (2,), np.int64),
        fj.RelayField("o", (), object),
        fj.RelayField("s", (), np.str_),
        fj.RelayField("i", (), np.int32, bits=True),
    ):
        with pytest.raises(fj.FutureMapError, match=f"spec.extra\\[{bad.name}\\]"):
            fj.FutureMap(R, spec=fj.SpecConfig(topk=1, extra=(bad,)))


NGRAM = fj.SpecConfig(
    topk=0,
    bonus_tokens=False,
    extra=(fj.RelayField("accept_tokens", (3,)), fj.RelayField("accept_lens")),
)
"""SGLang's n-gram payload: no bonus token, no top-k; accepted tokens and accept length."""


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_an_ngram_payload_relays_only_its_own_fields(protocol: str, debug: bool) -> None:
    """A spec declaring no bonus token and no top-k (SGLang's n-gram payload) keeps no
    buffer for them, relays its accepted tokens and lengths, and a slot never stashed
    resolves to accept length 0 (its buffers start at 0, debug or not: nothing there is
    consume-tracked, so debug reports nothing)."""
    fm = fj.FutureMap(R, spec=NGRAM, protocol=protocol, debug=debug)
    st = fm.state
    assert st.topk_p is None and st.topk_index is None and st.verified_id is None
    assert [f.name for f in NGRAM.fields()] == ["accept_tokens", "accept_lens"]
    fm.publish(a(3, 5, 6), a(4, 6, 2))
    toks = np.array([[11, 12, 0], [13, 0, 0]], np.int32)
    fm.stash(a(3, 5), fj.DraftPayload(extras={"accept_tokens": toks, "accept_lens": a(2, 1)}))
    ids = a(0, 0, 0) if protocol == "gather" else a(-5, -3, -6)
    for _ in range(2):  # nothing is consumed: a second read gives the same
        fm.publish(a(3, 5, 6), a(4, 6, 2))  # (debug consumes the lengths a read takes)
        r = fm.resolve(fj.Batch(D, a(5, 3, 6), ids, ids, draft_indices=a(5, 3, 6)))
        assert r.draft is not None and r.draft.extras is not None
        assert r.draft.bonus_tokens is None and r.draft.topk_p is None
        assert np.asarray(r.draft.extras["accept_lens"])[:3].tolist() == [1, 2, 0]
        got = np.asarray(r.draft.extras["accept_tokens"])[:3]
        assert got.tolist() == [[13, 0, 0], [11, 12, 0], [0, 0, 0]]
        assert np.asarray(r.seq_lens)[:3].tolist() == [6, 4, 2]
    fm.check()


def test_an_ngram_map_refuses_the_fields_it_does_not_declare() -> None:
    """A bonus token or top-k given to a map that does not declare them is refused by
    name, before anything is written; a spec that declares nothing is refused when built."""
    fm = fj.FutureMap(R, spec=NGRAM)
    before = jax.tree.map(np.asarray, fm.state)
    own = {"accept_tokens": np.zeros((1, 3), np.int32), "accept_lens": a(1)}
    for given, name in (
        (dict(bonus_tokens=a(4)), "bonus_tokens"),
        (dict(topk_p=np.ones((1, 1), np.float32)), "topk_p"),
    ):
        with pytest.raises(fj.FutureMapError, match=name):
            fm.stash(a(3), fj.DraftPayload(**given, extras=own))
    after = jax.tree.map(np.asarray, fm.state)
    assert jax.tree.all(jax.tree.map(lambda x, y: bits(x) == bits(y), before, after))
    with pytest.raises(fj.FutureMapError, match="no field"):
        fj.FutureMap(R, spec=fj.SpecConfig(topk=0, bonus_tokens=False))
    with pytest.raises(fj.FutureMapError, match="bonus_tokens"):
        fj.FutureMap(R, spec=fj.SpecConfig(topk=1, bonus_tokens="no"))  # type: ignore[arg-type]


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_the_pure_ops_relay_an_ngram_payload_under_checkify(protocol: str) -> None:
    """The pure ops, jitted under checkify with debug checks: a spec with no consume-tracked
    field traces (no consume check to build) and relays the declared fields."""
    ops = fj.future_map(R, spec=NGRAM, debug=True, protocol=protocol)
    state = ops.publish(ops.init(), jnp.array([2]), jnp.array([5]))
    toks = jnp.array([[7, 8, 9]], jnp.int32)
    payload = fj.DraftPayload(extras={"accept_tokens": toks, "accept_lens": jnp.array([3])})
    err, state = checkify.checkify(jax.jit(ops.stash))(state, jnp.array([2]), payload)
    err.throw()
    ids = jnp.zeros(1, jnp.int32) if protocol == "gather" else -jnp.array([2], jnp.int32)
    batch = fj.Batch(jnp.int32(D), jnp.array([2]), ids, ids, draft_indices=jnp.array([2]))
    err, (state, r) = checkify.checkify(jax.jit(ops.resolve))(state, batch)
    err.throw()
    assert r.draft is not None and r.draft.extras is not None
    assert np.asarray(r.draft.extras["accept_tokens"]).tolist() == [[7, 8, 9]]
    assert np.asarray(r.draft.extras["accept_lens"]).tolist() == [3]


def test_pure_ops_take_an_int_fields_rows_in_any_int_dtype_that_holds_them() -> None:
    """The pure ops (traced: no value read) take an int field's rows in any int dtype whose
    every value its buffer holds (int16 rows for a declared int32 field, cast), and refuse
    one it may not (int32 rows for an int16 field), float rows for an int field, and rows
    of another dtype for a float field, naming the field and both dtypes
    (docs/CONTRACT.md, 'Relay fields')."""
    fields = (
        fj.RelayField("n", (2,), np.int32),
        fj.RelayField("k", (), np.int16),
        fj.RelayField("p", (2,), np.float32),
    )
    ops = fj.future_map(R, spec=fj.SpecConfig(topk=0, bonus_tokens=False, extra=fields))
    slots = jnp.asarray(a(3, 5))
    good = {
        "n": jnp.asarray([[1, -2], [3, 4]], jnp.int16),
        "k": jnp.asarray([5, 6], jnp.int8),
        "p": jnp.ones((2, 2), jnp.float32),
    }
    st = ops.stash(ops.init(), slots, fj.DraftPayload(extras=good))
    assert st.extras is not None and st.extras["n"].dtype == jnp.int32
    assert np.asarray(st.extras["n"])[[3, 5]].tolist() == [[1, -2], [3, 4]]
    assert np.asarray(st.extras["k"])[[3, 5]].tolist() == [5, 6]
    for change, match in (
        ({"k": jnp.asarray([5, 6], jnp.int32)}, "draft.k has dtype int32, which the int16"),
        ({"n": jnp.ones((2, 2), jnp.float32)}, "draft.n must have an integer dtype"),
        ({"n": jnp.ones((2, 3), jnp.int32)}, r"draft.n must have shape \(2, 2\)"),
        ({"p": jnp.ones((2, 2), jnp.bfloat16)}, "draft.p has dtype bfloat16, declared float32"),
    ):
        with pytest.raises(fj.FutureMapError, match=match):
            ops.stash(ops.init(), slots, fj.DraftPayload(extras={**good, **change}))
