"""The debug channel: one packed int array per op call, the same error back on the host,
every violation reported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import fm_jax as fj
from fm_jax._src.debug_channel import DebugChannel
from fm_jax._src.sharding import single_device_layout


def _op(x: jax.Array) -> jax.Array:
    checkify.check(jnp.all(x >= 0), "[neg] value {v} is negative", v=jnp.min(x))
    checkify.check(jnp.all(x < 100), "[big] value {v} is too big", v=jnp.max(x))
    return x + 1


def _both(x: jax.Array) -> tuple[str | None, str | None]:
    """The error message of the plain checkified op, and of the packed-then-unpacked one."""
    checked = checkify.checkify(_op, errors=checkify.user_checks)
    channel = DebugChannel(single_device_layout(jax.devices()[0]))
    plain, _ = jax.jit(checked)(x)
    p, _ = jax.jit(channel.checked(_op))(x)
    assert p.ndim == 1 and jnp.issubdtype(p.dtype, jnp.integer)  # one small int array
    return plain.get(), channel.unpack(np.asarray(p)).get()


@pytest.mark.parametrize(
    "values", [[1, 2, 3], [-5, 2, 3], [1, 200, 3]], ids=["clean", "first", "second"]
)
def test_unpacked_error_says_what_the_plain_error_says(values: list[int]) -> None:
    plain, unpacked = _both(jnp.asarray(values, jnp.int32))
    assert unpacked == plain
    assert (plain is None) == (values == [1, 2, 3])


def test_an_int64_payload_beyond_int32_survives_packing() -> None:
    with jax.enable_x64(True):
        plain, unpacked = _both(jnp.asarray([-(2**40), 1], jnp.int64))
    assert plain is not None and str(-(2**40)) in plain
    assert unpacked == plain


def test_each_trace_keeps_its_own_layout() -> None:
    """Two shapes of one op trace twice; each output unpacks with its own trace's layout."""
    plain_small, unpacked_small = _both(jnp.asarray([-1], jnp.int32))
    plain_large, unpacked_large = _both(jnp.asarray([1, 2, 500, 4], jnp.int32))
    assert unpacked_small == plain_small and unpacked_large == plain_large


def test_debug_class_op_returns_one_int_array_and_check_raises() -> None:
    fm = fj.FutureMap(8, debug=True, batch_buckets=(2,), token_buckets=(2,))
    fm.resolve(fj.Batch(fj.ForwardMode.DECODE, np.array([3]), np.array([-3]), np.array([-3])))
    (_, op, packed) = fm._debug._pending[-1]
    assert op == "resolve" and isinstance(packed, jax.Array) and packed.size < 16  # one small array
    with pytest.raises(fj.InvariantViolation) as got:
        fm.check()  # slot 3 was read before any write: consume and seq_lens > 0 fail
    assert got.value.op == "resolve" and got.value.step == 1


def test_check_reports_every_pending_violation() -> None:
    """Pins check() raising the first violation and dropping the rest: two failed ops (a
    duplicate slot, then an out-of-range one) are both in the one report."""
    fm = fj.FutureMap(8, debug=True, batch_buckets=(2,), token_buckets=(2,))
    dv = lambda *x: jax.device_put(np.array(x, np.int32))  # noqa: E731
    fm.publish(dv(3, 3), np.array([1, 1]))
    fm.stash(dv(0, 12), np.array([1, 1]))
    with pytest.raises(fj.InvariantViolation) as got:
        fm.check()
    found = [(v.op, v.invariant) for v in got.value.violations]
    assert found == [("publish", "duplicate live slot"), ("stash", "slot range")]
    fm.check()  # reported once: nothing left pending
