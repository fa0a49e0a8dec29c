"""The debug channel: one packed int array per op call, the same error back on the host,
every violation reported."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import Mesh

import fm_jax as fj
from fm_jax.map.debug_channel import DebugChannel


def _op(x: jax.Array) -> jax.Array:
    checkify.check(jnp.all(x >= 0), "[neg] value {v} is negative", v=jnp.min(x))
    checkify.check(jnp.all(x < 100), "[big] value {v} is too big", v=jnp.max(x))
    return x + 1


def _both(x: jax.Array) -> tuple[str | None, str | None]:
    """The error message of the plain checkified op, and of the packed-then-unpacked one."""
    checked = checkify.checkify(_op, errors=checkify.user_checks)
    channel = DebugChannel(fj.mesh_layout(Mesh(np.array(jax.devices()[:1]), ("dp",)), "dp"))
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
    (_, op, packed) = fm._runtime.debug._pending[-1]
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


def test_a_refused_resolve_does_not_mark_its_slots_checked() -> None:
    """Pins a resolve refused while tracing (seq_lens of shape [B, 1]: only the trace sees
    it) marking its device slots as checked, so that finish on the same array skipped its
    slot checks and a duplicate live slot passed unreported."""
    fm = fj.FutureMap(8, debug=True, batch_buckets=(2,), token_buckets=(2,))
    idx = jax.device_put(np.array([3, 3], np.int32))
    with pytest.raises(fj.FutureMapError, match="seq_lens must be 1-D"):
        fm.resolve(fj.Batch(fj.ForwardMode.EXTEND, idx, idx, jnp.ones((2, 1), jnp.int32)))
    host = np.array([1, 1])  # host values: only the slots can make finish run its checks
    fm.finish(fj.Batch(fj.ForwardMode.DECODE, idx, -idx, -idx), idx, host, host)
    with pytest.raises(fj.InvariantViolation) as got:
        fm.check()
    assert (got.value.op, got.value.invariant) == ("finish", "duplicate live slot")


def test_resolve_seq_lens_cpu_checks_slots_and_never_wraps() -> None:
    """Pins resolve_seq_lens_cpu reading slot R-1 for a slot -1 (negative wrap) and never
    checking device slots in debug: host slots are refused, device slots reported."""
    fm = fj.FutureMap(8, debug=True, batch_buckets=(2,), token_buckets=(2,))
    fm.publish(np.array([7]), np.array([5]))
    with pytest.raises(fj.FutureMapError, match="outside"):
        fm.resolve_seq_lens_cpu(np.array([-1]))
    with pytest.raises(fj.InvariantViolation) as got:
        fm.resolve_seq_lens_cpu(jax.device_put(np.array([-1, 7], np.int32)))
    assert got.value.invariant == "slot range"
    plain = fj.FutureMap(8, batch_buckets=(2,), token_buckets=(2,))
    plain.publish(np.array([7]), np.array([5]))
    lens = plain.resolve_seq_lens_cpu(jax.device_put(np.array([-1, 7], np.int32)))
    assert lens.tolist() == [0, 5]  # -1 clips to slot 0 (padding), not slot 7


def test_a_full_pending_list_keeps_the_failures_and_raises_nowhere_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pins the pending-error flush raising inside an unrelated later call (after that call
    had run): past the limit the map fetches its errors, keeps the failed ones pending, and
    only check() reports them."""
    from fm_jax.map import debug_channel

    monkeypatch.setattr(debug_channel, "MAX_PENDING_ERRORS", 3)
    fm = fj.FutureMap(8, debug=True, batch_buckets=(2,), token_buckets=(2,))
    dup = jax.device_put(np.array([3, 3], np.int32))
    fm.publish(dup, np.array([1, 1]))  # a violation
    ok = jax.device_put(np.array([1, 2], np.int32))
    for _ in range(5):  # past the limit: no raise here
        fm.publish(ok, np.array([4, 4]))
    assert fm._runtime.debug.pending < 3  # flushed: the clean errors dropped, the failed one kept
    with pytest.raises(fj.InvariantViolation) as got:
        fm.check()
    assert (got.value.op, got.value.invariant) == ("publish", "duplicate live slot")


def test_failures_past_the_pending_bound_do_not_sync_every_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect (reliability round two): once the bound's worth of failed errors was pending,
    every later debug op fetched them all again (a sync of about 3 ms an op). Failures
    fetched by a flush wait on the host: one fetch per bound's worth of ops, every
    violation still reported by check()."""
    from fm_jax.map import debug_channel

    monkeypatch.setattr(debug_channel, "MAX_PENDING_ERRORS", 3)
    fetches = []
    real = DebugChannel._failures

    def counted(self: DebugChannel) -> Any:
        fetches.append(1)
        return real(self)

    monkeypatch.setattr(DebugChannel, "_failures", counted)
    fm = fj.FutureMap(8, debug=True, batch_buckets=(2,), token_buckets=(2,))
    for _ in range(9):
        fm.publish(dv(3, 3), np.array([1, 1]))  # a violation each time
    assert len(fetches) == 3  # at the 3rd, 6th and 9th op, not at every op past the 3rd
    with pytest.raises(fj.InvariantViolation) as got:
        fm.check()
    assert len(got.value.violations) == 9


def test_each_violation_names_invariant_step_op_and_slots() -> None:
    """Pins a report that says which invariant failed but not where: every violation in
    one report carries its invariant, step, op and the slot its check names (the DP rank
    on a mesh: tests/test_scaleout_mesh.py)."""
    fm = fj.FutureMap(8, debug=True, batch_buckets=(2,), token_buckets=(2,))
    fm.publish(dv(3, 5), np.array([4, 4]))
    fm.stash(dv(6, 6), np.array([1, 2]))
    fm.resolve(fj.Batch(fj.ForwardMode.MIXED, dv(1, 2), dv(-5, 3), np.array([2, 2])))
    with pytest.raises(fj.InvariantViolation) as got:
        fm.check()
    found = [(v.invariant, v.step, v.op, v.slots) for v in got.value.violations]
    assert found == [
        ("duplicate live slot", 0, "stash", [6]),
        ("consume (WRWR)", 1, "resolve", [5]),  # slot 5 was never stashed
    ]
    assert got.value.slots == [6]  # the report's own attributes: its first violation's


def test_a_crash_while_reporting_drops_no_violation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins check() clearing its pending list before the report was built, so that a crash
    while translating (or fetching) lost every violation: the crash is raised, and the next
    check() reports them all."""
    from fm_jax.map import debug_channel

    fm = fj.FutureMap(8, debug=True, batch_buckets=(2,), token_buckets=(2,))
    fm.stash(dv(3, 3), np.array([1, 1]))
    fm.publish(dv(9, 1), np.array([1, 1]))

    def crash(*args: object) -> None:
        raise RuntimeError("translation failed")

    monkeypatch.setattr(debug_channel, "_violations", crash)
    with pytest.raises(RuntimeError, match="translation failed"):
        fm.check()
    monkeypatch.undo()
    with pytest.raises(fj.InvariantViolation) as got:
        fm.check()
    assert [v.op for v in got.value.violations] == ["stash", "publish"]


def test_a_failed_fetch_at_the_pending_bound_raises_nowhere_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pins the bounded pending list raising a fetch failure inside an unrelated op (after
    that op ran): the op returns, everything stays pending, check() reports it."""
    from fm_jax.map import debug_channel

    monkeypatch.setattr(debug_channel, "MAX_PENDING_ERRORS", 2)
    fm = fj.FutureMap(8, debug=True, batch_buckets=(2,), token_buckets=(2,))
    fm.publish(dv(3, 3), np.array([1, 1]))  # a violation

    def fail(self: object) -> None:
        raise RuntimeError("fetch failed")

    with monkeypatch.context() as m:
        m.setattr(DebugChannel, "_failures", fail)
        fm.publish(dv(1, 2), np.array([4, 4]))  # reaches the bound: the fetch fails, quietly
    assert fm._runtime.debug.pending == 2
    with pytest.raises(fj.InvariantViolation) as got:
        fm.check()
    assert (got.value.op, got.value.invariant) == ("publish", "duplicate live slot")


def dv(*xs: int) -> jax.Array:
    return jax.device_put(np.array(xs, np.int32))
