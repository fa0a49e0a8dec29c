"""The class's one-op entry points fed one packed host buffer (`pack_inputs`).

A packed map must leave the same bytes as an unpacked one (every op, both protocols, debug
on and off, spec with bf16 hidden states), send a call's host arrays in one transfer, and
keep the serving guard whole: warm-up covers the packed host calls and the unpacked ones
that bring jax arrays.

Beneath them, `fm_jax.host.packing` itself: `pack` and `unpack` round-trip every dtype
bit for bit, key the layout by shape, dtype and placement, and cost no kernel of their own.
"""

from __future__ import annotations

import os
import re
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fm_jax as fj
from fm_bench.child import child_report
from fm_jax.host import packing

R = 32
BATCH, TOKENS = (4, 16, 32), (4, 16, 64)
E, D, M = fj.ForwardMode.EXTEND, fj.ForwardMode.DECODE, fj.ForwardMode.MIXED
SPEC = fj.SpecConfig(topk=2, hidden=3, hidden_dtype=jnp.bfloat16)


def a(*x: int) -> np.ndarray:
    return np.array(x, np.int32)


def make(pack: bool, protocol: str, debug: bool, spec: bool = False) -> fj.FutureMap:
    return fj.FutureMap(
        R,
        pack_inputs=pack,
        protocol=protocol,
        debug=debug,
        spec=SPEC if spec else None,
        batch_buckets=BATCH,
        token_buckets=TOKENS,
    )


def to_bytes(tree: Any) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def draft(rng: np.random.Generator, n: int) -> fj.DraftPayload:
    """A spec payload of n rows; hidden states with NaN payloads and -0.0 (bytes matter)."""
    hidden = rng.standard_normal((n, 3)).astype(np.float32)
    hidden[:, 0] = -0.0
    bits = hidden.view(np.uint32)
    bits[:, 1] = 0x7FC00001  # a NaN with a payload
    return fj.DraftPayload(
        rng.integers(0, 99, n).astype(np.int32),
        rng.random((n, 2), np.float32),
        rng.integers(0, 99, (n, 2)).astype(np.int32),
        jnp.asarray(hidden, jnp.bfloat16).__array__(),
    )


def steps(fm: fj.FutureMap, seed: int) -> list[bytes]:
    """A seeded overlap loop (prefill, EXTEND, DECODE, MIXED, idle, a traced mode, a jax-fed
    tail) through one map; every output's and the final buffers' bytes."""
    rng = np.random.default_rng(seed)
    gather, spec = fm.protocol == "gather", fm.spec is not None
    out: list[bytes] = []
    live = np.arange(1, R, dtype=np.int32)

    def payload(n: int) -> Any:
        return draft(rng, n) if spec else rng.integers(0, 99, n).astype(np.int32)

    fm.publish(live, np.full(len(live), 3, np.int32))
    fm.stash(live, payload(len(live)))
    for step in range(12):
        n = int(rng.integers(1, 5))
        idx = rng.choice(live, n, replace=False).astype(np.int32)
        kind = step % 4
        if kind == 0:  # EXTEND: real ids and lengths
            t = int(rng.integers(n, 3 * n + 1))
            batch = fj.Batch(E, idx, rng.integers(0, 99, t).astype(np.int32), np.ones(n, np.int32))
        elif kind == 1:  # DECODE
            if gather:
                batch = fj.Batch(D, idx, a(*idx) if spec else None, np.zeros(n, np.int32))
            else:
                batch = fj.Batch(D, idx, -idx, -idx)
            if spec:
                batch = batch._replace(draft_indices=idx)
        elif kind == 2 and (gather or not spec):  # MIXED: a prefill row, then running rows
            # (a spec MIXED batch is a gather-protocol feature: the sentinel one refuses it)
            ids = np.r_[rng.integers(0, 99, 3), -idx[1:]].astype(np.int32)
            slots = np.r_[np.zeros(3, np.int32), idx[1:]].astype(np.int32)
            batch = fj.Batch(M, idx, ids, np.full(n, 5, np.int32))
            if gather:
                batch = batch._replace(input_ids=np.where(slots > 0, 0, ids), token_slots=slots)
        elif kind == 2:  # spec, sentinel protocol: an EXTEND of 3 tokens per row instead
            batch = fj.Batch(E, idx, rng.integers(0, 99, 3 * n).astype(np.int32), idx)
        else:  # the same kind traced (a jax mode: this call brings a jax array)
            batch = fj.Batch(jnp.int32(E), idx, rng.integers(0, 99, n).astype(np.int32), idx)
        out += to_bytes(fm.resolve(batch))
        lens = rng.integers(1, 9, n).astype(np.int32)
        if step % 3 == 2:  # the forward's outputs on the device, the slots on the host
            padded = np.zeros(BATCH[0], np.int32)  # n <= 4: the smallest bucket
            padded[:n] = lens
            fm.publish(idx, jax.device_put(padded))
            fm.stash(idx, payload(n))
            if not gather:
                out += to_bytes(fm.invalidate(batch, idx))
        else:
            out += to_bytes(fm.finish(batch, idx, lens, payload(n)))
    fm.finish(fj.Batch(fj.ForwardMode.IDLE, a(), a(), a()), a(), a(), payload(0))
    if spec:
        out.append(np.asarray(fm.resolve_seq_lens_cpu(live[:5])).tobytes())
    fm.check()
    return out + to_bytes(fm.state)


@pytest.mark.parametrize("spec", [False, True], ids=["tokens", "spec"])
@pytest.mark.parametrize("debug", [False, True], ids=["prod", "debug"])
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_a_packed_map_leaves_the_same_bytes(protocol: str, debug: bool, spec: bool) -> None:
    """Every output and buffer of a seeded loop, byte for byte, with and without packing
    (host calls packed; calls with a traced mode or device lengths unpacked)."""
    assert steps(make(True, protocol, debug, spec), 7) == steps(
        make(False, protocol, debug, spec), 7
    )


def _transfers(capfd: pytest.CaptureFixture[str], call: Any) -> int:
    """Host-to-device transfers `call` makes (JAX's transfer guard logs each one)."""
    capfd.readouterr()
    with jax.transfer_guard_host_to_device("log"):
        jax.block_until_ready(call())
    return len(re.findall("host-to-device transfer", capfd.readouterr().err))


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_a_host_call_is_one_transfer(protocol: str, capfd: pytest.CaptureFixture[str]) -> None:
    """Each one-op entry point fed host arrays makes one transfer when packed, one per
    array when not; a call that brings a jax array passes its host arrays as they are."""
    counts = {}
    ext = fj.Batch(E, a(3, 5), a(7, 8, 9), a(2, 1))

    def calls(fm: fj.FutureMap) -> dict[str, Any]:
        return {
            "publish": lambda: fm.publish(a(3, 5), a(4, 4)),
            "stash": lambda: fm.stash(a(3, 5), a(11, 12)),
            "finish": lambda: fm.finish(ext, a(3, 5), a(3, 2), a(11, 12)).req_pool_indices,
            "resolve": lambda: fm.resolve(ext),
            "finish, device lengths": lambda: (
                fm.finish(ext, a(3, 5), jax.device_put(a(3, 2, 0, 0)), a(11, 12)).req_pool_indices
            ),
        }

    for pack in (False, True):
        for name, call in calls(make(pack, protocol, debug=False)).items():
            call()  # compile first: a compile's own transfers are not the call's
            counts[pack, name] = _transfers(capfd, call)
    for name in ("publish", "stash", "finish", "resolve"):
        assert counts[True, name] == 1, (name, counts)
        assert counts[False, name] >= 2, (name, counts)
    # Its two host arrays (slots, tokens) go one by one, packed map or not.
    assert counts[True, "finish, device lengths"] == counts[False, "finish, device lengths"] == 2


@pytest.mark.parametrize("debug", [False, True], ids=["prod", "debug"])
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_the_guard_serves_packed_and_unpacked_calls_without_compiling(
    protocol: str, debug: bool
) -> None:
    """After warm_up(guard=True) a packed map runs the whole loop (host calls packed, jax
    arrays unpacked) without a compile; the report names the packed executables: every
    host-fed one's twin (a traced resolve on one device takes its mode as a jax array, so
    it is never fed the host alone)."""
    fm = make(True, protocol, debug)
    report = fm.warm_up(guard=True)
    packed = {k for k in report.by_op if k.endswith(" (packed)")}
    unpacked = {k for k in report.by_op if not k.endswith(" (packed)")}
    assert packed == {f"{k} (packed)" for k in unpacked - {"resolve"}}
    compiles: list[str] = []

    def listen(event: str, *_: Any, **__: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jnp.int32(E)  # the loop's traced mode, made before counting
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        steps(fm, 3)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


def test_refused_packed_calls_change_nothing() -> None:
    """A packed map refuses bad host input by name before anything runs: no buffer
    changes, no step counts; under the guard an unwarmed size is refused, not compiled."""
    fm = make(True, "sentinel", debug=False)
    fm.warm_up(guard=True)
    fm.publish(a(3, 5), a(4, 4))
    before, step = to_bytes(fm.state), fm.step
    with pytest.raises(fj.FutureMapError, match="outside"):
        fm.publish(a(3, R), a(4, 4))
    with pytest.raises(fj.FutureMapError, match="live slots"):
        fm.finish(fj.Batch(E, a(3, 3), a(1, 2), a(1, 1)), a(3, 3), a(1, 1), a(1, 1))
    with pytest.raises(fj.FutureMapError, match="tokens of 200 exceeds"):
        fm.resolve(fj.Batch(E, a(3, 5), np.arange(200, dtype=np.int32), a(1, 1)))
    dev = jax.device_put  # jax arrays at a (rows, tokens) pair warm-up did not plan
    with pytest.raises(fj.FutureMapError, match="4 rows x 16 tokens .*not compiled by warm_up"):
        fm.resolve(
            fj.Batch(E, dev(a(1, 2, 0, 0)), dev(np.arange(16, dtype=np.int32)), dev(a(1, 1, 0, 0)))
        )
    assert to_bytes(fm.state) == before and fm.step == step


def test_packing_is_off_on_cpu_by_default_and_a_bool() -> None:
    """On XLA:CPU a numpy argument costs less than packing it: the default is off there.
    `pack_inputs` must be a bool or None."""
    assert fj.FutureMap(R).pack_inputs is (jax.devices()[0].platform != "cpu")
    assert fj.FutureMap(R, pack_inputs=True).pack_inputs is True
    with pytest.raises(fj.FutureMapError, match="pack_inputs must be a bool"):
        fj.FutureMap(R, pack_inputs="yes")  # type: ignore[arg-type]


# ------------------------------------------------ pack and unpack (fm_jax/host/packing.py)
def _bytes(x: object) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def _complex_with_payload() -> np.ndarray:
    """complex64 rows whose parts hold a NaN payload, -0.0 and infinities."""
    z = np.array([[1 + 2j, -0.0 + 3j], [complex(np.inf, -np.inf), 0j]], np.complex64)
    z.view(np.uint32).reshape(-1)[1] = 0x7FC00123  # the first imaginary part: a NaN payload
    return z


def test_pack_round_trips_every_dtype_bit_for_bit() -> None:
    nan = np.array([np.nan, -0.0, 0.0, 1.5], np.float32)
    nan.view(np.uint32)[0] = 0x7FC00123  # a NaN with a payload
    tree = {
        "ints": np.arange(5, dtype=np.int32) - 2,
        "floats": nan,
        "bf16": np.array([1, 0x8000, 0x7FC1], np.uint16).view(jnp.bfloat16),
        "bytes": np.array([0, 255, 7], np.uint8),
        "flags": np.array([True, False, True]),
        "scalar": np.int32(3),
        "matrix": np.arange(6, dtype=np.int16).reshape(2, 3),
        "complex": _complex_with_payload(),
        "device": jnp.arange(3, dtype=jnp.int32),
        "none": None,
    }
    spec, packed, device = packing.pack(tree)
    assert packed is not None and packed.dtype == np.uint32 and packed.ndim == 1
    assert spec.nbytes == packed.nbytes
    assert len(device) == 1  # the jax leaf passes on its own
    raw = packed.view(np.uint8)
    for leaf, want in zip(spec.leaves, jax.tree.leaves(tree), strict=True):
        if leaf is not None:  # each host leaf starts on a word, its bytes as they were
            offset, _, _ = leaf
            n = np.asarray(want).nbytes
            assert raw[4 * offset : 4 * offset + n].tobytes() == _bytes(want)
    got = jax.jit(lambda p, d: packing.unpack(spec, p, d))(packed, device)
    for name, want in tree.items():
        if want is None:
            assert got[name] is None
            continue
        g = np.asarray(got[name])
        assert g.dtype == np.asarray(want).dtype and g.shape == np.shape(want), name
        assert _bytes(g) == _bytes(want), name


_X64_CHILD = textwrap.dedent(
    """
    import json, numpy as np, jax
    from fm_jax.host.packing import pack, unpack
    tree = (np.array([1, -2, 2**40 + 3, -(2**62)], np.int64), np.array([1.5, -0.0]),
            np.array([7], np.int16), np.int64(-5), np.array([2**63 + 1], np.uint64))
    spec, packed, _ = pack(tree)
    got = jax.jit(lambda p: unpack(spec, p, ()))(packed)
    same = [np.asarray(g).dtype == np.asarray(w).dtype
            and np.asarray(g).tobytes() == np.asarray(w).tobytes() for g, w in zip(got, tree)]
    print("REPORT", json.dumps(same))
    """
)


def test_pack_round_trips_8_byte_leaves_bit_for_bit() -> None:
    """With JAX's x64 mode (a child process): int64, uint64 and float64 leaves (two words
    each) between 2-byte and scalar ones come back byte for byte."""
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    assert child_report(["-c", _X64_CHILD], env, timeout=300) == [True] * 5


def test_a_packed_word_leaf_costs_no_kernel_of_its_own() -> None:
    """A 4-byte leaf read twice from the packed buffer (a sentinel resolve's ids: compared,
    and an index) compiles to as many kernels as the same function on the leaf passed on
    its own: its unpacking fuses into the consumers."""
    from fm_bench.inplace import kernels

    x = (np.arange(256, dtype=np.int32) - 128,)
    spec, packed, _ = packing.pack(x)
    table = jnp.arange(1024, dtype=jnp.int32)

    def use(v: jax.Array, t: jax.Array) -> jax.Array:
        return jnp.where(v < 0, t[-v], v)

    def count(f: object, *args: object) -> int:
        return kernels(jax.jit(f).lower(*args).compile().as_text())

    alone = count(use, x[0], table)
    assert count(lambda p, t: use(packing.unpack(spec, p, ())[0], t), packed, table) == alone


def test_pack_layout_is_static_and_keys_by_shape_dtype_and_placement() -> None:
    a = packing.pack((np.zeros(4, np.int32), np.ones(2, np.float32)))[0]
    b = packing.pack((np.ones(4, np.int32), np.zeros(2, np.float32)))[0]
    assert a == b and hash(a) == hash(b)  # values do not matter
    assert a != packing.pack((np.zeros(8, np.int32), np.ones(2, np.float32)))[0]
    assert a != packing.pack((np.zeros(4, np.int64), np.ones(2, np.float32)))[0]
    assert a != packing.pack((jnp.zeros(4, np.int32), np.ones(2, np.float32)))[0]
    spec, packed, device = packing.pack((jnp.zeros(2), None))
    assert packed is None and spec.nbytes == 0 and len(device) == 1
