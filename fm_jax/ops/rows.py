"""Moving rows in and out of the relay buffers: writes drop an out-of-range slot (negative
included), reads clip. XLA moves each buffer with its own scatter or gather, a kernel launch
each (a spec stash is 4 on CUDA, 20-55 us of host time apiece: `python -m fm_bench.inplace`);
`SpecConfig(kernel='pallas')` moves every buffer's row in one kernel: program (b, j) copies
chunk j of row b of each buffer, bytes untouched (Triton on a GPU; Pallas's interpreter on
CPU; no TPU). A row's last chunk overlaps the one before, so no access leaves its row and
no mask is needed. Rows sharing a slot write in an unspecified order, as XLA's scatter."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from fm_jax.ops.errors import FutureMapError

CHUNK = 1024
"""The most elements a program copies of one buffer's row (a power of two)."""


def scatter(buf: jax.Array, indices: jax.Array, values: jax.Array) -> jax.Array:
    """`buf[indices] := values`; out-of-range slots (negative included) write nothing."""
    return buf.at[indices].set(values.astype(buf.dtype), mode="drop", wrap_negative_indices=False)


def gather(buf: jax.Array, indices: jax.Array) -> jax.Array:
    """`buf[indices]`, slots clipped to [0, R) (a negative slot reads slot 0; wrapping would
    cost a few flops per row for nothing)."""
    return buf.at[indices].get(mode="clip", wrap_negative_indices=False)


def scatter_rows(
    bufs: list[jax.Array], idx: Any, values: list[Any], one_kernel: bool, dtype: np.dtype
) -> list[jax.Array]:
    """`scatter` of each value into its buffer at `idx`: one kernel for them all
    (`one_kernel`), else one scatter per buffer."""
    values = [jnp.asarray(v).astype(b.dtype) for b, v in zip(bufs, values, strict=True)]
    if one_kernel:
        return scatter_kernel(bufs, jnp.asarray(idx, dtype), values)
    return [scatter(b, idx, v) for b, v in zip(bufs, values, strict=True)]


def gather_rows(
    bufs: list[jax.Array], idx: jax.Array, one_kernel: bool, dtype: np.dtype
) -> list[jax.Array]:
    """`gather` of each buffer at `idx`: one kernel for them all (`one_kernel`), else one
    gather per buffer."""
    if one_kernel and idx.shape[0] > 0:
        return gather_kernel(bufs, jnp.asarray(idx, dtype))
    return [gather(b, idx) for b in bufs]


def check_fits(name: str, rows: int, width: int, index_dtype: np.dtype) -> None:
    """FutureMapError unless `rows` rows of `width` elements are addressable in offsets of
    `index_dtype` (the kernel computes slot * width in it)."""
    limit = np.iinfo(index_dtype).max
    if rows * width > limit:
        raise FutureMapError(
            f"spec.kernel='pallas': {name} holds {rows} x {width} elements, more than "
            f"{index_dtype} offsets address ({limit}); use kernel='xla' or int64 (x64)"
        )


def _chunk(width: int) -> int:
    """The largest power of two <= min(width, CHUNK)."""
    return 1 << (min(width, CHUNK).bit_length() - 1)


def _chunks(width: int) -> int:
    return -(-width // _chunk(width))


def _copy_chunk(src: Any, src_row: Any, dst: Any, dst_row: Any, width: int, j: Any) -> None:
    """Chunk j of a row of `width` elements, src[src_row] -> dst[dst_row] (flat refs)."""
    c, n = _chunk(width), _chunks(width)
    start = jnp.minimum(j * c, width - c)  # the last chunk ends at the row's end

    @pl.when(j < n)
    def _() -> None:
        dst[pl.ds(dst_row * width + start, c)] = src[pl.ds(src_row * width + start, c)]


def _scatter_kernel(widths: tuple[int, ...], rows: int, idx_ref: Any, *refs: Any) -> None:
    """Program (b, j): chunk j of row b of every value to its buffer's row idx[b]."""
    k = len(widths)
    values, outs = refs[:k], refs[2 * k :]  # refs[k:2k]: the buffers, aliased to outs
    b, j = pl.program_id(0), pl.program_id(1)
    slot = idx_ref[b]
    b = b.astype(slot.dtype)

    @pl.when((slot >= 0) & (slot < rows))  # mode='drop'
    def _() -> None:
        for v, o, w in zip(values, outs, widths, strict=True):
            _copy_chunk(v, b, o, slot, w, j)


def _gather_kernel(widths: tuple[int, ...], rows: int, idx_ref: Any, *refs: Any) -> None:
    """Program (b, j): chunk j of every buffer's row idx[b] to row b of its output."""
    k = len(widths)
    bufs, outs = refs[:k], refs[k:]
    b, j = pl.program_id(0), pl.program_id(1)
    slot = jnp.clip(idx_ref[b], 0, rows - 1)  # mode='clip'
    b = b.astype(slot.dtype)
    for s, o, w in zip(bufs, outs, widths, strict=True):
        _copy_chunk(s, slot, o, b, w, j)


def _flat(x: jax.Array) -> jax.Array:
    """`x` flattened (no copy on a GPU), 8 and 16-bit floats as the unsigned ints of their
    bits (XLA:CPU's interpreter path would compute them in f32)."""
    flat, dt = x.reshape(-1), np.dtype(x.dtype)
    if dt.kind in "iu" or (dt.kind == "f" and dt.itemsize >= 4):
        return flat
    return jax.lax.bitcast_convert_type(flat, np.dtype(f"uint{8 * dt.itemsize}"))


def _unflat(flat: jax.Array, like: jax.Array, rows: int) -> jax.Array:
    """The inverse of `_flat` for `rows` rows shaped like `like`'s."""
    if flat.dtype != like.dtype:
        flat = jax.lax.bitcast_convert_type(flat, like.dtype)
    return flat.reshape(rows, *like.shape[1:])


def _like(x: jax.Array, shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
    """An output of `shape` and `x`'s dtype that varies over a shard_map's mesh axes as `x`
    does (Pallas asks it of every output under `check_vma`)."""
    return jax.ShapeDtypeStruct(shape, x.dtype, manual_axis_type=jax.typeof(x).mat)


def _widths(bufs: Sequence[jax.Array], b: int, index_dtype: np.dtype) -> tuple[int, ...]:
    """Each buffer's row width, once `check_fits` passed for its rows and the batch's."""
    widths = tuple(math.prod(x.shape[1:]) for x in bufs)
    for w in widths:
        check_fits("a buffer", bufs[0].shape[0], w, index_dtype)
        check_fits("a batch", b, w, index_dtype)
    return widths


def _on_each_platform(call: Any, *args: Any) -> Any:
    """`call(*args, interpret=..., params=...)`: Pallas's interpreter on CPU, Triton on a GPU."""
    gpu = functools.partial(call, interpret=False, params=pl_triton.CompilerParams())
    return jax.lax.platform_dependent(
        *args, cpu=functools.partial(call, interpret=True, params=None), cuda=gpu, rocm=gpu
    )


def scatter_kernel(
    bufs: Sequence[jax.Array], idx: jax.Array, values: Sequence[jax.Array]
) -> list[jax.Array]:
    """`bufs[i][idx] := values[i]` for every buffer in one kernel, a slot outside [0, R)
    writing nothing; the buffers aliased to the outputs (in place once donated). B >= 1."""
    rows, b = bufs[0].shape[0], idx.shape[0]
    widths = _widths(bufs, b, idx.dtype)
    k = len(bufs)

    def call(
        idx: Any, vals: list[jax.Array], flat: list[jax.Array], *, interpret: bool, params: Any
    ):
        return pl.pallas_call(
            functools.partial(_scatter_kernel, widths, rows),
            out_shape=[_like(x, x.shape) for x in flat],
            grid=(b, max(_chunks(w) for w in widths)),
            input_output_aliases={1 + k + i: i for i in range(k)},
            interpret=interpret,
            compiler_params=params,
        )(idx, *vals, *flat)

    out = _on_each_platform(call, idx, [_flat(v) for v in values], [_flat(x) for x in bufs])
    return [_unflat(o, x, rows) for o, x in zip(out, bufs, strict=True)]


def gather_kernel(bufs: Sequence[jax.Array], idx: jax.Array) -> list[jax.Array]:
    """`bufs[i][clip(idx, 0, R - 1)]` for every buffer in one kernel; B >= 1."""
    rows, b = bufs[0].shape[0], idx.shape[0]
    widths = _widths(bufs, b, idx.dtype)

    def call(idx: jax.Array, flat: list[jax.Array], *, interpret: bool, params: Any):
        return pl.pallas_call(
            functools.partial(_gather_kernel, widths, rows),
            out_shape=[_like(x, (b * w,)) for x, w in zip(flat, widths, strict=True)],
            grid=(b, max(_chunks(w) for w in widths)),
            interpret=interpret,
            compiler_params=params,
        )(idx, *flat)

    out = _on_each_platform(call, idx, [_flat(x) for x in bufs])
    return [_unflat(o, x, b) for o, x in zip(out, bufs, strict=True)]
