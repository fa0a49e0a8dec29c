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
    assert fm.state.extras["score"].dtype == np.uint16  # declared bits=True
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


@pytest.mark.parametrize("field", ["verified_id", "steps"])
def test_every_consumed_field_is_poisoned_and_checked(field: str) -> None:
    """A consume-tracked declared field starts at -1 and is written -1 at the draft's slots
    after a resolve (a field not tracked, score, keeps its value); a read that finds -1 in
    that field alone (every other field restored) is reported."""
    ops = fj.future_map(R, spec=SPEC, debug=True)
    get = lambda st: st.verified_id if field == "verified_id" else st.extras["steps"]  # noqa: E731
    st = ops.init()
    assert np.asarray(get(st)).tolist() == [-1] * R
    st = ops.publish(st, a(3), a(4))
    st = ops.stash(
        st, a(3), jax.tree_util.tree_map(jnp.asarray, draft([30], [31], [7], SCORES[:1]))
    )
    b = fj.Batch(D, a(3), a(-3), a(-3), draft_indices=a(3))
    resolve = jax.jit(checkify.checkify(ops.resolve, errors=checkify.user_checks))
    err, (st, _) = resolve(st, b)
    err.throw()
    assert np.asarray(get(st))[3] == -1
    assert bits(np.asarray(st.extras["score"])[3]) == bits(SCORES[0].view(np.uint16))
    # Every consumed buffer but `field` written again at slot 3: only `field` reads -1.
    restored = st._replace(output_tokens=st.output_tokens.at[3].set(32))
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
        ((fj.RelayField("x", dtype=np.int32, bits=True),), "bits=True stores a float"),
        (("x",), "holds RelayFields"),
    ],
)
def test_a_bad_declaration_is_refused_when_the_map_is_built(extra: Any, message: str) -> None:
    """A field declaration that cannot be relayed is refused by name at build time."""
    with pytest.raises(fj.FutureMapError, match=message):
        fj.future_map(R, spec=fj.SpecConfig(topk=2, extra=extra))


def test_the_standard_configuration_is_one_declaration() -> None:
    """The EAGLE-style spec path is the declaration SpecConfig(topk, hidden) makes: bonus
    tokens and top-k, hidden states as their bits; its buffers are the ones the map had
    before fields were declared (no verified ids, no extras)."""
    spec = fj.SpecConfig(topk=3, hidden=4)
    names = [(f.name, f.shape, f.consumed, f.bits) for f in spec.fields()]
    assert names == [
        ("bonus_tokens", (), True, False),
        ("topk_p", (3,), False, False),
        ("topk_index", (3,), False, False),
        ("hidden_states", (4,), False, True),
    ]
    st = fj.future_map(R, spec=spec).init()
    assert st.verified_id is None and st.extras is None
    assert st.hidden_states is not None and st.hidden_states.dtype == np.uint16


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
