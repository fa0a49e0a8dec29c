"""How rows move (fm_jax/ops/rows.py): the one-kernel spec field moves
(`SpecConfig(kernel='pallas')`), then the one-row path.

On CPU the kernel runs in Pallas's interpreter: its bytes are checked against numpy's
scatter / gather and against the per-buffer XLA ops. Its CUDA lowering (Triton) is built
here too, without a GPU (`lowering_platforms=('cuda',)`): one Triton kernel per op, no
scatter or gather of a field left beside it. The CUDA run itself is in the GPU checklist.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import checkify

import fm_jax as fj
from fm_jax.ops import rows

R = 24
# (dtype, row shape): every width class (one value, a power of two, none, wider than a
# chunk and no power of two), and the raw bits of floats: NaN payloads and -0.0 must move.
BUFFERS = [
    (np.int32, ()),
    (np.float32, (8,)),
    (np.uint16, (3,)),
    (np.int8, (5, 2)),
    (ml_dtypes.bfloat16, (rows.CHUNK + 6,)),
    (np.float16, (1,)),
]
# In range, out of range both ways, unique in-range slots (rows sharing a slot write in an
# unspecified order, as XLA's scatter does on a GPU).
IDX = np.array([5, -1, 23, 0, R, 9, -R - 3, 17], np.int32)


def _random(dtype: type, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    bits = rng.integers(0, 256, (*shape, np.dtype(dtype).itemsize), dtype=np.uint8)
    out = bits.view(dtype).reshape(shape)
    if (np.dtype(dtype).kind == "f" or dtype is ml_dtypes.bfloat16) and out.size >= 2:
        flat = out.reshape(-1)
        flat[:2] = [np.array(-0.0, dtype), np.array(np.nan, dtype)]
    return out


def _buffers(seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    bufs = [_random(dt, (R, *shape), rng) for dt, shape in BUFFERS]
    vals = [_random(dt, (IDX.size, *shape), rng) for dt, shape in BUFFERS]
    return bufs, vals


def _bytes(xs: list) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in xs]


def test_gather_reads_each_buffer_at_the_clipped_slots() -> None:
    bufs, _ = _buffers(0)
    got = jax.jit(rows.gather_kernel)([jnp.asarray(b) for b in bufs], jnp.asarray(IDX))
    want = [b[np.clip(IDX, 0, R - 1)] for b in bufs]
    assert [g.shape for g in got] == [w.shape for w in want]
    assert _bytes(got) == _bytes(want)


def test_scatter_writes_each_buffer_at_the_slots_in_range_only() -> None:
    bufs, vals = _buffers(1)
    got = jax.jit(rows.scatter_kernel, donate_argnums=(0,))(
        [jnp.asarray(b) for b in bufs], jnp.asarray(IDX), [jnp.asarray(v) for v in vals]
    )
    want = [b.copy() for b in bufs]
    for i, slot in enumerate(IDX):
        if 0 <= slot < R:
            for w, v in zip(want, vals, strict=True):
                w[slot] = v[i]
    assert _bytes(got) == _bytes(want)


def _spec_map(kernel: str, protocol: str, debug: bool) -> fj.FutureMapOps:
    extra = (
        fj.RelayField("accept_len", consumed=True),
        fj.RelayField("probs", (3,), np.float32),
        fj.RelayField("mask", (6,), np.int8),  # one-byte fields: moved as uint8
        fj.RelayField("scales", (2,), ml_dtypes.float8_e4m3fn),
    )
    spec = fj.SpecConfig(4, 10, jnp.bfloat16, verified_id=True, extra=extra, kernel=kernel)
    return fj.future_map(R, spec=spec, debug=debug, protocol=protocol)


def _draft(rng: np.random.Generator, b: int) -> fj.DraftPayload:
    ints = lambda *s: jnp.asarray(rng.integers(1, 1000, s).astype(np.int32))  # noqa: E731
    return fj.DraftPayload(
        bonus_tokens=ints(b),
        topk_p=jnp.asarray(_random(np.float32, (b, 4), rng)),
        topk_index=ints(b, 4),
        hidden_states=jnp.asarray(_random(ml_dtypes.bfloat16, (b, 10), rng)),
        verified_id=ints(b),
        extras={
            "accept_len": ints(b),
            "probs": jnp.asarray(_random(np.float32, (b, 3), rng)),
            "mask": jnp.asarray(_random(np.int8, (b, 6), rng)),
            "scales": jnp.asarray(_random(ml_dtypes.float8_e4m3fn, (b, 2), rng)),
        },
    )


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
@pytest.mark.parametrize("debug", [False, True])
def test_spec_ops_move_the_same_bytes_with_either_kernel(protocol: str, debug: bool) -> None:
    """A spec map's stash, publish and resolve leave the same state and resolve the same
    batch with kernel='pallas' as with 'xla' (every field kind, consumed ones included)."""
    rng = np.random.default_rng(2)
    slots = jnp.asarray(np.array([3, 7, 0, 11], np.int32))
    draft = _draft(rng, 4)
    lens = jnp.asarray(np.array([5, 6, 0, 8], np.int32))
    mode = fj.ForwardMode.DECODE
    out = {}

    def run(fn: object, *args: object) -> object:
        if not debug:
            return jax.jit(fn)(*args)
        err, got = jax.jit(checkify.checkify(fn, errors=checkify.user_checks))(*args)
        err.throw()
        return got

    for kernel in ("xla", "pallas"):
        ops = _spec_map(kernel, protocol, debug)
        state = run(ops.publish, ops.init(), slots, lens)
        state = run(ops.stash, state, slots, draft)
        ids = jnp.zeros(4, jnp.int32) if protocol == "gather" else -slots
        batch = fj.Batch(mode, slots, ids, ids, slots)
        state, res = run(ops.resolve, state, batch)
        out[kernel] = _bytes(jax.tree.leaves((state, res)))
    assert out["pallas"] == out["xla"]


_OP = re.compile(r"= \"?stablehlo\.(\w+)")
"""An op of a StableHLO module, by name."""


def _cuda_hlo(fn: object, *args: object) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_cuda_lowering_moves_every_field_in_one_triton_kernel(protocol: str) -> None:
    """Lowered for CUDA (no GPU needed), a spec stash is one Triton kernel and no scatter;
    a spec DECODE resolve gathers the draft (and, in the gather protocol, the lengths at
    the draft slots) in one Triton kernel: no gather beside it but the sentinel protocol's
    lengths at the batch's own slots."""
    ops = _spec_map("pallas", protocol, debug=False)
    state = ops.init()
    slots = jnp.arange(1, 9, dtype=jnp.int32)
    stash = _cuda_hlo(ops.stash, state, slots, _draft(np.random.default_rng(3), 8))
    assert stash.count("xla.gpu.triton") == 1
    assert not _OP.findall(stash).count("scatter")

    ids = jnp.zeros(8, jnp.int32) if protocol == "gather" else -slots
    batch = fj.Batch(fj.ForwardMode.DECODE, slots, ids, ids, slots)
    resolve = _cuda_hlo(lambda s, b: ops.resolve(s, b)[1], state, batch)
    assert resolve.count("xla.gpu.triton") == 1
    assert _OP.findall(resolve).count("gather") == (0 if protocol == "gather" else 1)


def test_the_standard_fields_reach_the_kernel_without_a_bitcast() -> None:
    """Tokens, top-k and hidden states (stored as bits) go to the kernel as they are: no
    bitcast-convert of a buffer, which XLA may copy whole (it does on CPU)."""
    spec = fj.SpecConfig(8, 64, jnp.bfloat16, verified_id=True, kernel="pallas")
    ops = fj.future_map(R, spec=spec, protocol="gather")
    slots = jnp.arange(1, 9, dtype=jnp.int32)
    rng = np.random.default_rng(8)
    draft = fj.DraftPayload(
        bonus_tokens=slots,
        topk_p=jnp.asarray(_random(np.float32, (8, 8), rng)),
        topk_index=slots[:, None] + jnp.zeros((8, 8), jnp.int32),
        hidden_states=jnp.asarray(_random(ml_dtypes.bfloat16, (8, 64), rng)),
        verified_id=slots,
    )
    stash = _cuda_hlo(ops.stash, ops.init(), slots, draft)
    batch = fj.Batch(fj.ForwardMode.DECODE, slots, slots, slots, slots)
    resolve = _cuda_hlo(lambda s, b: ops.resolve(s, b)[1], ops.init(), batch)
    # The real floats' rows (top-k f32, hidden bf16) become their bits before the kernel,
    # and back after: one bitcast each, of the batch's rows, none of a buffer.
    assert _OP.findall(stash).count("bitcast_convert") == 2
    assert _OP.findall(resolve).count("bitcast_convert") == 2


def test_inlined_in_an_engines_own_shard_map_the_kernel_keeps_its_varying_axes() -> None:
    """An engine that inlines the pure ops in its own `jax.shard_map` (the varying-axes
    check on, the default) lowers the kernel for CUDA: each output varies over the mesh as
    the buffer it comes from."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    ops = _spec_map("pallas", "gather", debug=False)
    rows = jax.sharding.PartitionSpec("dp")
    slots = jnp.arange(1, 9, dtype=jnp.int32)
    draft = _draft(np.random.default_rng(5), 8)

    def step(state: fj.FutureMapState, slots: jax.Array, draft: fj.DraftPayload) -> Any:
        state = ops.stash(state, slots, draft)
        batch = fj.Batch(fj.ForwardMode.DECODE, slots, jnp.zeros_like(slots), slots, slots)
        return state, ops.resolve(state, batch)[1].draft

    mapped = jax.shard_map(step, mesh=mesh, in_specs=rows, out_specs=rows)
    hlo = _cuda_hlo(mapped, ops.init(), slots, draft)
    assert hlo.count("xla.gpu.triton") == 2


def test_a_batch_too_long_for_int32_offsets_is_refused_when_traced() -> None:
    """Rows * width of the batch (a stash's values, a gather's outputs) must fit int32
    offsets too, as must a buffer's; shapes only (nothing is allocated)."""
    ops = fj.future_map(4, spec=fj.SpecConfig(0, 1 << 15, kernel="pallas"), protocol="gather")
    state = jax.eval_shape(ops.init)
    b = 1 << 16
    idx = jax.ShapeDtypeStruct((b,), jnp.int32)
    draft = fj.DraftPayload(
        bonus_tokens=idx, hidden_states=jax.ShapeDtypeStruct((b, 1 << 15), jnp.bfloat16)
    )
    with pytest.raises(fj.FutureMapError, match="a batch holds 65536 x 32768 elements"):
        jax.eval_shape(ops.stash, state, idx, draft)
    batch = fj.Batch(fj.ForwardMode.DECODE, idx, idx, idx, idx)
    with pytest.raises(fj.FutureMapError, match="a batch holds 65536 x 32768 elements"):
        jax.eval_shape(ops.resolve, state, batch)
    # A state not from this map's init (more rows than its pool) is held to the same bound.
    big = jax.eval_shape(fj.future_map(b, spec=fj.SpecConfig(0, 1 << 15)).init)
    small = jax.ShapeDtypeStruct((8,), jnp.int32)
    with pytest.raises(fj.FutureMapError, match="a buffer holds 65536 x 32768 elements"):
        jax.eval_shape(
            ops.resolve,
            big,
            batch._replace(
                req_pool_indices=small, draft_indices=small, input_ids=small, seq_lens=small
            ),
        )


def test_the_kernel_refuses_what_it_cannot_move() -> None:
    with pytest.raises(fj.FutureMapError, match="spec.kernel must be one of"):
        fj.future_map(R, spec=fj.SpecConfig(4, kernel="triton"))
    for dtype in (np.bool_, np.complex64):
        spec = fj.SpecConfig(0, extra=(fj.RelayField("x", (), dtype),), kernel="pallas")
        with pytest.raises(fj.FutureMapError, match="moves real numbers and ints; field x"):
            fj.future_map(R, spec=spec)
    # slot * width must stay inside the map's int32 offsets
    spec = fj.SpecConfig(0, 1 << 16, kernel="pallas")
    with pytest.raises(fj.FutureMapError, match="hidden_states holds 65536 x 65536"):
        fj.future_map(1 << 16, spec=spec)


def _gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _gpu(), reason="needs a JAX GPU device (the Triton kernel runs there)")
def test_on_a_gpu_each_spec_op_is_one_kernel_in_place_with_the_same_bytes() -> None:
    """Compiled for the GPU (B = 256, R = 16384, K = 8, H = 4096 bf16, gather protocol): the
    stash and the resolve's draft and lengths each run one kernel (no copy beside it), the
    stash aliases the donated state, and both leave the per-buffer ops' bytes. The resolve's
    mode is fixed when traced, as the class's fixed-DECODE executable has it: a traced mode
    adds a select of the lengths, a kernel of its own (seen on an H200)."""
    from fm_bench.inplace import kernels

    pool, b = 16384, 256
    rng = np.random.default_rng(4)
    slots = jnp.asarray(rng.permutation(np.arange(1, pool, dtype=np.int32))[:b])
    draft = fj.DraftPayload(
        bonus_tokens=jnp.asarray(rng.integers(1, 32000, b).astype(np.int32)),
        topk_p=jnp.asarray(_random(np.float32, (b, 8), rng)),
        topk_index=jnp.asarray(rng.integers(0, 32000, (b, 8)).astype(np.int32)),
        hidden_states=jnp.asarray(_random(ml_dtypes.bfloat16, (b, 4096), rng)),
    )
    batch = fj.Batch(None, slots, jnp.zeros(b, jnp.int32), slots, slots)  # mode fixed below
    out, hlo = {}, {}
    for kernel in ("xla", "pallas"):
        spec = fj.SpecConfig(8, 4096, jnp.bfloat16, kernel=kernel)
        ops = fj.future_map(pool, spec=spec, protocol="gather")
        stash = jax.jit(ops.stash, donate_argnums=(0,))

        def resolve_decode(s: Any, bt: Any, ops: Any = ops) -> Any:  # lengths, draft
            return ops.resolve(s, bt._replace(forward_mode=fj.ForwardMode.DECODE))[1][1:]

        resolve = jax.jit(resolve_decode)
        hlo[kernel] = (
            stash.lower(ops.init(), slots, draft).compile().as_text() or "",
            resolve.lower(ops.init(), batch).compile().as_text() or "",
        )
        state = stash(ops.init(), slots, draft)
        out[kernel] = _bytes(jax.tree.leaves((state, resolve(state, batch))))
    assert out["pallas"] == out["xla"]
    stash_hlo, resolve_hlo = hlo["pallas"]
    # One kernel and nothing else: no copy or convert of a buffer beside it.
    assert kernels(stash_hlo) == 1, stash_hlo
    assert "input_output_alias" in stash_hlo
    assert kernels(resolve_hlo) == 1, resolve_hlo


def test_an_empty_batch_launches_no_kernel() -> None:
    """A DP-idle rank's empty stash and draft gather (B = 0) run no kernel: the stash
    leaves the state as it was, the resolve returns empty rows."""
    ops = _spec_map("pallas", "gather", debug=False)
    state = ops.stash(
        ops.init(), jnp.arange(1, 5, dtype=jnp.int32), _draft(np.random.default_rng(6), 4)
    )
    none = jnp.zeros(0, jnp.int32)
    batch = fj.Batch(fj.ForwardMode.DECODE, none, none, none, none)
    assert _bytes(
        jax.tree.leaves(ops.stash(state, none, _draft(np.random.default_rng(7), 0)))
    ) == _bytes(jax.tree.leaves(state))
    res = jax.jit(ops.resolve)(state, batch)[1]
    assert all(x.shape[0] == 0 for x in jax.tree.leaves(res))
    assert _cuda_hlo(lambda s, b: ops.resolve(s, b)[1], state, batch).count("xla.gpu.triton") == 0


def test_small_int_slots_and_a_single_row_take_the_kernel() -> None:
    """Slots in a narrower int than the map's (int8 into 300 rows) reach the kernel in the
    map's dtype, and read and write as with the per-buffer ops; one row is one kernel too."""
    rng = np.random.default_rng(9)
    slots = jnp.asarray(np.array([5, 100, -3, 127], np.int8))
    draft = _draft(rng, 4)
    batch = fj.Batch(fj.ForwardMode.DECODE, slots, jnp.zeros(4, jnp.int32), slots, slots)
    out = {}
    for kernel in ("xla", "pallas"):
        extra = (fj.RelayField("probs", (3,), np.float32),)
        spec = fj.SpecConfig(4, 10, jnp.bfloat16, verified_id=True, kernel=kernel)
        ops = fj.future_map(300, spec=spec._replace(extra=extra), protocol="gather")
        d = draft._replace(extras={"probs": draft.extras["probs"]})
        state = jax.jit(ops.stash)(ops.init(), slots, d)
        out[kernel] = _bytes(jax.tree.leaves((state, jax.jit(ops.resolve)(state, batch)[1])))
    assert out["pallas"] == out["xla"]
    one = jnp.ones(1, jnp.int32)
    single = fj.Batch(fj.ForwardMode.DECODE, one, one, one, one)
    resolve = _cuda_hlo(lambda s, b: ops.resolve(s, b)[1], ops.init(), single)
    assert resolve.count("xla.gpu.triton") == 1


# ------------------------------------------------------------------ the one-row path
# The one-row path (fm_jax/ops/rows.py): a batch of one row (a static shape; the default
# buckets start at 1) compiles to a dynamic slice or a select and dynamic-update-slice, not a
# gather or a scatter (XLA's simplifiers rewrite a one-index gather or scatter so), with the
# bytes of the contract's rule at every slot, out-of-range ones included: a write drops, a
# read clips (a plain dynamic-update-slice would clamp a write into slot 0 or R-1).
ONE_R = 5
SLOTS = [0, 1, ONE_R - 1, ONE_R, ONE_R + 7, -1, -ONE_R, np.iinfo(np.int32).min]


def _row_bytes(x: object) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def _one_row_bufs() -> list[jax.Array]:
    """An int buffer, and float rows whose bits hold NaN payloads and -0.0."""
    bits = np.arange(ONE_R * 3, dtype=np.uint32).reshape(ONE_R, 3) | np.uint32(0x7FC00000)
    bits[2, 1] = 0x80000000  # -0.0
    return [jnp.arange(ONE_R, dtype=jnp.int32) * 10, jnp.asarray(bits.view(np.float32))]


@pytest.mark.parametrize("slot", SLOTS)
def test_one_row_moves_the_bytes_of_the_general_path(slot: int) -> None:
    """The same bytes as numpy's rule: a write to a slot out of [0, R) changes nothing, a
    read clips to [0, R)."""
    idx = jnp.array([slot], jnp.int32)
    for buf in _one_row_bufs():
        host = np.asarray(buf)
        row = np.full((1, *host.shape[1:]), 7, host.dtype)
        if host.dtype == np.float32:
            row.view(np.uint32)[...] = 0x7FC0ABCD  # a NaN payload
        want = host.copy()
        if 0 <= slot < ONE_R:
            want[slot] = row[0]
        got = jax.jit(rows.scatter)(buf, idx, jnp.asarray(row))
        assert _row_bytes(got) == _row_bytes(want)
        read = jax.jit(rows.gather)(buf, idx)
        assert _row_bytes(read) == _row_bytes(host[[min(max(slot, 0), ONE_R - 1)]])


def _ops_hlo(debug: bool, protocol: str, spec: fj.SpecConfig | None) -> str:
    """The compiled HLO of publish, stash and a DECODE resolve of one row (slots passed
    in, not constants XLA could fold; the state donated)."""
    ops = fj.future_map(ONE_R, debug=debug, protocol=protocol, spec=spec)

    def payload(i: jax.Array) -> object:
        if spec is None:
            return i
        return fj.DraftPayload(i, jnp.ones((1, 2), jnp.float32), jnp.ones((1, 2), jnp.int32))

    def batch(i: jax.Array) -> fj.Batch:
        b = fj.Batch(fj.ForwardMode.DECODE, i, -i, -i)
        return b if spec is None else b._replace(draft_indices=i)

    fns = [
        lambda s, i: ops.publish(s, i, i + 3),
        lambda s, i: ops.stash(s, i, payload(i)),
        lambda s, i: ops.resolve(s, batch(i)),
    ]
    if debug:
        from jax.experimental import checkify

        fns = [checkify.checkify(f) for f in fns]
    one = jnp.array([2], jnp.int32)
    return "".join(
        jax.jit(f, donate_argnums=0).lower(ops.init(), one).compile().as_text() or "" for f in fns
    )


@pytest.mark.parametrize(
    ("debug", "protocol", "spec"),
    [
        (False, "sentinel", None),
        (False, "gather", fj.SpecConfig(2)),
        (True, "sentinel", None),
    ],
)
def test_one_row_compiles_to_no_gather_or_scatter(debug: bool, protocol: str, spec: object) -> None:
    """Publish, stash and resolve of a one-row batch compile to slices, not gathers or
    scatters, spec fields with kernel='xla' included (a debug resolve's consume poison
    writes the batch's slot and the slot its sentinel read: that one scatters)."""
    hlo = _ops_hlo(debug, protocol, spec)  # type: ignore[arg-type]
    assert re.findall(r"\bgather\(", hlo) == []
    assert len(re.findall(r"\bscatter\(", hlo)) == (1 if debug else 0)
    assert "dynamic-update-slice(" in hlo
