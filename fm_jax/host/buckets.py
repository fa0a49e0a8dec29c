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
    so resolve compiles once per token bucket, not per (batch, token) pair. The price: a
    prefill batch's rows are padded up to its token bucket (a few flops a row)."""
    t = bucket_for(max(tokens, rows, 1), token_buckets, "tokens")
    b = bucket_for(max(min(t, batch_buckets[-1]), rows), batch_buckets, "rows")
    if b > t and b <= token_buckets[-1]:
        # The batch buckets skip past t: tokens go up to the rows' bucket, so T >= B.
        t = bucket_for(b, token_buckets, "tokens")
    return b, t


def decode_ids(rows: int, token_buckets: tuple[int, ...]) -> int:
    """The ids per rank of the DECODE batch a step's sentinels make for `rows` rows: the
    smallest token bucket holding them, so it is placed again as jax arrays at a bucket."""
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
    """Pad host array `x` (rows along axis 0) with zero rows to the smallest of `buckets`
    that holds it (default powers of two up to 8192)."""
    a = np.asarray(x)
    bs = normalize_buckets(buckets) if buckets is not None else power_of_two_buckets(8192)
    return pad_rows(a, bucket_for(a.shape[0], bs, "rows"))
