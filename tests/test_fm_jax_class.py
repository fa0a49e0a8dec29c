"""The FutureMap class in serving: no recompiles after warm-up, donation, no host syncs.

Maps are warmed once per module (compiles dominate the cost) and shared between tests.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

import fm_jax as fj

R = 8
BUCKETS = (2, 8)  # batch and token buckets: sizes 0..8 map to 2 or 8
STEPS = 300
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compiles (every jit, eager op or checkify'd step that compiles)."""

    def __init__(self) -> None:
        self.count = 0
        self.names: list[str] = []

    def __call__(self, event: str, duration: float, **kwargs: object) -> None:
        if event == COMPILE_EVENT:
            self.count += 1
            self.names.append(str(kwargs.get("fun_name", "?")))

    def since(self, before: int) -> list[str]:
        """Names of the functions compiled since the count was `before`."""
        return self.names[before:]


@pytest.fixture(scope="module")
def compiles() -> Iterator[CompileCounter]:
    counter = CompileCounter()
    monitoring.register_event_duration_secs_listener(counter)
    yield counter
    monitoring.unregister_event_duration_listener(counter)


@pytest.fixture(scope="module")
def warm_maps(compiles: CompileCounter) -> dict[bool, fj.FutureMap]:
    """One warmed non-debug and one warmed debug map; warm-up must have compiled."""
    maps = {}
    for debug in (False, True):
        fm = fj.FutureMap(R, debug=debug, batch_buckets=BUCKETS, token_buckets=BUCKETS)
        before = compiles.count
        fm.warm_up()
        assert compiles.count > before, "the compile counter saw no compile during warm-up"
        maps[debug] = fm
    return maps


def jit_cache_sizes(fm: fj.FutureMap) -> list[int]:
    return [f._cache_size() for f in fm.executables().values()]


def random_batch(rng: np.random.Generator, live: list[int]) -> tuple[fj.Batch, np.ndarray]:
    """A host batch of 0..8 rows over distinct live slots, of a random kind."""
    n = int(rng.integers(0, len(live) + 1))
    idx = rng.choice(live, n, replace=False).astype(np.int64)
    kind = rng.integers(0, 3)
    if n == 0:
        return fj.Batch(fj.ForwardMode.IDLE, idx, idx, idx), idx
    if kind == 0:  # DECODE: sentinels
        return fj.Batch(fj.ForwardMode.DECODE, idx, -idx, -idx), idx
    if kind == 1:  # EXTEND: one prompt token per row keeps the ids within the token buckets
        return fj.Batch(fj.ForwardMode.EXTEND, idx, rng.integers(0, 9, n), np.ones(n, int)), idx
    return fj.Batch(fj.ForwardMode.MIXED, idx, -idx, np.full(n, 5)), idx


def run_host_step(fm: fj.FutureMap, rng: np.random.Generator) -> None:
    """One overlap step with numpy inputs; keeps no references to its outputs."""
    batch, idx = random_batch(rng, list(range(1, R)))
    res = fm.resolve(batch)
    n = len(idx)
    lens, tokens = np.asarray(res.seq_lens)[:n] % 50 + 1, rng.integers(0, 50, n)
    if rng.integers(0, 2):  # the tail per op, or in one call
        fm.publish(idx, lens)
        fm.stash(idx, tokens)
        fm.invalidate(batch, idx)
    else:
        fm.finish(batch, idx, lens, tokens)


def prefill_all(fm: fj.FutureMap) -> None:
    """Give every live slot a length and a token (so that debug reads are clean)."""
    live = np.arange(1, R)
    fm.publish(live, np.full(R - 1, 3))
    fm.stash(live, np.arange(1, R) * 10)


def test_no_recompiles_over_changing_batch_sizes(warm_maps, compiles) -> None:
    """After warm_up, STEPS steps of every batch kind and size 0..8 (numpy inputs, padded
    to buckets) must trigger zero compiles by the backend compile count. The jitted entry
    points' dispatch caches (filled by a call's first use of an argument signature, not by
    an ahead-of-time compile) must stop growing after the first half."""
    for debug, fm in warm_maps.items():
        rng = np.random.default_rng(1)
        prefill_all(fm)
        before = compiles.count
        for _ in range(STEPS // 2):
            run_host_step(fm, rng)
        sizes_half = jit_cache_sizes(fm)
        for _ in range(STEPS // 2):
            run_host_step(fm, rng)
        fm.check()
        assert compiles.count == before, (debug, compiles.since(before))
        assert jit_cache_sizes(fm) == sizes_half


def test_no_recompile_guard_detects_a_new_shape(compiles) -> None:
    """The compile count must see a compile when a shape outside the warmed buckets shows
    up (so that the zero-compile assertions above can fail)."""
    fm = fj.FutureMap(R, batch_buckets=(2,), token_buckets=(2,))
    fm.warm_up()
    before = compiles.count
    fm.publish(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int16))
    assert compiles.count > before


def live_bytes() -> int:
    """Bytes of the device arrays still reachable: unreachable ones (another test's cyclic
    garbage, freed whenever the collector happens to run) are collected first, so that
    only a leak can make the figure change."""
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_donated_buffers_are_deleted_and_live_bytes_stay_flat(warm_maps) -> None:
    """publish and stash (and debug resolve) must donate the state: the previous buffer is
    deleted after the call; over STEPS steps the live device bytes must not grow."""
    for debug, fm in warm_maps.items():
        prefill_all(fm)
        old = fm.state
        fm.publish(np.array([1, 2]), np.array([4, 4]))
        assert old.new_seq_lens.is_deleted() and old.output_tokens.is_deleted()
        old = fm.state
        fm.stash(np.array([1, 2]), np.array([5, 6]))
        assert old.output_tokens.is_deleted()
        old = fm.state
        fm.resolve(fj.Batch(fj.ForwardMode.DECODE, np.array([1]), np.array([-1]), np.array([-1])))
        assert old.output_tokens.is_deleted() == debug  # non-debug resolve only reads
        del old
        fm.check()
        prefill_all(fm)  # slot 1 was consumed: write it again before the loop reads it

        rng = np.random.default_rng(2)
        seen = []
        for step in range(STEPS):
            run_host_step(fm, rng)
            if step % 50 == 49:
                fm.check()  # debug: release the pending on-device errors
                jax.block_until_ready(fm.state)
                seen.append(live_bytes())
        assert len(set(seen)) == 1, f"debug={debug}: live bytes {seen}"


@jax.jit
def forward(ids: jax.Array, lens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A stand-in model step: next token from the resolved id, length + 1."""
    return (ids * 7 + 3) % 97, lens + 1


@pytest.mark.parametrize("debug", [False, True], ids=["prod", "debug"])
def test_overlap_loop_makes_no_host_transfer(warm_maps, compiles, debug: bool) -> None:
    """STEPS steps of the overlap loop with device-array inputs under
    jax.transfer_guard('disallow') must make no implicit transfer (any one raises) and no
    compile, and resolve the tokens and lengths a host model predicts."""
    fm = warm_maps[debug]
    rng = np.random.default_rng(3)
    prefill_all(fm)
    fm.check()
    tok = np.zeros(R, np.int64)
    tok[1:] = np.arange(1, R) * 10
    lens = np.full(R, 3)
    batches, expected = [], []
    for _ in range(STEPS):  # built on the host before the loop, as device arrays
        n = int(rng.integers(1, R))
        slots = rng.choice(np.arange(1, R), n, replace=False)
        b = 2 if n <= 2 else 8
        idx = np.zeros(b, np.int32)
        idx[:n] = slots
        expected.append((slots, tok[slots].copy(), lens[slots].copy()))
        tok[slots] = (tok[slots] * 7 + 3) % 97
        lens[slots] += 1
        dev = jax.device_put(idx)
        sentinel = jax.device_put(-idx)
        batches.append(
            fj.Batch(jax.device_put(np.int32(fj.ForwardMode.DECODE)), dev, sentinel, sentinel)
        )
    for b in BUCKETS:  # the stand-in model compiles once per bucket, before the loop
        zeros = jax.device_put(np.zeros(b, np.int32), jax.devices()[0])
        forward(zeros, zeros)
    jax.block_until_ready(batches)
    outs = []
    with jax.transfer_guard("disallow"):
        with pytest.raises(Exception, match="[Dd]isallowed"):
            jnp.asarray(np.ones(2, np.int32))  # the guard is active
        before = compiles.count
        for batch in batches:
            res = fm.resolve(batch)
            new_tok, new_lens = forward(res.input_ids, res.seq_lens)
            fm.publish(batch.req_pool_indices, new_lens)
            fm.stash(batch.req_pool_indices, new_tok)
            fm.invalidate(batch, batch.req_pool_indices)
            outs.append(res)
    assert compiles.count == before, compiles.since(before)
    fm.check()
    for (slots, want_tok, want_len), res in zip(expected, outs, strict=True):
        n = len(slots)
        np.testing.assert_array_equal(np.asarray(res.input_ids)[:n], want_tok)
        np.testing.assert_array_equal(np.asarray(res.seq_lens)[:n], want_len)


def test_idle_batch_takes_the_smallest_bucket(warm_maps, compiles) -> None:
    """An empty (IDLE) batch must resolve through the smallest bucket (no new shape, no
    compile) to all-padding output, and leave live slots unchanged."""
    fm = warm_maps[False]
    prefill_all(fm)
    before_state = {k: np.asarray(b).copy() for k, b in fm.buffers().items()}
    before = compiles.count
    empty = np.zeros(0, np.int64)
    res = fm.resolve(fj.Batch(fj.ForwardMode.IDLE, empty, empty, empty))
    fm.publish(empty, empty)
    fm.stash(empty, empty)
    assert compiles.count == before, compiles.since(before)
    np.testing.assert_array_equal(res.input_ids, np.zeros(BUCKETS[0]))
    after = fm.buffers()
    assert set(after) == set(before_state)
    for k, a in before_state.items():
        np.testing.assert_array_equal(a[1:], np.asarray(after[k])[1:])


def test_invalidate_does_not_compile_per_batch_shape(warm_maps, compiles) -> None:
    """invalidate must not key a compile on the batch's other fields (unpadded host ids of
    any length), only on the indices' bucket."""
    fm = warm_maps[False]
    before = compiles.count
    for t in (1, 3, 5, 7):
        batch = fj.Batch(fj.ForwardMode.EXTEND, np.array([1, 2]), np.arange(t), np.array([1, 2]))
        out = fm.invalidate(batch, np.array([1, 2]))
        np.testing.assert_array_equal(out.input_ids, [-1, -2])
        np.testing.assert_array_equal(out.seq_lens, [-1, -2])
    assert compiles.count == before, compiles.since(before)


@pytest.mark.parametrize("debug", [False, True])
def test_finish_equals_publish_stash_invalidate(debug: bool) -> None:
    """Pins the one-call tail drifting from the per-op tail: after the same steps, `finish`
    must leave the same buffer bytes and the same sentinels as publish + stash + invalidate."""
    maps = [
        fj.FutureMap(R, debug=debug, batch_buckets=BUCKETS, token_buckets=BUCKETS) for _ in "ab"
    ]
    rng = np.random.default_rng(7)
    for _ in range(12):
        batch, idx = random_batch(rng, list(range(1, R)))
        lens, tokens = rng.integers(1, 60, len(idx)), rng.integers(0, 99, len(idx))
        a, b = maps
        a.publish(idx, lens)
        a.stash(idx, tokens)
        sa = a.invalidate(batch, idx)
        sb = b.finish(batch, idx, lens, tokens)
        for x, y in ((sa.input_ids, sb.input_ids), (sa.seq_lens, sb.seq_lens)):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    for name in ("output_tokens", "new_seq_lens"):
        assert np.asarray(getattr(maps[0].state, name))[1:].tobytes() == (
            np.asarray(getattr(maps[1].state, name))[1:].tobytes()
        ), name
    for fm in maps:
        fm.check()


def test_finish_reports_a_duplicate_slot_in_debug_mode() -> None:
    """Pins the one-call tail skipping the debug checks: a duplicate live slot passed to
    `finish` as a device array must raise at check(), naming the op."""
    fm = fj.FutureMap(R, debug=True, batch_buckets=BUCKETS, token_buckets=BUCKETS)
    dev = jax.devices()[0]
    idx = jax.device_put(np.array([3, 3], np.int32), dev)
    fm.finish(fj.Batch(fj.ForwardMode.DECODE, idx, idx, idx), idx, idx, idx)
    with pytest.raises(fj.InvariantViolation, match="finish") as info:
        fm.check()
    assert info.value.invariant == "duplicate live slot"


def test_debug_checks_every_slot_array_on_the_device() -> None:
    """Pins the tail skipping checks it must run: a debug map has one executable per op,
    which checks its slots on the device every call, the very array the step's resolve
    checked included (a duplicate there is reported by resolve and by finish), and any
    other device array too; host slots checked on the host pass."""
    fm = fj.FutureMap(R, debug=True, batch_buckets=BUCKETS, token_buckets=BUCKETS)
    dev = jax.devices()[0]
    idx = jax.device_put(np.array([3, 3], np.int32), dev)
    fm.publish(np.array([3]), np.array([4]))
    fm.stash(np.array([3]), np.array([7]))
    fm.check()  # host slots: no violation
    fm.resolve(fj.Batch(fj.ForwardMode.DECODE, idx, -idx, -idx))
    host = np.array([5, 5])  # host values: checked on the host (device ones on the device)
    fm.finish(fj.Batch(fj.ForwardMode.DECODE, idx, -idx, -idx), idx, host, host)
    assert [op for _, op, _ in fm._runtime.debug._pending] == ["resolve", "finish"]
    with pytest.raises(fj.InvariantViolation) as info:
        fm.check()
    assert info.value.op == "resolve" and info.value.invariant == "duplicate live slot"
    assert [v.op for v in info.value.violations] == ["resolve", "finish"]
    other = jax.device_put(np.array([3, 3], np.int32), dev)  # equal values, another array
    fm.finish(fj.Batch(fj.ForwardMode.DECODE, idx, -idx, -idx), other, idx, idx)
    assert [op for _, op, _ in fm._runtime.debug._pending] == ["finish"]
    with pytest.raises(fj.InvariantViolation, match="finish"):
        fm.check()


def test_two_threads_on_one_map_take_turns() -> None:
    """Defect (reliability round two): two threads calling one map got raw "Array has been
    deleted" errors on about 0.5% of ops (one op read the state another had donated). The
    map serializes its ops: both threads' loops run without an error and every write lands."""
    import threading

    fm = fj.FutureMap(64, debug=True, batch_buckets=(4,), token_buckets=(4,))
    errors: list[BaseException] = []

    def loop(base: int) -> None:
        idx = np.arange(base, base + 4, dtype=np.int32)
        try:
            for step in range(150):
                fm.publish(idx, np.full(4, step + 1, np.int32))
                fm.stash(idx, np.full(4, step, np.int32))
                fm.resolve(fj.Batch(fj.ForwardMode.DECODE, idx, -idx, -idx))
        except BaseException as e:  # noqa: BLE001 (any error fails the test)
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(b,)) for b in (1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    lens = np.asarray(fm.buffers()["new_seq_lens"])
    assert lens[1:5].tolist() == lens[9:13].tolist() == [150] * 4
    fm.check()
