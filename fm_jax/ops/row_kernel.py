"""One kernel that moves a row of several buffers at once: a spec map's stash and resolve
with `SpecConfig(kernel='pallas')` (docs/guide.md, 'One launch for the spec fields').

XLA emits a scatter (stash) or a gather (resolve) per buffer and merges none across
buffers of different row widths: a spec stash of bonus tokens, top-k and hidden states
is 4 kernels on CUDA, its resolve 4-5 (`python -m fm_bench.inplace`). Each kernel is a
launch the host pays for (20-55 us on a VM) and the device waits behind. Here one Pallas
kernel moves every buffer's row: program (b, j) copies chunk j of row b of each buffer,
a load and a store of its elements (8 and 16-bit floats as the unsigned ints of their
width), so every byte moves untouched, NaN payloads and -0.0 included.

Semantics, as ops.py's per-buffer scatter and gather:
- `scatter`: `bufs[i][idx] := values[i]`; a slot out of [0, R) writes nothing; the
  buffers are aliased to the outputs (in place once the caller's jit donates them).
  Rows sharing a slot (padding rows at slot 0) write in an unspecified order, as XLA's
  scatter does on a GPU.
- `gather`: `bufs[i][clip(idx, 0, R - 1)]`.

Where it runs: on CUDA and ROCm a Triton kernel; on CPU Pallas's interpreter runs the same
kernel (a correctness path for tests and parity, not a fast one); no TPU lowering.
Chunks are powers of two (Triton's block sizes) of at most `CHUNK` elements; a row whose
width is no power of two ends with a chunk that overlaps the one before (the overlap is
written twice with the same bytes), so no access leaves its row and no mask is needed.
Offsets are computed in the index dtype: an int32 index needs rows * width < 2**31
(`check_fits`).
"""

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

KERNELS = ("xla", "pallas")
"""How a spec map moves its fields: 'xla', one scatter / gather per buffer; 'pallas', one
kernel for all of them (this module)."""

CHUNK = 1024
"""The most elements a program copies of one buffer's row (a power of two)."""


def check_kernel(kernel: Any) -> str:
    """`kernel` if it is one of KERNELS, else FutureMapError."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise FutureMapError(f"spec.kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def movable(dtype: np.dtype) -> bool:
    """Whether the kernel moves values of a storable `dtype` (`relay_fields.storable`, so 1,
    2, 4 or 8 bytes wide): real numbers and ints. Not bool or complex, which Triton loads
    as no such type and XLA bitcasts to no unsigned int."""
    return dtype.kind not in ("b", "c")


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


def _moved_as(dtype: np.dtype) -> np.dtype:
    """The dtype the kernel moves `dtype`'s values in: ints and 32/64-bit floats as they
    are (a load and a store move their bits untouched); 8 and 16-bit floats as the unsigned
    ints of their width (XLA:CPU's interpreter path would compute them in f32)."""
    if dtype.kind in "iu" or (dtype.kind == "f" and dtype.itemsize >= 4):
        return dtype
    return np.dtype(f"uint{8 * dtype.itemsize}")


def _flat(x: jax.Array) -> jax.Array:
    """`x` flattened, in the dtype the kernel moves it in (a reshape and at most a same-width
    bitcast: on a GPU no copy; on CPU XLA copies for the bitcast)."""
    flat = x.reshape(-1)
    moved = _moved_as(np.dtype(x.dtype))
    return flat if moved == flat.dtype else jax.lax.bitcast_convert_type(flat, moved)


def _unflat(flat: jax.Array, like: jax.Array, rows: int) -> jax.Array:
    """The inverse of `_flat` for `rows` rows shaped like `like`'s."""
    if flat.dtype != like.dtype:
        flat = jax.lax.bitcast_convert_type(flat, like.dtype)
    return flat.reshape(rows, *like.shape[1:])


def _like(x: jax.Array, shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
    """An output of `shape` and `x`'s dtype that varies over a shard_map's mesh axes as `x`
    does (Pallas asks it of every output under `check_vma`)."""
    return jax.ShapeDtypeStruct(shape, x.dtype, manual_axis_type=jax.typeof(x).mat)


def _widths(bufs: Sequence[jax.Array]) -> tuple[int, ...]:
    return tuple(math.prod(x.shape[1:]) for x in bufs)


def _check_sizes(rows: int, b: int, widths: tuple[int, ...], index_dtype: np.dtype) -> None:
    """`check_fits` for the buffers' rows and the batch's (a stash's values, a gather's
    outputs)."""
    for w in widths:
        check_fits("a buffer", rows, w, index_dtype)
        check_fits("a batch", b, w, index_dtype)


def _on_each_platform(call: Any, *args: Any) -> Any:
    """`call(*args, interpret=...)`: Pallas's interpreter on CPU, Triton on a GPU."""
    return jax.lax.platform_dependent(
        *args,
        cpu=functools.partial(call, interpret=True),
        cuda=functools.partial(call, interpret=False),
        rocm=functools.partial(call, interpret=False),
    )


def _params(interpret: bool) -> Any:
    return None if interpret else pl_triton.CompilerParams()


def scatter(
    bufs: Sequence[jax.Array], idx: jax.Array, values: Sequence[jax.Array]
) -> list[jax.Array]:
    """`bufs[i][idx] := values[i]` for every buffer in one kernel; a slot outside [0, R)
    writes nothing. Assumes [R, ...] buffers, [B] int `idx` with B >= 1, [B, ...] values
    of each buffer's row shape and dtype, and every buffer's and the values' rows
    addressable in `idx`'s dtype (`check_fits`: checked here, when traced)."""
    rows, b = bufs[0].shape[0], idx.shape[0]
    widths = _widths(bufs)
    _check_sizes(rows, b, widths, idx.dtype)
    k = len(bufs)

    def call(idx: jax.Array, vals: list[jax.Array], flat: list[jax.Array], *, interpret: bool):
        return pl.pallas_call(
            functools.partial(_scatter_kernel, widths, rows),
            out_shape=[_like(x, x.shape) for x in flat],
            grid=(b, max(_chunks(w) for w in widths)),
            input_output_aliases={1 + k + i: i for i in range(k)},
            interpret=interpret,
            compiler_params=_params(interpret),
        )(idx, *vals, *flat)

    out = _on_each_platform(call, idx, [_flat(v) for v in values], [_flat(x) for x in bufs])
    return [_unflat(o, x, rows) for o, x in zip(out, bufs, strict=True)]


def gather(bufs: Sequence[jax.Array], idx: jax.Array) -> list[jax.Array]:
    """`bufs[i][clip(idx, 0, R - 1)]` for every buffer in one kernel. Assumes [R, ...]
    buffers and a [B] int `idx` with B >= 1, rows addressable in its dtype (`check_fits`:
    checked here, when traced)."""
    rows, b = bufs[0].shape[0], idx.shape[0]
    widths = _widths(bufs)
    _check_sizes(rows, b, widths, idx.dtype)

    def call(idx: jax.Array, flat: list[jax.Array], *, interpret: bool):
        return pl.pallas_call(
            functools.partial(_gather_kernel, widths, rows),
            out_shape=[_like(x, (b * w,)) for x, w in zip(flat, widths, strict=True)],
            grid=(b, max(_chunks(w) for w in widths)),
            interpret=interpret,
            compiler_params=_params(interpret),
        )(idx, *flat)

    out = _on_each_platform(call, idx, [_flat(x) for x in bufs])
    return [_unflat(o, x, b) for o, x in zip(out, bufs, strict=True)]
