"""Size buckets: host arrays padded so that a bounded set of shapes reaches the compiler."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from fm_jax.ops.errors import FutureMapError


def power_of_two_buckets(largest: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= `largest`."""
    if largest < 1:
        raise FutureMapError(f"largest bucket must be >= 1, got {largest}")
    out, b = [], 1
    while True:
        out.append(b)
        if b >= largest:
            return tuple(out)
        b *= 2


def normalize_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated positive bucket sizes, or FutureMapError (an empty list, a
    value that is not an int, a size < 1)."""
    ok = isinstance(buckets, Sequence) and not isinstance(buckets, str | bytes)
    if ok and all(
        isinstance(b, int | np.integer) and not isinstance(b, bool | np.bool_) for b in buckets
    ):
        bs = sorted({int(b) for b in buckets})
        if bs and bs[0] >= 1:
            return tuple(bs)
    raise FutureMapError(f"buckets must be a non-empty list of int sizes >= 1, got {buckets!r}")


def bucket_for(n: int, buckets: tuple[int, ...], what: str) -> int:
    """The smallest bucket >= n; FutureMapError if n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise FutureMapError(f"{what} of {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def resolve_sizes(
    rows: int, tokens: int, batch_buckets: tuple[int, ...], token_buckets: tuple[int, ...]
) -> tuple[int, int]:
    """The per-rank (rows, tokens) a resolve is padded to: a function of the token bucket,
    so resolve compiles once per token bucket (and mode), not per (batch, token) pair.

    Tokens go to the smallest token bucket holding max(tokens, rows); rows to the batch
    bucket of min(that, the largest batch bucket). A batch has a token per row at least
    (a spec batch's fewer ids are padded up to its rows), so rows <= tokens. The price:
    a prefill batch's rows are padded up to its token bucket (a few flops a row).

    Args:
      rows, tokens: per-rank sizes (already padded, or real counts).
      batch_buckets, token_buckets: the map's sorted buckets.
    """
    t = bucket_for(max(tokens, rows, 1), token_buckets, "tokens")
    b = bucket_for(max(min(t, batch_buckets[-1]), rows), batch_buckets, "rows")
    if b > t and b <= token_buckets[-1]:
        # The batch buckets skip past t: tokens go up to the rows' bucket, so T >= B (a
        # gather DECODE, its mode traced, gathers one id per row into the T ids).
        t = bucket_for(b, token_buckets, "tokens")
    return b, t


def decode_ids(rows: int, token_buckets: tuple[int, ...]) -> int:
    """The ids per rank of the DECODE batch a step's sentinels make for `rows` rows per
    rank: the smallest token bucket holding them (one id per row, padded), so that the
    batch is placed again as jax arrays, each at a bucket; `rows` where no token bucket
    holds them (no resolve serves that many rows)."""
    i = bisect.bisect_left(token_buckets, rows)
    return token_buckets[i] if i < len(token_buckets) else rows


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """`x` with zero rows (slot 0, token 0, length 0) up to `rows` leading entries."""
    if x.shape[0] == rows:
        return x
    out = np.zeros((rows, *x.shape[1:]), x.dtype)
    out[: x.shape[0]] = x
    return out


def pad_to_bucket(x: np.ndarray, buckets: Sequence[int] | None = None) -> np.ndarray:
    """Pad a host array with zero rows to the smallest bucket that holds it.

    Args:
      x: host array, rows along axis 0 (slots, tokens, lengths or payload rows).
      buckets: allowed sizes; default powers of two up to 8192.

    Returns:
      The padded array; padding rows are zeros (slot 0, token 0, length 0).
    """
    a = np.asarray(x)
    bs = normalize_buckets(buckets) if buckets is not None else power_of_two_buckets(8192)
    return pad_rows(a, bucket_for(a.shape[0], bs, "rows"))
