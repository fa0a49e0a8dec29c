"""Trace-time structural checks: rank, shape and dtype of op inputs (no values read)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from fm_jax._src.errors import FutureMapError


def _dtype(x: Any) -> np.dtype:
    return np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)


def check_1d_int(name: str, x: Any) -> None:
    """Raise FutureMapError unless `x` is a 1-D integer array."""
    shape = jnp.shape(x)
    if len(shape) != 1:
        raise FutureMapError(f"{name} must be 1-D, got shape {shape}")
    if not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must have an integer dtype, got {_dtype(x)}")


def check_rows(name: str, x: Any, rows: int) -> None:
    """Raise unless `x` has `rows` leading entries (one per batch row)."""
    if jnp.shape(x)[0] != rows:
        raise FutureMapError(f"{name} has {jnp.shape(x)[0]} rows, indices have {rows}")


def check_array(name: str, x: Any, shape: tuple[int, ...], dtypes: tuple[np.dtype, ...]) -> None:
    """Raise unless `x` has exactly `shape` and one of `dtypes`."""
    if x is None:
        raise FutureMapError(f"{name} is missing")
    if tuple(jnp.shape(x)) != shape:
        raise FutureMapError(f"{name} must have shape {shape}, got {tuple(jnp.shape(x))}")
    if _dtype(x) not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise FutureMapError(f"{name} must have dtype in ({allowed}), got {_dtype(x)}")


def check_scalar_int(name: str, x: Any) -> None:
    """Raise unless `x` is a 0-d integer (the forward mode)."""
    if jnp.shape(x) != () or not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must be an int scalar, got shape {jnp.shape(x)} {_dtype(x)}")
