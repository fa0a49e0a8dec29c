"""Trace-time structural checks: rank, shape and dtype of op inputs (no values read)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax.ops import errors
from fm_jax.ops.errors import FutureMapError


def _dtype(x: Any) -> np.dtype:
    return np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)


def check_1d_int(name: str, x: Any, into: np.dtype | None = None) -> None:
    """Raise FutureMapError unless `x` is a 1-D integer array (whose values all fit `into`)."""
    shape = jnp.shape(x)
    if len(shape) != 1:
        raise FutureMapError(f"{name} must be 1-D, got shape {shape}")
    check_ints(name, x, into)


def check_ints(name: str, x: Any, into: np.dtype | None = None) -> None:
    """Raise FutureMapError unless `x` has an integer dtype (whose values all fit `into`)."""
    if not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must have an integer dtype, got {_dtype(x)}")
    check_fits(name, x, into)


def check_fits(name: str, x: Any, into: np.dtype | None) -> None:
    """Raise unless every value of `x`'s dtype (as JAX holds it) fits `into` without a cast
    that could change it: an int64 array into an int32 buffer is refused, not truncated."""
    held = jax.dtypes.canonicalize_dtype(_dtype(x))
    if into is not None and not np.can_cast(held, into, "safe"):
        raise FutureMapError(
            f"{name} has dtype {held}, which the {np.dtype(into)} buffers cannot hold without "
            "a value check: cast it first"
        )


def check_rows(name: str, x: Any, rows: int) -> None:
    """Raise unless `x` has `rows` leading entries (one per batch row)."""
    if jnp.shape(x)[0] != rows:
        raise FutureMapError(f"{name} has {jnp.shape(x)[0]} rows, indices have {rows}")


def check_array(name: str, x: Any, shape: tuple[int, ...]) -> None:
    """Raise unless `x` is given and has exactly `shape`."""
    if x is None:
        raise FutureMapError(f"{name} is missing")
    if tuple(jnp.shape(x)) != shape:
        raise FutureMapError(f"{name} must have shape {shape}, got {tuple(jnp.shape(x))}")


def check_int_array(name: str, x: Any) -> None:
    """Raise unless `x` is an integer array or scalar (of any shape)."""
    if x is None or isinstance(x, str) or not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must be an int array, got {x!r}")


def check_scalar_int(name: str, x: Any) -> None:
    """Raise unless `x` is a 0-d integer (the forward mode)."""
    shape = np.shape(x)  # no jnp.shape: it will refuse None and strings
    if shape != () or not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must be an int scalar, got shape {shape} {_dtype(x)}")


def check_declared_dtype(name: str, x: Any, dtype: np.dtype) -> None:
    """Raise unless `x` has `dtype`, the declared dtype of a field that is not an int."""
    if _dtype(x) != dtype:
        raise errors.not_the_declared_dtype(name, _dtype(x), dtype)
