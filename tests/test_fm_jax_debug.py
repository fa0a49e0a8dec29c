"""fm_jax debug mode: the checkify invariants catch what docs/CONTRACT.md says they catch.

Slot roles in the shared map: 1..5 get a length and a token at prefill, 6 a token but no
length, 7 nothing ever (so it still holds the -1 poison and a zero length).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import fm_jax as fj

R = 8
DECODE, MIXED = fj.ForwardMode.DECODE, fj.ForwardMode.MIXED


@pytest.fixture(scope="module")
def fm() -> fj.FutureMap:
    return fj.FutureMap(R, debug=True, batch_buckets=(2,), token_buckets=(2,))


def prefill(fm: fj.FutureMap) -> None:
    fm.publish(np.array([1, 2]), np.array([4, 4]))
    fm.publish(np.array([3, 4]), np.array([4, 4]))
    fm.publish(np.array([5]), np.array([4]))
    for pair in ([1, 2], [3, 4], [5, 6]):
        fm.stash(np.array(pair), np.array([7, 0]))
    fm.check()


def dev(*xs: int) -> jax.Array:
    return jax.device_put(np.array(xs, np.int32), jax.devices()[0])


def expect_violation(fm: fj.FutureMap, invariant: str, slot: int | None = None) -> None:
    """fm.check() must raise InvariantViolation naming `invariant`, the step and the slot."""
    with pytest.raises(fj.InvariantViolation) as info:
        fm.check()
    err = info.value
    assert err.invariant == invariant, str(err)
    assert err.step == fm.step and f"step {fm.step}" in str(err)
    if slot is not None:
        assert f"slot {slot}" in str(err), str(err)
    fm.check()  # reported once, then cleared


def test_rr_is_caught(fm: fj.FutureMap) -> None:
    """Reading a slot twice with no write between (RR) must raise 'consume (WRWR)'."""
    prefill(fm)
    batch = fj.Batch(DECODE, np.array([2, 1]), np.array([-2, -1]), np.array([-2, -1]))
    fm.resolve(batch)
    fm.check()  # first read is clean (token 0 at slot 2 included)
    fm.resolve(batch)
    expect_violation(fm, "consume (WRWR)", slot=2)


def test_read_before_first_write_is_caught(fm: fj.FutureMap) -> None:
    """Reading a slot that was never stashed must raise 'consume (WRWR)' (MIXED: no length
    restore, so the consume check is the one that fires)."""
    prefill(fm)
    fm.resolve(fj.Batch(MIXED, np.array([7]), np.array([-7]), np.array([3])))
    expect_violation(fm, "consume (WRWR)", slot=7)


def test_unpublished_length_is_caught(fm: fj.FutureMap) -> None:
    """A DECODE restore of a slot whose length was never published (0) must raise
    'seq_lens > 0'."""
    prefill(fm)
    fm.resolve(fj.Batch(DECODE, np.array([1, 6]), np.array([-1, -6]), np.array([-1, -6])))
    expect_violation(fm, "seq_lens > 0", slot=6)


def test_out_of_range_device_slot_is_caught(fm: fj.FutureMap) -> None:
    """A device-array slot outside [0, R) must raise 'slot range' at check(), and the
    dropped write must leave every live slot unchanged."""
    prefill(fm)
    before = {k: np.asarray(v).copy() for k, v in fm.buffers().items()}
    fm.publish(dev(R, 1), dev(9, 9))
    expect_violation(fm, "slot range", slot=R)
    fm.stash(dev(-3, 0), dev(9, 9))
    expect_violation(fm, "slot range", slot=-3)
    after = fm.buffers()
    np.testing.assert_array_equal(np.asarray(after["new_seq_lens"])[2:], before["new_seq_lens"][2:])
    np.testing.assert_array_equal(
        np.asarray(after["output_tokens"])[1:], before["output_tokens"][1:]
    )


def test_duplicate_live_device_slot_is_caught(fm: fj.FutureMap) -> None:
    """A live slot twice in one batch (device array) must raise 'duplicate live slot';
    slot 0 twice (padding) must not."""
    prefill(fm)
    fm.stash(dev(3, 3), dev(1, 2))
    expect_violation(fm, "duplicate live slot", slot=3)
    fm.stash(dev(0, 0), dev(1, 2))
    fm.check()


def test_ww_then_one_read_is_not_caught(fm: fj.FutureMap) -> None:
    """Documented limit: two writes then one read (WW R) passes the consume check."""
    prefill(fm)
    fm.stash(np.array([4]), np.array([11]))
    fm.stash(np.array([4]), np.array([12]))
    out = fm.resolve(fj.Batch(DECODE, np.array([4]), np.array([-4]), np.array([-4])))
    fm.check()
    assert int(out.input_ids[0]) == 12


def test_errors_raise_at_resolve_seq_lens_cpu(fm: fj.FutureMap) -> None:
    """resolve_seq_lens_cpu syncs anyway, so it must raise a pending violation."""
    prefill(fm)
    fm.resolve(fj.Batch(MIXED, np.array([7]), np.array([-7]), np.array([3])))
    with pytest.raises(fj.InvariantViolation, match="consume"):
        fm.resolve_seq_lens_cpu(np.array([1]))
    fm.check()


# ---------------------------------------------------------------- pure ops under checkify
OPS = fj.future_map(R, debug=True)
RESOLVE = jax.jit(checkify.checkify(OPS.resolve, errors=checkify.user_checks))
PUBLISH = jax.jit(checkify.checkify(OPS.publish, errors=checkify.user_checks))
STASH = jax.jit(checkify.checkify(OPS.stash, errors=checkify.user_checks))


def ops_state() -> fj.FutureMapState:
    st = OPS.init()
    for pair in ([1, 2], [3, 4]):
        err, st = PUBLISH(st, dev(*pair), dev(5, 5))
        fj.raise_if_violated(err)
    for pair in ([1, 2], [3, 4], [5, 6]):
        err, st = STASH(st, dev(*pair), dev(8, 0))
        fj.raise_if_violated(err)
    return st


def resolve_batch(mode: fj.ForwardMode, *slots: int) -> fj.Batch:
    idx = dev(*slots)
    return fj.Batch(jnp.asarray(np.int32(mode)), idx, -idx, -idx)


@pytest.mark.parametrize(
    ("first", "second", "invariant"),
    [
        (None, resolve_batch(DECODE, 2, 1), None),  # clean read: no violation
        (resolve_batch(DECODE, 2, 0), resolve_batch(DECODE, 2, 0), "consume (WRWR)"),  # RR
        (None, resolve_batch(MIXED, 7, 0), "consume (WRWR)"),  # read before write
        (None, resolve_batch(DECODE, 5, 1), "seq_lens > 0"),  # unpublished length
        (None, resolve_batch(DECODE, 1, R + 1), "slot range"),
        (None, resolve_batch(DECODE, 3, 3), "duplicate live slot"),
    ],
    ids=["clean", "rr", "read_before_write", "unpublished_len", "slot_range", "duplicate"],
)
def test_pure_ops_report_through_raise_if_violated(first, second, invariant) -> None:
    """The checkified pure resolve must carry each violation to raise_if_violated, which
    raises InvariantViolation with .invariant, the step and the op; a clean read passes."""
    st = ops_state()
    if first is not None:
        err, (st, _) = RESOLVE(st, first)
        fj.raise_if_violated(err, step=1, op="resolve")
    err, (st, _) = RESOLVE(st, second)
    if invariant is None:
        fj.raise_if_violated(err, step=2, op="resolve")
        return
    with pytest.raises(fj.InvariantViolation) as info:
        fj.raise_if_violated(err, step=2, op="resolve")
    assert info.value.invariant == invariant
    assert info.value.step == 2 and "step 2, resolve" in str(info.value)


def test_pure_ops_ww_then_one_read_passes() -> None:
    """Documented limit on the pure ops: WW followed by one read raises nothing."""
    st = ops_state()
    err, st = STASH(st, dev(1, 0), dev(3, 0))
    fj.raise_if_violated(err)
    err, (st, out) = RESOLVE(st, resolve_batch(DECODE, 1, 0))
    fj.raise_if_violated(err)
    assert int(out.input_ids[0]) == 3


def test_debug_invalidate_checks_device_slots() -> None:
    """Defect (reliability round two): debug `invalidate` did not check device slots,
    although every op checks slot range. A device slot out of range, or a live slot twice,
    is reported against invalidate; host slots are checked on the host; clean slots pass."""
    fm = fj.FutureMap(16, debug=True, batch_buckets=(2,), token_buckets=(2,))
    two = np.array([1, 2], np.int32)
    b = fj.Batch(fj.ForwardMode.DECODE, two, -two, -two)
    fm.invalidate(b, jax.device_put(np.array([3, 99], np.int32)))
    fm.invalidate(b, jax.device_put(np.array([3, 3], np.int32)))
    with pytest.raises(fj.InvariantViolation) as got:
        fm.check()
    found = [(v.op, v.invariant) for v in got.value.violations]
    assert found == [("invalidate", "slot range"), ("invalidate", "duplicate live slot")]
    with pytest.raises(fj.FutureMapError, match="outside"):
        fm.invalidate(b, np.array([3, 99], np.int32))
    out = fm.invalidate(b, jax.device_put(np.array([3, 4], np.int32)))
    assert np.asarray(out.input_ids).tolist() == [-3, -4]
    fm.check()
