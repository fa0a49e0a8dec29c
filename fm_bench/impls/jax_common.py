"""Helpers shared by the JAX implementations: dtypes and device arrays of the host data."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_bench.workload import Config, HostData


def int_dtype(cfg: Config) -> np.dtype:
    """The JAX int dtype of `cfg`; int64 needs JAX_ENABLE_X64=1 (bench runs it in a child)."""
    if cfg.dtype == "int64" and not jax.config.read("jax_enable_x64"):
        raise RuntimeError("int64 configurations need JAX_ENABLE_X64=1")
    return np.dtype(cfg.dtype)


class DeviceData(NamedTuple):
    """The host data on JAX's default device, in the configuration's dtypes."""

    idx: jax.Array
    tokens: jax.Array
    lens: jax.Array
    mixed_ids: jax.Array
    mixed_lens: jax.Array
    topk_p: jax.Array
    topk_index: jax.Array
    hidden: jax.Array
    decode_mode: jax.Array
    mixed_mode: jax.Array
    mixed_gather_ids: jax.Array  # gather protocol: prefill ids, then 0 at running positions
    mixed_token_slots: jax.Array  # gather protocol: the running rows' slots at their positions


def device_data(cfg: Config, data: HostData) -> DeviceData:
    """Put `data` on the device (hidden states in the configured hidden dtype)."""
    dt = int_dtype(cfg)
    dev = jax.devices()[0]

    def put(a: Any) -> jax.Array:
        # Committed, as arrays an engine keeps on its device are.
        return jax.device_put(a, dev)

    def ints(a: np.ndarray) -> jax.Array:
        return put(a.astype(dt))

    gather_ids, token_slots = data.mixed_token_slots()

    return DeviceData(
        idx=ints(data.idx),
        tokens=ints(data.tokens),
        lens=ints(data.lens),
        mixed_ids=ints(data.mixed_ids),
        mixed_lens=ints(data.mixed_lens),
        topk_p=put(data.topk_p),
        topk_index=ints(data.topk_index),
        hidden=put(data.hidden.astype(jnp.dtype(cfg.hidden_dtype))),
        decode_mode=put(np.int32(1)),
        mixed_mode=put(np.int32(2)),
        mixed_gather_ids=ints(gather_ids),
        mixed_token_slots=ints(token_slots),
    )
