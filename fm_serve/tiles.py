"""Row tiles: matmuls and row reductions whose result for a row never depends on the batch.

XLA chooses GEMM blocking and reduction vectorisation by shape, so `x @ w` or a row mean
over a [T, d] array can round a row differently for different T. Applied to fixed-shape
tiles of rows, each row's result is bitwise the same whatever the batch size or the row's
place in it, which is what lets two schedules of the same requests (a synchronous loop and
an overlap loop, whose batches differ once a stop is read a step late) produce the same
tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def by_tiles(fn: Callable[[jax.Array], jax.Array], x: jax.Array, row_tile: int) -> jax.Array:
    """`fn` applied to `row_tile` rows of `x` at a time (x.shape[0] a multiple of it)."""
    rows = x.shape[0]
    if rows % row_tile:
        raise ValueError(f"{rows} rows is not a multiple of the row tile {row_tile}")
    if rows == row_tile:
        return fn(x)
    # Unrolled: a rolled loop is an XLA while loop, whose output buffer is a copy of a
    # broadcast and, on a GPU, whose trip test the host waits for each iteration.
    _, tiles = jax.lax.scan(
        lambda c, a: (c, fn(a)),
        None,
        x.reshape(rows // row_tile, row_tile, *x.shape[1:]),
        unroll=True,
    )
    return tiles.reshape(rows, *tiles.shape[2:])


def dense(x: jax.Array, w: jax.Array, row_tile: int) -> jax.Array:
    """`x @ w`, batch-invariant (see `by_tiles`); x.shape[0] must be a multiple of row_tile."""
    return by_tiles(lambda a: a @ w, x, row_tile)
