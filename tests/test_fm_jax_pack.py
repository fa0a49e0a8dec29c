"""`fm_jax.host.pack`: `pack` and `unpack` round-trip every dtype bit for bit, key the
layout by shape, dtype and placement, and cost no kernel of their own.
"""

from __future__ import annotations

import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

from fm_bench.child import child_report
from fm_jax.host import pack


# ------------------------------------------------ pack and unpack (fm_jax/host/pack.py)
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
    spec, packed, device = pack.pack(tree)
    assert packed is not None and packed.dtype == np.uint32 and packed.ndim == 1
    assert spec.nbytes == packed.nbytes
    assert len(device) == 1  # the jax leaf passes on its own
    raw = packed.view(np.uint8)
    for leaf, want in zip(spec.leaves, jax.tree.leaves(tree), strict=True):
        if leaf is not None:  # each host leaf starts on a word, its bytes as they were
            offset, _, _ = leaf
            n = np.asarray(want).nbytes
            assert raw[4 * offset : 4 * offset + n].tobytes() == _bytes(want)
    got = jax.jit(lambda p, d: pack.unpack(spec, p, d))(packed, device)
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
    from fm_jax.host.pack import pack, unpack
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
    spec, packed, _ = pack.pack(x)
    table = jnp.arange(1024, dtype=jnp.int32)

    def use(v: jax.Array, t: jax.Array) -> jax.Array:
        return jnp.where(v < 0, t[-v], v)

    def count(f: object, *args: object) -> int:
        return kernels(jax.jit(f).lower(*args).compile().as_text())

    alone = count(use, x[0], table)
    assert count(lambda p, t: use(pack.unpack(spec, p, ())[0], t), packed, table) == alone


def test_pack_layout_is_static_and_keys_by_shape_dtype_and_placement() -> None:
    a = pack.pack((np.zeros(4, np.int32), np.ones(2, np.float32)))[0]
    b = pack.pack((np.ones(4, np.int32), np.zeros(2, np.float32)))[0]
    assert a == b and hash(a) == hash(b)  # values do not matter
    assert a != pack.pack((np.zeros(8, np.int32), np.ones(2, np.float32)))[0]
    assert a != pack.pack((np.zeros(4, np.int64), np.ones(2, np.float32)))[0]
    assert a != pack.pack((jnp.zeros(4, np.int32), np.ones(2, np.float32)))[0]
    spec, packed, device = pack.pack((jnp.zeros(2), None))
    assert packed is None and spec.nbytes == 0 and len(device) == 1
