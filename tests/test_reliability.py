"""Regression tests for inputs at the edges of the contract, in both twins.

Each test's docstring names the bug it pins. Bad input in general (every field, every
entry point) is tests/test_bad_input_table.py; the debug channel's own reporting is
tests/test_fm_jax_debug_channel.py.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import checkify

import fm_jax as fj
import fm_torch as ft
from fm_bench.child import call_in_child

R = 8
DECODE, MIXED = fj.ForwardMode.DECODE, fj.ForwardMode.MIXED


def jax_map(debug: bool = True) -> fj.FutureMap:
    return fj.FutureMap(R, debug=debug, batch_buckets=(2, 4), token_buckets=(2, 4))


def a(*xs: int) -> np.ndarray:
    return np.array(xs, np.int32)


def dev(*xs: int) -> jax.Array:
    return jax.device_put(np.array(xs, np.int32), jax.devices()[0])


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def violation(fm: fj.FutureMap) -> fj.InvariantViolation:
    with pytest.raises(fj.InvariantViolation) as info:
        fm.check()
    return info.value


# ------------------------------------------------------------------------ forward mode
@pytest.mark.parametrize("mode", [7, -1])
def test_a_traced_mode_outside_forward_mode_is_reported_in_debug(mode: int) -> None:
    """Pins a traced forward_mode of 7 or -1 running silently as 'not DECODE' (a sentinel
    then left in seq_lens): debug mode reports it; without debug it runs as not DECODE,
    as documented (no value of a traced mode is read on the host)."""
    fm = jax_map()
    fm.publish(np.array([3]), np.array([5]))
    fm.stash(np.array([3]), np.array([9]))
    fm.resolve(fj.Batch(jnp.int32(mode), np.array([3]), np.array([-3]), np.array([-3])))
    got = violation(fm)
    assert got.invariant == "forward mode" and f"forward_mode {mode}" in str(got)
    assert (got.op, got.step, got.slots) == ("resolve", 1, [])
    plain = jax_map(debug=False)
    out = plain.resolve(fj.Batch(jnp.int32(mode), np.array([3]), np.array([-3]), np.array([-3])))
    assert np.asarray(out.seq_lens)[0] == -3  # not DECODE: the lengths as given


def test_pure_ops_report_a_traced_mode_outside_forward_mode() -> None:
    """Pins the pure resolve under an engine's checkify taking a traced mode of 7 as 'not
    DECODE' without a word."""
    ops = fj.future_map(R, debug=True)
    step = jax.jit(checkify.checkify(ops.resolve, errors=checkify.user_checks))
    err, _ = step(ops.init(), fj.Batch(jnp.int32(7), dev(0), dev(0), dev(0)))
    with pytest.raises(fj.InvariantViolation) as info:
        fj.raise_if_violated(err)
    assert info.value.invariant == "forward mode"


@pytest.mark.parametrize("mode", [7, -1, True, 1.0, "DECODE", None, torch.tensor(1)])
def test_fm_torch_refuses_a_mode_that_is_not_a_forward_mode(mode: Any) -> None:
    """Pins fm_torch taking any forward_mode (7, -1, "DECODE", None) and leaving -slot in
    seq_lens for a mode that is not DECODE; True and 1.0 are not DECODE either."""
    fm = ft.FutureMap(R)
    batch = ft.ScheduleBatch(mode, t(3), t(-3), t(-3))
    with pytest.raises(ft.FutureMapError, match="forward_mode must be a ForwardMode"):
        fm.resolve(batch)
    assert batch.seq_lens.tolist() == [-3] and batch.forward_mode is mode


def test_both_twins_take_the_forward_modes_as_ints_and_enums_alike() -> None:
    """Pins the twins' one rule for a host mode accepting different spellings: a
    ForwardMode member of either package, a plain int and a numpy int all run."""
    for mode in (fj.ForwardMode.DECODE, ft.ForwardMode.DECODE, 1, np.int64(1)):
        tm = ft.FutureMap(R)
        tm.publish(t(3), t(5))
        batch = ft.ScheduleBatch(mode, t(3), t(-3), t(-3))
        tm.resolve(batch)
        jm = jax_map(debug=False)
        jm.publish(np.array([3]), np.array([5]))
        out = jm.resolve(fj.Batch(mode, np.array([3]), np.array([-3]), np.array([-3])))
        assert batch.seq_lens.tolist() == [5] and np.asarray(out.seq_lens)[:1].tolist() == [5]


# --------------------------------------------------------------- int64 under x64 (subprocess)
def _x64_inner() -> dict[str, Any]:
    """With x64 on: int64 jax arrays into an int32 map, every entry point; the report."""
    assert jax.config.read("jax_enable_x64")
    spec = fj.SpecConfig(2, 0)
    rows: list[dict[str, Any]] = []

    def case(name: str, fm: Any, field: str, call: Any) -> None:
        before = {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}
        try:
            call()
            kind, msg = "accepted", ""
        except fj.FutureMapError as e:
            kind, msg = "refused", str(e)
        except Exception as e:  # noqa: BLE001  # the test judges the type
            kind, msg = type(e).__name__, str(e)
        after = {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}
        rows.append({"name": name, "kind": kind, "named": field in msg, "intact": after == before})

    i64 = lambda *xs: jnp.asarray(np.array(xs, np.int64))  # noqa: E731
    i32 = lambda *xs: jnp.asarray(np.array(xs, np.int32))  # noqa: E731
    sentinel = -(2**32) + 3  # truncated to int32, it would no longer be this sentinel
    slots, lens = i32(3, 4), i32(-3, -4)
    bad_ids = fj.Batch(DECODE, slots, i64(sentinel, -4), lens)
    bad_slots = fj.Batch(DECODE, i64(3, 4), i32(-3, -4), lens)
    host = fj.Batch(DECODE, np.array([3]), np.array([sentinel]), np.array([-3]))

    def on_int32_map(debug: bool) -> None:
        fm = fj.FutureMap(R, debug=debug, batch_buckets=(2,), token_buckets=(2,))
        assert fm.dtype == np.int32
        fm.publish(np.array([3, 4]), np.array([5, 6]))
        fm.stash(np.array([3, 4]), np.array([33, 44]))
        d = f"debug={debug}"
        case(f"resolve input_ids {d}", fm, "input_ids", lambda: fm.resolve(bad_ids))
        case(f"resolve slots {d}", fm, "req_pool_indices", lambda: fm.resolve(bad_slots))
        case(f"publish slots {d}", fm, "indices", lambda: fm.publish(i64(3, 4), i32(1, 1)))
        case(f"publish lens {d}", fm, "new_seq_lens", lambda: fm.publish(slots, i64(2**32, 1)))
        case(f"stash tokens {d}", fm, "tokens", lambda: fm.stash(slots, i64(2**32 + 7, 1)))
        case(f"host sentinel {d}", fm, "input_ids", lambda: fm.resolve(host))

    on_int32_map(False)
    on_int32_map(True)
    sm = fj.FutureMap(R, spec=spec, batch_buckets=(2,), token_buckets=(2,))
    wide_k = jnp.full((2, 2), 2**32 + 5, jnp.int64)
    draft = fj.DraftPayload(i32(1, 2), jnp.zeros((2, 2), jnp.float32), wide_k)
    case("stash topk_index", sm, "topk_index", lambda: sm.stash(i32(3, 4), draft))
    ops = fj.future_map(R)
    st = ops.init()
    pure = [
        (
            "ops resolve input_ids",
            "input_ids",
            lambda: jax.jit(ops.resolve)(
                st, fj.Batch(jnp.int32(1), i32(3), i64(sentinel), i32(-3))
            ),
        ),
        ("ops publish lens", "new_seq_lens", lambda: jax.jit(ops.publish)(st, i32(3), i64(2**32))),
        ("ops stash slots", "indices", lambda: jax.jit(ops.stash)(st, i64(3), i32(1))),
    ]
    for name, field, call in pure:
        try:
            call()
            kind, msg = "accepted", ""
        except fj.FutureMapError as e:
            kind, msg = "refused", str(e)
        rows.append({"name": name, "kind": kind, "named": field in msg, "intact": True})
    wide = fj.FutureMap(R, dtype=jnp.int64, batch_buckets=(2,), token_buckets=(2,))
    wide.stash(i64(3, 4), i64(2**32 + 7, 1))  # an int64 map takes int64 values whole
    out = wide.resolve(fj.Batch(MIXED, i64(3, 4), i64(-3, -4), i64(1, 1)))
    got = int(np.asarray(out.input_ids)[0])
    return {"rows": rows, "wide": got}


@pytest.fixture(scope="module")
def x64_report() -> dict[str, Any]:
    env = dict(os.environ, JAX_ENABLE_X64="1")
    return call_in_child(__file__, "_x64_inner", env, timeout=300)  # type: ignore[no-any-return]


def test_int64_device_arrays_into_an_int32_map_are_refused_under_x64(x64_report) -> None:
    """Pins int64 device arrays into an int32 map (x64 on) being truncated silently, debug
    included (a sentinel -(2**32) + 3 resolving another slot's token, errors naming the
    truncated slot): every entry point, the pure ops when traced included, refuses them
    naming the field and writes nothing; an int64 map takes them whole."""
    rows = x64_report["rows"]
    assert len(rows) == 16
    for row in rows:
        assert row["kind"] == "refused" and row["named"] and row["intact"], row
    assert x64_report["wide"] == 2**32 + 7


# --------------------------------------------------------- negative tokens and lengths
def test_a_negative_token_from_the_device_is_reported_at_its_stash() -> None:
    """Pins a stashed -1 being stored silently and read later as an RR (a consume
    violation blamed on the wrong op): debug mode reports the stash, naming the slot."""
    fm = jax_map()
    fm.publish(np.array([3, 4]), np.array([5, 5]))
    fm.stash(dev(3, 4), dev(7, -1))  # a forward's tokens, on the device
    got = violation(fm)
    assert (got.invariant, got.op, got.slots) == ("stashed tokens >= 0", "stash", [4])


def test_a_negative_length_from_the_device_is_reported_at_its_publish() -> None:
    """Pins a published negative length being stored silently (read later as a sentinel,
    or as an unpublished length at the next DECODE)."""
    fm = jax_map()
    fm.publish(dev(3, 4), dev(-2, 5))
    got = violation(fm)
    assert (got.invariant, got.op, got.slots) == ("published lengths >= 0", "publish", [3])


def test_finish_checks_device_values_even_on_slots_resolve_checked() -> None:
    """Pins the tail op skipping its device checks for the slots the last resolve checked,
    and with them the check of the forward's tokens and lengths."""
    fm = jax_map()
    fm.publish(np.array([3, 4]), np.array([5, 5]))
    fm.stash(np.array([3, 4]), np.array([7, 8]))
    idx = dev(3, 4)
    batch = fj.Batch(DECODE, idx, -idx, -idx)
    fm.resolve(batch)
    fm.check()
    fm.finish(batch, idx, dev(6, 6), dev(9, -4))
    got = violation(fm)
    assert (got.invariant, got.op, got.slots) == ("stashed tokens >= 0", "finish", [4])


def test_host_negative_tokens_and_lengths_are_refused_by_both_twins() -> None:
    """Pins host tokens and lengths below 0 being stored (both twins, debug or not):
    refused before anything is written, naming the field."""
    for debug in (False, True):
        fm = jax_map(debug)
        with pytest.raises(fj.FutureMapError, match=r"tokens holds negative values \[-1\]"):
            fm.stash(np.array([3]), np.array([-1]))
        with pytest.raises(fj.FutureMapError, match="new_seq_lens holds negative"):
            fm.publish(np.array([3]), np.array([-3]))
        tm = ft.FutureMap(R, debug=debug)
        with pytest.raises(ft.FutureMapError, match=r"tokens holds negative values \[-1\]"):
            tm.stash(t(3), t(-1))
        with pytest.raises(ft.FutureMapError, match="new_seq_lens holds negative"):
            tm.publish(t(3), t(-3))


def test_pure_ops_report_negative_relayed_values() -> None:
    """Pins the pure publish and stash under an engine's checkify storing negative values
    without a word."""
    ops = fj.future_map(R, debug=True)
    stash = jax.jit(checkify.checkify(ops.stash, errors=checkify.user_checks))
    publish = jax.jit(checkify.checkify(ops.publish, errors=checkify.user_checks))
    err, st = stash(ops.init(), dev(2, 0), dev(1, -9))
    with pytest.raises(fj.InvariantViolation, match="slot 0") as info:
        fj.raise_if_violated(err)  # a padding row's token is a token too: never negative
    assert info.value.invariant == "stashed tokens >= 0"
    err, _ = publish(st, dev(5, 6), dev(-1, 2))
    with pytest.raises(fj.InvariantViolation, match="slot 5") as info:
        fj.raise_if_violated(err)
    assert info.value.invariant == "published lengths >= 0"


# ------------------------------------------------------------ consume: the slots read
def _both_twins_read(slots_in_batch: list[int], sentinels: list[int]) -> tuple[Any, Any]:
    """Stash slots 5 and 4, then resolve a MIXED batch of `slots_in_batch` carrying
    `sentinels`, twice, on both twins (debug). Every call's rows are a bucket size: the
    class pads nothing, so slot 0 compares too. Returns (fm_jax violation, fm_torch's)."""
    fm = jax_map()
    tm = ft.FutureMap(R, dtype=torch.int32, debug=True)
    fm.stash(np.array([5, 4]), np.array([9, 8]))
    tm.stash(t(5, 4), t(9, 8))
    idx, ids = np.array(slots_in_batch), np.array(sentinels)
    lens = np.full(len(slots_in_batch), 3)
    out = fm.resolve(fj.Batch(MIXED, idx, ids, lens))
    batch = ft.ScheduleBatch(ft.ForwardMode.MIXED, t(*idx), t(*ids), t(*lens))
    tm.resolve(batch)
    fm.check()
    assert np.asarray(out.input_ids)[: len(ids)].tolist() == batch.input_ids.tolist()
    assert 9 in batch.input_ids.tolist()
    got_jax = got_torch = None
    jax_tokens = np.asarray(fm.buffers()["output_tokens"])
    assert jax_tokens.tobytes() == tm.output_tokens.numpy().tobytes()
    fm.resolve(fj.Batch(MIXED, idx, ids, lens))
    try:
        fm.check()
    except fj.InvariantViolation as e:
        got_jax = e
    try:
        tm.resolve(ft.ScheduleBatch(ft.ForwardMode.MIXED, t(*idx), t(*ids), t(*lens)))
    except ft.InvariantViolation as e:
        got_torch = e
    return got_jax, got_torch


def test_a_sentinel_naming_a_slot_outside_the_batch_is_consumed_by_its_read() -> None:
    """Pins the consume poison going only to the batch's req_pool_indices, so that a
    sentinel naming a slot outside the batch could be read any number of times unflagged:
    the slot read is poisoned too, and the second read is caught, by both twins alike."""
    got_jax, got_torch = _both_twins_read([1, 2], [4, -5])  # slot 5 is not in the batch
    assert got_jax is not None and got_torch is not None
    assert (got_jax.invariant, got_jax.slots) == ("consume (WRWR)", [5])
    assert (got_torch.invariant, got_torch.slots) == ("consume (WRWR)", [5])


def test_a_valid_batch_poisons_exactly_its_own_slots() -> None:
    """Pins the extra poison touching anything on a valid batch (every sentinel names a
    slot of the batch; padding rows read nothing): the buffer after resolve equals SGLang's,
    -1 at the batch's slots and nothing else changed, in both twins."""
    fm = jax_map()
    tm = ft.FutureMap(R, dtype=torch.int32, debug=True)
    for slots, tokens in (([0, 1, 2, 3], [50, 11, 12, 13]), ([6, 5], [16, 15])):
        fm.stash(np.array(slots), np.array(tokens))
        tm.stash(t(*slots), t(*tokens))
    # MIXED: prefill slot 2 (one token), decode slot 3; rows and tokens a bucket (no padding)
    idx, ids, lens = [2, 3], [7, -3], [4, 4]
    fm.resolve(fj.Batch(MIXED, np.array(idx), np.array(ids), np.array(lens)))
    tm.resolve(ft.ScheduleBatch(ft.ForwardMode.MIXED, t(*idx), t(*ids), t(*lens)))
    fm.check()
    # Slot 0 is in no row of this batch: its (garbage) 50 stays. Slots 4, 7: never written.
    want = np.array([50, 11, -1, -1, -1, 15, 16, -1], np.int32)
    assert np.asarray(fm.buffers()["output_tokens"]).tobytes() == want.tobytes()
    assert tm.output_tokens.numpy().tobytes() == want.tobytes()


# ------------------------------------------------------------- host lengths, step count
@pytest.mark.parametrize("path", ["host lengths", "device lengths", "gathered", "engine step"])
def test_resolve_seq_lens_cpu_returns_an_array_of_the_callers_own(path: str) -> None:
    """Pins `resolve_seq_lens_cpu` handing out a writable view of the map's own host copy
    of the last published lengths (a caller's `+= 1` changed what the next read returned)
    on one path and a read-only array on others: every path returns a fresh writable array
    that the map keeps no reference to."""
    fm = fj.FutureMap(
        R, batch_buckets=(2, 4), token_buckets=(2, 4), needs_cpu_seq_lens=path != "gathered"
    )
    slots = np.array([3, 5], np.int32)
    if path == "engine step":
        step = fm.engine_step(lambda r, b, i: fj.StepOutput(r.seq_lens + 1, r.input_ids))
        step(fj.Batch(fj.ForwardMode.EXTEND, slots, np.array([1, 2], np.int32), a(4, 6)))
    elif path == "device lengths":
        fm.publish(slots, dev(5, 7))
    else:
        fm.publish(slots, a(5, 7))
    got = fm.resolve_seq_lens_cpu(slots)
    assert got.tolist() == [5, 7] and got.flags.writeable
    got += 1
    assert fm.resolve_seq_lens_cpu(slots).tolist() == [5, 7]


def test_a_forward_failing_while_traced_leaves_the_step_count_as_it_was() -> None:
    """Pins a failure inside an engine step that is not a FutureMapError (the engine's
    forward raising while traced) leaving `fm.step` advanced, so that later debug
    violations named the wrong step."""
    fm = fj.FutureMap(R, debug=True, batch_buckets=(2, 4), token_buckets=(2, 4))

    def broken(r: Any, b: Any, i: Any) -> Any:
        raise RuntimeError("the engine's model failed")

    step = fm.engine_step(broken)
    batch = fj.Batch(fj.ForwardMode.EXTEND, np.array([3], np.int32), a(1), a(1))
    with pytest.raises(RuntimeError, match="model failed"):
        step(batch)
    assert fm.step == 0
    fm.resolve(fj.Batch(DECODE, np.array([3]), np.array([-3]), np.array([-3])))
    assert violation(fm).step == 1  # slot 3 never stashed: the first step's read


# --------------------------------------------------------------------- complex host leaves
def test_complex_host_rows_are_packed_like_every_other_dtype() -> None:
    """Pins a complex host leaf in a packed call raising JAX's raw TypeError (no bitcast
    makes a complex number): a declared complex64 field stashed and resolved keeps its
    bytes, its warm-up compiles, and an engine step (always packed) takes a complex
    StepInput and returns its bytes."""
    field = fj.RelayField("phase", (2,), np.complex64)
    spec = fj.SpecConfig(topk=0, extra=(field,))
    z = np.array([[1 + 2j, -0.0 + 3j], [complex(np.inf, -1), 0j]], np.complex64)
    z.view(np.uint32).reshape(-1)[1] = 0x7FC00123  # a NaN payload in an imaginary part
    fm = fj.FutureMap(R, spec=spec, batch_buckets=(2,), token_buckets=(2,))
    fm.warm_up(guard=True)
    fm.stash(a(1, 2), fj.DraftPayload(bonus_tokens=a(5, 6), extras={"phase": z}))
    r = fm.resolve(fj.Batch(DECODE, a(1, 2), a(0, 0), a(1, 1), draft_indices=a(1, 2)))
    assert r.draft is not None and r.draft.extras is not None
    assert np.asarray(r.draft.extras["phase"])[:2].tobytes() == z.tobytes()
    fm = fj.FutureMap(R, batch_buckets=(2,), token_buckets=(2,))
    declared = [fj.StepInput("w", "row", (), np.complex64)]
    step = fm.engine_step(
        lambda r, b, i: fj.StepOutput(r.seq_lens + 1, r.input_ids, i["w"]), inputs=declared
    )
    w = z[:, 1].copy()
    out = step(fj.Batch(fj.ForwardMode.EXTEND, a(1, 2), a(3, 4), a(1, 1)), inputs={"w": w}).out
    assert np.asarray(out)[:2].tobytes() == w.tobytes()


# ------------------------------------------------------------------ relay field dtypes
def _float_dtypes() -> list[np.dtype]:
    """Every real float a relay field may declare here: float16/32, bfloat16 and each whole-
    byte float8 of ml_dtypes that JAX stores."""
    import ml_dtypes

    names = ["float16", "float32", "bfloat16"]
    names += sorted(n for n in dir(ml_dtypes) if n.startswith("float8_"))
    out = []
    for n in names:
        dt = np.dtype(getattr(ml_dtypes, n, None) or getattr(np, n))
        if jax.dtypes.canonicalize_dtype(dt) == dt:
            out.append(dt)
    return out


def _special_bits(dt: np.dtype) -> np.ndarray:
    """Bit patterns of `dt` a relay must keep: NaNs with payloads of both signs, -0.0 and the
    infinities (where `dt` has them), a few ordinary values; an 8-bit float: all 256."""
    u = np.dtype(f"uint{8 * dt.itemsize}")
    if dt.itemsize == 1:
        return np.arange(256, dtype=np.uint16).astype(u)
    if dt.itemsize == 2:
        every = np.arange(2**16, dtype=np.uint32).astype(u)
        nan = every[np.isnan(every.view(dt).astype(np.float32))]
        sign = np.array(1 << 15, u)
        nans = np.concatenate([nan[nan < sign][:4], nan[nan < sign][-2:], nan[nan > sign][-4:]])
    else:
        nans = np.array([0x7FC00001, 0x7F800001, 0x7FFFFFFF, 0xFFC00001, 0xFF812345], u)
    plain = np.array([-0.0, np.inf, -np.inf, 1.5, -2.0], np.float32).astype(dt).view(u)
    return np.concatenate([nans, plain])


def _torch_moves(tdt: torch.dtype) -> bool:
    """Whether this torch writes rows of `tdt` by index on CPU (it has no index_put for
    float8_e8m0fnu, so fm_torch relays no such field)."""
    try:
        torch.zeros(2, dtype=tdt)[torch.tensor([1])] = torch.zeros(1, dtype=tdt)
    except (NotImplementedError, RuntimeError):
        return False
    return True


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
@pytest.mark.parametrize("dt", _float_dtypes(), ids=str)
def test_every_float_field_relays_the_bytes_it_was_given(dt: np.dtype, kernel: str) -> None:
    """Pins a bfloat16 or float8 relay field (declared without bits=True) losing its bytes
    under the default kernel='xla': XLA:CPU's scatter went through f32, canonicalising NaN
    payloads (and, for e5m2, flipping a NaN's sign: 0xfd became 0x7f), while the Pallas
    kernel and fm_torch kept every byte. Every real float is now stored as its bits: the
    class (host rows) and the pure ops (device rows) resolve exactly the bytes stashed,
    NaN payloads of both signs, -0.0 and infinities included, under either kernel, and
    fm_torch's buffer holds the same bytes."""
    bits = _special_bits(dt)
    width = -(-bits.size // 2)
    rows = np.resize(bits, 2 * width).reshape(2, width)
    values = rows.view(dt)
    field = fj.RelayField("x", (width,), dt)
    spec = fj.SpecConfig(topk=0, bonus_tokens=False, extra=(field,), kernel=kernel)
    slots = a(3, 5)
    draft = fj.DraftPayload(extras={"x": values})
    batch = fj.Batch(DECODE, slots, a(0, 0), a(0, 0), draft_indices=slots)

    fm = fj.FutureMap(R, spec=spec, protocol="gather", batch_buckets=(2,), token_buckets=(2,))
    fm.publish(slots, a(4, 4))
    fm.stash(slots, draft)
    got = fm.resolve(batch).draft
    assert got is not None and got.extras is not None
    assert np.asarray(got.extras["x"])[:2].tobytes() == rows.tobytes()

    ops = fj.future_map(R, spec=spec, protocol="gather")
    dslots = jnp.asarray(slots)
    st = ops.stash(ops.init(), dslots, fj.DraftPayload(extras={"x": jnp.asarray(values)}))
    _, res = ops.resolve(st, batch._replace(req_pool_indices=dslots, draft_indices=dslots))
    assert res.draft is not None and res.draft.extras is not None
    assert np.asarray(res.draft.extras["x"]).tobytes() == rows.tobytes()

    tdt = getattr(torch, dt.name, None)
    if tdt is not None and _torch_moves(tdt):
        tm = ft.FutureMap(R, dtype=torch.int32, spec=True, protocol="gather")
        tvals = torch.from_numpy(rows.copy()).view(tdt)
        tm.stash(torch.tensor([3, 5]), ft.DraftPayload(extras={"x": tvals}))
        kept = tm.extras["x"][torch.tensor([3, 5])].view(torch.from_numpy(rows[:0]).dtype)
        assert kept.numpy().tobytes() == rows.tobytes()


def _int_fields_spec() -> fj.SpecConfig:
    """One field in the map's int dtype and one declared int32 (the map's too)."""
    fields = (fj.RelayField("steps"), fj.RelayField("accept", (2,), np.int32))
    return fj.SpecConfig(topk=0, bonus_tokens=False, extra=fields)


@pytest.mark.parametrize(
    ("steps", "accept", "ok"),
    [
        (np.array([2, 3]), np.array([[1, 2], [3, 4]]), True),  # numpy's default int64
        ([2, 3], [[1, 2], [3, 4]], True),  # Python lists (int64 as arrays)
        ([0, 0], [[0, 0], [0, 0]], True),
        (np.array([2, 3]), np.array([[1, 2**40], [3, 4]]), False),  # int64 beyond int32
        (np.array([2**31, 3]), np.array([[1, 2], [3, 4]]), False),
    ],
)
def test_both_twins_judge_int64_rows_for_an_int32_field_alike(
    steps: Any, accept: Any, ok: bool
) -> None:
    """Pins the twins judging int64 rows for an int32 field differently: fm_jax cast and
    stored them for a field in the map's int dtype (and refused them, as 'not a dtype the
    map stores', for one declared int32), fm_torch refused them once its first draft had
    fixed the field at int32. The rule (docs/CONTRACT.md, 'Relay fields'): an int field
    takes rows of any int dtype, cast when every value fits; a value that does not fit is
    refused naming the field, before anything is written."""
    first = {"steps": np.array([7, 7], np.int32), "accept": np.full((2, 2), 7, np.int32)}
    slots = a(3, 5)
    fm = fj.FutureMap(R, spec=_int_fields_spec(), protocol="gather", batch_buckets=(2,))
    tm = ft.FutureMap(R, dtype=torch.int32, spec=True, protocol="gather")
    fm.stash(slots, fj.DraftPayload(extras=first))
    tm.stash(t(3, 5), ft.DraftPayload(extras={k: torch.from_numpy(v) for k, v in first.items()}))
    given = {"steps": steps, "accept": accept}
    for _ in range(2):  # the general path, then the layout's recorded plan
        before = {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}
        tbefore = {k: v.numpy().tobytes() for k, v in tm.extras.items()}
        outcomes = []
        for stash in (
            lambda: fm.stash(slots, fj.DraftPayload(extras=given)),
            lambda: tm.stash(
                t(3, 5),
                ft.DraftPayload(extras={k: torch.tensor(np.asarray(v)) for k, v in given.items()}),
            ),
        ):
            try:
                stash()
                outcomes.append(None)
            except (fj.FutureMapError, ft.FutureMapError) as e:
                outcomes.append(str(e))
        if ok:
            assert outcomes == [None, None]
            for k, v in given.items():
                want = np.asarray(v, np.int32).tobytes()
                assert np.asarray(fm.state.extras[k])[[3, 5]].tobytes() == want, k  # type: ignore[index]
                assert tm.extras[k][[3, 5]].numpy().tobytes() == want, k
        else:
            assert all(o is not None and "do not fit" in o for o in outcomes), outcomes
            bad = "draft.steps" if np.max(np.asarray(steps)) > 2**31 - 1 else "draft.accept"
            assert all(o is not None and o.startswith(bad) for o in outcomes), outcomes
            assert {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()} == before
            assert {k: v.numpy().tobytes() for k, v in tm.extras.items()} == tbefore


# --------------------------------------------------------------------- messages that misled
def _pos_step(per: str) -> Any:
    fm = fj.FutureMap(R, batch_buckets=(2, 4), token_buckets=(4, 8))

    def forward(res: fj.Resolved, batch: fj.Batch, inputs: dict, w: jax.Array) -> Any:
        return fj.StepOutput(res.seq_lens + 1, res.seq_lens + inputs["pos"].sum(), w)

    return fm, fm.engine_step(forward, inputs=[fj.StepInput("pos", per)])


EXTEND_3 = fj.Batch(fj.ForwardMode.EXTEND, a(1, 2), a(3, 4, 5), a(1, 2))
"""A prefill of 2 rows and 3 tokens."""


@pytest.mark.parametrize("per", ["row", "token"])
def test_a_scalar_step_input_is_named_a_scalar(per: str) -> None:
    """Pins a 0-d StepInput refused as 'has shape [], declared rows of shape []', which
    names no difference: the message says it is a scalar where rows are wanted."""
    fm, step = _pos_step(per)
    with pytest.raises(fj.FutureMapError, match=r"inputs\['pos'\] is a scalar"):
        step(EXTEND_3, jnp.int32(0), inputs={"pos": np.int32(0)})
    assert fm.step == 0


def test_a_per_token_step_input_counts_tokens_not_indices() -> None:
    """Pins a per-token StepInput of the wrong length refused as '...has (2,) rows,
    indices have (3,)', where 3 counts the batch's tokens, not its indices: the message
    names the tokens (input_ids)."""
    _, step = _pos_step("token")
    with pytest.raises(fj.FutureMapError) as err:
        step(EXTEND_3, jnp.int32(0), inputs={"pos": a(0, 0)})
    assert "input_ids have (3,) tokens" in str(err.value) and "indices" not in str(err.value)
    _, step = _pos_step("row")
    with pytest.raises(fj.FutureMapError, match=r"has \(3,\) rows, indices have \(2,\)"):
        step(EXTEND_3, jnp.int32(0), inputs={"pos": a(0, 0, 0)})


@pytest.mark.parametrize("per", ["row", "token"])
def test_a_python_list_step_input_is_cast_where_its_values_fit(per: str) -> None:
    """Pins a list [0, 0] for an int32 StepInput refused as 'does not cast to the declared
    int32 without changing values' (numpy makes it int64, and the check asked whether every
    int64 would fit): int rows are cast where their values fit, as every int field's, and
    refused naming the values where one does not."""
    n = 2 if per == "row" else 3
    outs = []
    for pos in ([1] * n, np.ones(n, np.int64), np.ones(n, np.int32)):
        fm, step = _pos_step(per)
        outs.append(np.asarray(step(EXTEND_3, jnp.int32(0), inputs={"pos": pos}).out).tobytes())
    assert outs[0] == outs[1] == outs[2]
    fm, step = _pos_step(per)
    with pytest.raises(fj.FutureMapError, match=r"inputs\['pos'\] holds values that do not fit"):
        step(EXTEND_3, jnp.int32(0), inputs={"pos": [2**40] * n})
    assert fm.step == 0


def test_a_float_field_given_another_dtype_names_both_dtypes() -> None:
    """Pins rows of another dtype for a declared float field refused as 'not a dtype the
    map stores' (float64 without x64, or int64), or with the pure op's generic wording
    (float16): the class and the pure ops name the dtype given and the one declared, before
    anything is written."""
    spec = fj.SpecConfig(topk=0, bonus_tokens=False, extra=(fj.RelayField("p", (2,), np.float32),))
    fm = fj.FutureMap(R, spec=spec, batch_buckets=(2,))
    before = {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}
    for given in (np.ones((2, 2)), np.ones((2, 2), np.float16), [[1, 2], [3, 4]]):
        dtype = np.asarray(given).dtype
        want = rf"^draft.p has dtype {dtype}, declared float32"
        with pytest.raises(fj.FutureMapError, match=want):
            fm.stash(a(3, 5), fj.DraftPayload(extras={"p": given}))
    assert {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()} == before
    ops = fj.future_map(R, spec=spec)  # the pure ops, traced: the same refusal
    with pytest.raises(fj.FutureMapError, match=r"^draft.p has dtype float16, declared float32"):
        ops.stash(ops.init(), dev(3, 5), fj.DraftPayload(extras={"p": jnp.ones((2, 2), "f2")}))


# ------------------------------------------------------------------ what a forward returns
SPEC = fj.SpecConfig(topk=2, extra=(fj.RelayField("score", (), np.float32),))


def _draft(**change: Any) -> fj.DraftPayload:
    d = {
        "bonus_tokens": jnp.ones(2, jnp.int32),
        "topk_p": jnp.full((2, 2), 0.5, jnp.float32),
        "topk_index": jnp.ones((2, 2), jnp.int32),
        "extras": {"score": jnp.ones(2, jnp.float32)},
    }
    return fj.DraftPayload(**{**d, **change})


BAD_OUTPUTS = {
    "lens_list": (False, "new_seq_lens", "Python list", lambda r: ([4, 5], r.input_ids)),
    "lens_int": (False, "new_seq_lens", "Python int", lambda r: (4, r.input_ids)),
    "lens_0d": (False, "new_seq_lens", "0-d array", lambda r: (jnp.int32(4), r.input_ids)),
    "tokens_list": (False, "tokens", "Python list", lambda r: (r.seq_lens, [7, 8])),
    "tokens_int": (False, "tokens", "Python int", lambda r: (r.seq_lens, 7)),
    "tokens_0d": (False, "tokens", "0-d array", lambda r: (r.seq_lens, jnp.int32(7))),
    "tokens_none": (False, "tokens", "missing", lambda r: (r.seq_lens, None)),
    "bonus_list": (
        True,
        "draft.bonus_tokens",
        "Python list",
        lambda r: (r.seq_lens, _draft(bonus_tokens=[7, 8])),
    ),
    "topk_p_float": (
        True,
        "draft.topk_p",
        "Python float",
        lambda r: (r.seq_lens, _draft(topk_p=0.5)),
    ),
    "extra_0d": (
        True,
        "draft.score",
        "0-d array",
        lambda r: (r.seq_lens, _draft(extras={"score": jnp.float32(1)})),
    ),
    "extras_list": (
        True,
        "draft.extras",
        "mapping",
        lambda r: (r.seq_lens, _draft(extras=[jnp.ones(2, jnp.float32)])),
    ),
}


@pytest.mark.parametrize("name", BAD_OUTPUTS)
def test_a_step_output_that_is_no_array_of_rows_is_named(name: str) -> None:
    """Pins a forward whose StepOutput holds a Python list, a Python number or a 0-d
    array (as new_seq_lens, the tokens or a DraftPayload field) getting JAX's raw
    shard_map ValueError, and a DraftPayload whose `extras` is a list a raw AttributeError:
    each is a FutureMapError naming the field and what was expected, raised when the
    step is traced, with nothing run, donated or counted."""
    spec, field, what, out = BAD_OUTPUTS[name]
    fm = fj.FutureMap(R, spec=SPEC if spec else None, batch_buckets=(2,), token_buckets=(2,))
    fm.publish(a(1, 2), a(3, 4))
    before = {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}
    batch = fj.Batch(fj.ForwardMode.EXTEND, a(1, 2), a(3, 4), a(1, 1))
    step = fm.engine_step(lambda r, b, i, w: fj.StepOutput(*out(r), w), donate_argnums=(0,))
    w = jnp.zeros(3)
    with pytest.raises(fj.FutureMapError, match="StepOutput") as info:
        step(batch, w)
    head = f"the engine's forward returned a StepOutput the map cannot relay: {field} "
    assert str(info.value).startswith(head) and what in str(info.value), str(info.value)
    assert fm.step == 0 and not w.is_deleted()
    assert {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()} == before
    good = _draft() if spec else jnp.ones(2, jnp.int32)
    fm.engine_step(lambda r, b, i: fj.StepOutput(r.seq_lens, good))(batch)  # still serves
    assert fm.step == 1


@pytest.mark.parametrize("sharded", [False, True], ids=["ops", "sharded ops"])
def test_pure_ops_stash_names_extras_that_are_no_mapping(sharded: bool) -> None:
    """Pins the pure ops' stash raising a raw AttributeError for a DraftPayload whose
    `extras` is a list (the class names it): both check the payload's form in one place
    first, eagerly and under jit."""
    if sharded:
        ops: Any = fj.future_map(R, mesh=jax.make_mesh((1,), ("dp",)), spec=SPEC)
    else:
        ops = fj.future_map(R, spec=SPEC)
    state = ops.init()
    bad = _draft(extras=[jnp.ones(2, jnp.float32)])
    for fn in (ops.stash, jax.jit(ops.stash)):
        with pytest.raises(fj.FutureMapError, match="draft.extras must be a mapping"):
            fn(state, jnp.array([1, 2], jnp.int32), bad)


def test_sharded_stash_names_each_payload_row_that_is_no_array() -> None:
    """The sharded ops' stash checks every per-row value of its payload splits over the DP
    ranks, naming it: tokens on a map without spec, each declared draft field on a spec
    map (`payload_rows` lists them by the names the refusals use)."""
    mesh = jax.make_mesh((1,), ("dp",))
    slots = jnp.array([1, 2], jnp.int32)
    plain = fj.future_map(R, mesh=mesh)
    with pytest.raises(fj.FutureMapError) as info:
        plain.stash(plain.init(), slots, [3, 4])
    assert str(info.value) == "stash: tokens must be an array of rows [B, ...], got a Python list"
    spec = fj.future_map(R, mesh=mesh, spec=SPEC)
    for field in ("bonus_tokens", "score"):
        bad = _draft(**{field: 7}) if field == "bonus_tokens" else _draft(extras={"score": 7})
        with pytest.raises(fj.FutureMapError) as info:
            spec.stash(spec.init(), slots, bad)
        want = f"stash: draft.{field} must be an array of rows [B, ...], got a Python int (7)"
        assert str(info.value) == want


# ------------------------------------------------------------------ the step's own mode
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_a_warmed_step_hands_its_forward_each_host_mode(protocol: str) -> None:
    """An engine step given a host MIXED or IDLE batch ran the 'not DECODE' executable and
    handed its forward EXTEND. Each mode reaches the forward as given, fixed when traced
    (a Python int the forward may branch on), and warm-up compiles each: with the guard
    on, no mode the protocol serves is refused."""
    from compile_count import counting_compiles

    fm = fj.FutureMap(16, batch_buckets=(2,), token_buckets=(2, 4), protocol=protocol)
    seen: list[int] = []

    def forward(r: fj.Resolved, b: fj.Batch, inputs: Any) -> fj.StepOutput:
        assert isinstance(b.forward_mode, int)  # fixed: the forward may branch on it
        seen.append(b.forward_mode)
        return fj.StepOutput(r.seq_lens + 1, r.seq_lens, jnp.int32(b.forward_mode))

    step = fm.engine_step(forward)
    step.warm_up(guard=True, traced_modes=False)
    a = lambda *v: np.array(v, np.int32)  # noqa: E731
    E, M, I = fj.ForwardMode.EXTEND, fj.ForwardMode.MIXED, fj.ForwardMode.IDLE  # noqa: E741
    mixed_slots = a(0, 0, 2) if protocol == "gather" else None  # gather: MIXED brings slots
    batches = {
        E: fj.Batch(E, a(1, 2), a(5, 6, 7), a(2, 1)),
        M: fj.Batch(M, a(1, 2), a(5, 6, 7), a(2, 1), None, mixed_slots),
        I: fj.Batch(I, a(), a(), a()),
    }
    with counting_compiles() as counter:
        for mode, batch in batches.items():
            assert int(step(batch).out) == mode
    assert counter.executables == 0
    assert {fj.ForwardMode.MIXED, fj.ForwardMode.IDLE} <= set(seen)


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_a_guarded_step_serves_what_serving_passes(protocol: str) -> None:
    """After `EngineStep.warm_up(guard=True)` the guard refused jax-array batches and
    inputs at warmed shapes and traced modes (warm-up had packed them as host leaves,
    serving passes device leaves), and the batch a step returned (its sentinels padded
    to the token bucket its rows followed, or device sentinels beside host slots). Each is
    served now, with no compile."""
    from compile_count import counting_compiles

    fm = fj.FutureMap(16, batch_buckets=(2, 4), token_buckets=(2, 4), protocol=protocol)

    def forward(r: fj.Resolved, b: fj.Batch, inputs: Any) -> fj.StepOutput:
        return fj.StepOutput(r.seq_lens + 1, r.seq_lens + inputs["p"], r.input_ids)

    step = fm.engine_step(forward, inputs=[fj.StepInput("p", "row")])
    step.warm_up(guard=True)
    a = lambda *v: np.array(v, np.int32)  # noqa: E731
    E, D = fj.ForwardMode.EXTEND, fj.ForwardMode.DECODE
    s, neg, traced = jnp.array([1, 2], jnp.int32), jnp.array([-1, -2], jnp.int32), jnp.int32(D)
    # Every field a jax array, the mode fixed and traced (gather: a fixed DECODE's ids are
    # gathered, a traced one brings ids >= 0).
    sentinel = protocol == "sentinel"
    jax_batches = [
        fj.Batch(D, s, neg if sentinel else None, neg if sentinel else s),
        fj.Batch(traced, s, neg if sentinel else s, neg if sentinel else s),
    ]
    with counting_compiles() as counter:
        r = step(fj.Batch(E, a(1, 2), a(5, 6, 7), a(2, 1)), inputs={"p": a(0, 0)})
        for _ in range(3):  # the returned batch, fed back
            nxt = r.batch if sentinel else fj.Batch(D, a(1, 2), None, a(3, 2))
            r = step(nxt._replace(forward_mode=D), inputs={"p": a(0, 0)})
        for batch in jax_batches:
            step(batch, inputs={"p": s})
    assert counter.executables == 0
    # Every step ran: sentinel lengths resolved from the map (3, 2 after the prefill, +1 a
    # step), the gather protocol's the host's (the last batch's 1, 2, +1).
    assert fm.resolve_seq_lens_cpu(a(1, 2)).tolist() == ([8, 7] if sentinel else [2, 3])


# ------------------------------------------------------------- donation and lifetimes
def _failing_forward(fail: dict[str, bool]) -> Any:
    """An engine forward whose sampler is a host callback that raises while `fail["on"]`:
    a failure while the step runs, after the state was donated to it."""

    def sample(ids: np.ndarray) -> np.ndarray:
        if fail["on"]:
            raise RuntimeError("the sampler failed")
        return (ids + 1) % 50

    def forward(r: fj.Resolved, b: fj.Batch, i: Any, cache: jax.Array) -> fj.StepOutput:
        shape = jax.ShapeDtypeStruct(r.seq_lens.shape, r.seq_lens.dtype)
        tokens = jax.pure_callback(sample, shape, r.input_ids[: r.seq_lens.shape[0]])
        cache = cache.at[b.req_pool_indices].add(tokens)
        return fj.StepOutput(r.seq_lens + 1, tokens, cache)

    return forward


def _serve(fm: fj.FutureMap, step: Any, cache: jax.Array, n: int) -> tuple[Any, list]:
    """A prefill of slots 1 and 2, then `n - 1` decodes: the cache and each step's tokens."""
    slots = a(1, 2)
    batch: Any = fj.Batch(fj.ForwardMode.EXTEND, slots, a(3, 4), a(1, 1))
    outs = []
    for k in range(n):
        if k:
            batch = batch._replace(forward_mode=DECODE)
        r = step(batch, cache)
        cache, batch = r.out, r.batch
        outs.append(np.asarray(fm.resolve_seq_lens_cpu(slots)).tolist())
    return cache, outs


def test_a_forward_failing_while_the_step_runs_loses_the_map_by_name_until_reset() -> None:
    """Pins an engine step whose forward failed while it ran (a host callback raising)
    deleting the map's donated state and the engine's donated cache with no word: every
    later op raised a raw "Array has been deleted". Now the step raises StateLost naming
    what was lost (the map's buffers, the donated args consumed), chained from the
    failure; every op of the map raises it (its message, cause, call, step and consumed
    args) until `reset()`, after which serving gives the bytes a fresh map gives."""
    fail = {"on": False}
    fm = fj.FutureMap(R, batch_buckets=(2,), token_buckets=(2,))
    step = fm.engine_step(_failing_forward(fail), donate_argnums=(0,))
    cache, _ = _serve(fm, step, jnp.zeros(R, jnp.int32), 2)
    fail["on"] = True
    slots = a(1, 2)
    decode = fj.Batch(DECODE, slots, -slots, -slots)
    with pytest.raises(fj.StateLost, match=r"donated args consumed too: \[0\]") as info:
        step(decode, cache)
    lost = info.value
    assert isinstance(lost, fj.FutureMapError) and lost.consumed_args == (0,)
    assert lost.call == "the engine step" and lost.step == fm.step == 2
    assert "the sampler failed" in str(lost) and "output_tokens, new_seq_lens" in str(lost)
    assert str(lost).endswith(
        "relaying. The step's donated args consumed too: [0]; rebuild them. Every op of this "
        "map raises StateLost until FutureMap.reset() re-creates its initial state: then "
        "start every running request again (a new prefill)."
    )
    assert isinstance(lost.__cause__, Exception) and cache.is_deleted()
    refused = [
        lambda: fm.resolve(decode),
        lambda: fm.publish(slots, a(3, 3)),
        lambda: fm.stash(slots, a(3, 3)),
        lambda: fm.finish(decode, slots, a(3, 3), a(1, 1)),
        lambda: fm.invalidate(decode, slots),
        lambda: fm.resolve_seq_lens_cpu(slots),
        lambda: fm.check(),
        lambda: fm.buffers(),
        lambda: fm.state,
        lambda: fm.warm_up(),
        lambda: step(decode, jnp.zeros(R, jnp.int32)),
        lambda: step.warm_up(jnp.zeros(R, jnp.int32)),
    ]
    for call in refused:
        with pytest.raises(fj.StateLost) as again:
            call()
        assert str(again.value) == str(lost) and again.value.__cause__ is lost.__cause__
        got = again.value
        assert (got.call, got.step, got.consumed_args) == ("the engine step", 2, (0,))
    fail["on"] = False
    fm.reset()
    assert fm.step == 2
    assert fm.resolve_seq_lens_cpu(slots).tolist() == [0, 0]  # the last publish forgotten
    fresh = fj.FutureMap(R, batch_buckets=(2,), token_buckets=(2,))
    fresh_step = fresh.engine_step(_failing_forward(fail), donate_argnums=(0,))
    got = _serve(fm, step, jnp.zeros(R, jnp.int32), 3)
    want = _serve(fresh, fresh_step, jnp.zeros(R, jnp.int32), 3)
    assert got[1] == want[1] and np.asarray(got[0]).tolist() == np.asarray(want[0]).tolist()
    for name, buf in fresh.buffers().items():
        assert np.asarray(fm.buffers()[name]).tobytes() == np.asarray(buf).tobytes(), name


def test_a_step_refused_before_it_ran_leaves_the_map_whole() -> None:
    """The other side of StateLost: a step that fails before its executable runs (the
    forward raising while traced) consumes nothing, so the map keeps serving as it was."""
    fm = fj.FutureMap(R, batch_buckets=(2,), token_buckets=(2,))
    fm.publish(a(1, 2), a(5, 6))
    before = {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}

    def broken(r: Any, b: Any, i: Any, cache: Any) -> Any:
        raise RuntimeError("the engine's model failed")

    cache = jnp.zeros(R, jnp.int32)
    with pytest.raises(RuntimeError, match="model failed"):
        fm.engine_step(broken, donate_argnums=(0,))(fj.Batch(DECODE, a(1), a(-1), a(-1)), cache)
    assert not cache.is_deleted()
    assert {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()} == before
    assert fm.resolve_seq_lens_cpu(a(1, 2)).tolist() == [5, 6]


@pytest.mark.parametrize("op", ["finish", "resolve", "interrupted"])
def test_a_class_op_failing_while_it_runs_loses_the_map_by_name(op: str) -> None:
    """Pins a class op whose executable failed after consuming the donated state (on a GPU,
    any runtime error of the device) leaving deleted buffers and raw "Array has been
    deleted" errors: the op raises StateLost naming itself, and so does every later op
    until `reset()`. (Debug resolve donates the state too.) An interrupt stays an
    interrupt, the map lost all the same. The failed op took no step; a resolve after the
    reset takes one. A failure without a message is named by its type."""
    fm = fj.FutureMap(R, debug=True, batch_buckets=(2,), token_buckets=(2,))
    slots = a(1, 2)
    fm.finish(fj.Batch(fj.ForwardMode.EXTEND, slots, a(3, 4), a(1, 1)), slots, a(2, 2), a(7, 8))
    registry = fm._registry
    real = registry.executable
    words = ("device failure",) if op == "finish" else ()  # no message: its type alone

    def failing(*key: Any) -> Any:
        exe = real(*key)

        def run(*args: Any) -> Any:
            exe(*args)  # consumes the donated state
            raise KeyboardInterrupt if op == "interrupted" else RuntimeError(*words)

        return run

    registry.executable = failing  # type: ignore[method-assign]
    decode = fj.Batch(DECODE, slots, -slots, -slots)
    if op == "interrupted":
        with pytest.raises(KeyboardInterrupt):
            fm.finish(decode, slots, a(3, 3), a(9, 9))
    else:
        with pytest.raises(fj.StateLost, match=f"^{op} failed while it ran") as info:
            if op == "finish":
                fm.finish(decode, slots, a(3, 3), a(9, 9))
            else:
                fm.resolve(decode)
        assert info.value.call == op and info.value.consumed_args == ()
        assert str(info.value) == (
            f"{op} failed while it ran (RuntimeError: {''.join(words)}) after consuming the "
            "map's donated state: every slot's relay rows and lengths (output_tokens, "
            "new_seq_lens) are gone, and with them every request the map was relaying. Every "
            "op of this map raises StateLost until FutureMap.reset() re-creates its initial "
            "state: then start every running request again (a new prefill)."
        )
    registry.executable = real  # type: ignore[method-assign]
    with pytest.raises(fj.StateLost):
        fm.resolve(decode)
    fm.reset()
    fm.check()  # the failed op recorded no debug error
    fm.finish(fj.Batch(fj.ForwardMode.EXTEND, slots, a(3, 4), a(1, 1)), slots, a(2, 2), a(7, 8))
    r = fm.resolve(decode)
    assert np.asarray(r.input_ids)[:2].tolist() == [7, 8]
    assert fm.step == 1  # the resolve that failed took no step, this one did
    fm.check()


def test_donation_misuse_is_refused_by_name_and_the_map_keeps_serving() -> None:
    """Pins donation misuse surfacing as raw JAX errors: an engine argument an earlier step
    donated passed again, one of the map's own buffers passed as a step argument (donated
    or not), a deleted jax array given to a class op, and donate_argnums that are no
    sequence of indices. Each is a FutureMapError naming the argument, before anything
    runs: the map's buffers and the other arguments are as they were."""
    fm = fj.FutureMap(R, batch_buckets=(2,), token_buckets=(2,))

    def forward(r: fj.Resolved, b: fj.Batch, i: Any, w: Any, cache: Any) -> fj.StepOutput:
        tokens = r.input_ids[:2] + w.sum()
        return fj.StepOutput(r.seq_lens + 1, tokens, cache.at[b.req_pool_indices].add(tokens))

    step = fm.engine_step(forward, donate_argnums=(1,))
    slots = a(1, 2)
    batch = fj.Batch(fj.ForwardMode.EXTEND, slots, a(3, 4), a(1, 1))
    w, cache = jnp.ones(2, jnp.int32), jnp.zeros(R, jnp.int32)
    donated = cache
    cache = step(batch, w, cache).out
    before = {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}
    deleted = (
        "is a deleted jax array ({}): donated to an earlier call (an engine step returns the "
        "new one in its out) or deleted; nothing ran"
    )
    own = (
        "is the map's own buffer {!r} (fm.state, fm.buffers()), which the call donates: "
        "pass a copy (fm.buffers(copy=True)); nothing ran"
    )
    misuse = [  # the args, the one named, what it is
        ((w, donated), 1, deleted.format("int32[8]")),
        ((w, fm.buffers()["new_seq_lens"]), 1, own.format("new_seq_lens")),
        ((fm.state.output_tokens, cache), 0, own.format("output_tokens")),
    ]
    for args, i, what in misuse:
        with pytest.raises(fj.FutureMapError) as info:
            step(batch, *args)
        assert str(info.value) == f"engine step argument {i} (args[{i}]) {what}"
        assert not cache.is_deleted() and not w.is_deleted()
        assert {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()} == before
    assert fm.step == 1
    gone = jnp.array([3, 4], jnp.int32)
    gone.delete()
    with pytest.raises(fj.FutureMapError) as info:
        fm.publish(slots, gone)
    assert str(info.value) == "publish: an input " + deleted.format("int32[2]")
    for bad in (None, 1, ("1",), (True,)):
        with pytest.raises(fj.FutureMapError) as info:
            fm.engine_step(forward, donate_argnums=bad)  # type: ignore[arg-type]
        assert str(info.value) == (
            "donate_argnums must be a sequence of indices >= 0 into the step's args "
            f"(() for none), got {bad!r}"
        )
    cache = step(batch, w, cache).out
    assert fm.step == 2 and np.asarray(cache)[1:3].tolist() == [2 * 5, 2 * 6]


def test_device_lengths_donated_by_the_caller_after_publish_are_read_from_the_buffer() -> None:
    """Pins `resolve_seq_lens_cpu` raising a raw "Array has been deleted" after the engine
    donated the jax lengths it had published (the map kept the caller's array for its host
    copy), although the map's buffer holds them: the read gathers from the buffer."""
    fm = fj.FutureMap(R, batch_buckets=(2,), token_buckets=(2,))
    slots = a(1, 2)
    prefill = fj.Batch(fj.ForwardMode.EXTEND, slots, a(1, 2), a(1, 1))
    for op in ("publish", "finish"):
        lens = dev(5, 7) if op == "publish" else dev(6, 8)
        if op == "publish":
            fm.publish(slots, lens)
        else:
            fm.finish(prefill, slots, lens, a(1, 1))
        want = np.asarray(lens).tolist()
        jax.jit(lambda x: x + 1, donate_argnums=0)(lens)
        assert lens.is_deleted()
        assert fm.resolve_seq_lens_cpu(slots).tolist() == want


def test_a_monitor_thread_reads_buffer_copies_while_others_serve() -> None:
    """Pins `fm.buffers()` and `fm.state` being read outside the map's lock, and offering
    nothing a monitoring thread could keep: its reads while others served raised raw "Array
    has been deleted". `buffers(copy=True)` copies under the lock: a monitor reads every
    value while two threads serve, and a copy outlives the ops after it."""
    import threading

    fm = fj.FutureMap(R, batch_buckets=(2,), token_buckets=(2,))
    errors: list[BaseException] = []
    stop = threading.Event()

    def serve(slot: int) -> None:
        try:
            for k in range(150):
                fm.publish(a(slot), a(k + 1))
                fm.stash(a(slot), a(k))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    seen: list[int] = []

    def monitor() -> None:
        try:
            while not seen or not stop.is_set():
                copies = fm.buffers(copy=True)
                seen.append(int(np.asarray(copies["new_seq_lens"]).max()))
                assert np.asarray(copies["output_tokens"]).shape == (R,)
                fm.state  # noqa: B018 - the read itself, under the lock
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    reader = threading.Thread(target=monitor)
    reader.start()
    servers = [threading.Thread(target=serve, args=(s,)) for s in (1, 2)]
    for th in servers:
        th.start()
    for th in servers:
        th.join()
    stop.set()
    reader.join()
    assert errors == [] and seen and max(seen) <= 150
    kept = fm.buffers(copy=True)
    fm.publish(a(1, 2), a(9, 9))
    assert np.asarray(kept["new_seq_lens"])[1:3].tolist() == [150, 150]
    assert np.asarray(fm.buffers()["new_seq_lens"])[1:3].tolist() == [9, 9]


def test_a_jax_fed_step_result_feeds_back_when_the_batch_bucket_is_no_token_bucket() -> None:
    """The batch a step returns is the batch for the next step, whatever the buckets. With
    jax slots, rows bucket 4 and token buckets (2, 8), the step's sentinel ids came at the
    rows' size, 4, which is no token bucket: the DECODE built from them was refused, and
    warm-up's jax-fed DECODE variant raised. The ids now come padded to the token bucket
    of the rows (8), and a guarded warm-up serves the DECODE."""
    fm = fj.FutureMap(16, batch_buckets=(4,), token_buckets=(2, 8))

    def forward(res: Any, batch: Any, inputs: Any) -> Any:
        rows = res.seq_lens.shape[0]
        return fj.StepOutput(res.seq_lens + 1, res.input_ids[:rows] + 1, res.input_ids)

    step = fm.engine_step(forward)
    step.warm_up(guard=True)
    slots = jnp.array([1, 2, 3, 0], jnp.int32)
    ids = jnp.array([5, 6, 7, 0, 0, 0, 0, 0], jnp.int32)
    res = step(fj.Batch(fj.ForwardMode.EXTEND, slots, ids, jnp.array([1, 1, 1, 0], jnp.int32)))
    np.testing.assert_array_equal(res.batch.input_ids, [-1, -2, -3, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(res.batch.seq_lens, [-1, -2, -3, 0])
    again = step(res.batch._replace(forward_mode=fj.ForwardMode.DECODE))
    np.testing.assert_array_equal(np.asarray(again.out)[:3], [6, 7, 8])  # the stashed tokens
    assert again.batch.input_ids.shape == (8,)


@pytest.mark.parametrize("given", ["host", "jax"])
def test_the_batch_finish_returns_feeds_back_when_the_batch_bucket_is_no_token_bucket(
    given: str,
) -> None:
    """`finish` returns the batch for the next step: with rows bucket 4 and token buckets
    (2, 8) its sentinel ids (a device array, from host or jax slots) came at the rows'
    size, 4, no token bucket, and resolving the DECODE built from them was refused. Jax
    slots' now come padded to 8, host slots' as a host array of their real rows (placed
    again as a host batch, CONTRACT 'Sentinels'), and the DECODE resolves the stashed
    tokens."""
    fm = fj.FutureMap(16, batch_buckets=(4,), token_buckets=(2, 8))
    if given == "host":
        slots: Any = np.array([1, 2, 3], np.int32)
        ids: Any = np.array([5, 6, 7], np.int32)
        lens, tokens = np.array([2, 2, 2], np.int32), np.array([9, 8, 7], np.int32)
    else:
        slots = jnp.array([1, 2, 3, 0], jnp.int32)
        ids = jnp.array([5, 6, 7, 0, 0, 0, 0, 0], jnp.int32)
        lens, tokens = jnp.array([2, 2, 2, 0], jnp.int32), jnp.array([9, 8, 7, 0], jnp.int32)
    batch = fj.Batch(fj.ForwardMode.EXTEND, slots, ids, lens - 1)
    fm.resolve(batch)
    after = fm.finish(batch, slots, lens, tokens)
    want = ((3,), (3,)) if given == "host" else ((8,), (4,))
    assert (after.input_ids.shape, after.seq_lens.shape) == want
    res = fm.resolve(after._replace(forward_mode=fj.ForwardMode.DECODE))
    np.testing.assert_array_equal(np.asarray(res.input_ids)[:3], [9, 8, 7])
    np.testing.assert_array_equal(np.asarray(res.seq_lens)[:3], [2, 2, 2])
