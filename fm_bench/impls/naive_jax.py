"""The naive JAX baseline: a future map written the way JAX engines do it today.

Maps are plain arrays updated with `.at[idx].set(..., mode="drop")` in jitted functions that
do not donate them, so every write copies the whole map; placeholders are resolved with
`where(ids < 0, map[clip(-ids, 0)], ids)`. It relays lengths and spec extras the same way, so
that it does the same work as fm_jax, only without donation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fm_bench.impls import Op
from fm_bench.impls.jax_common import device_data, int_dtype
from fm_bench.timing import wait_jax
from fm_bench.workload import Config, HostData


@jax.jit
def _set(m: jax.Array, idx: jax.Array, v: jax.Array) -> jax.Array:
    return m.at[idx].set(v.astype(m.dtype), mode="drop")


@jax.jit
def _set_draft(maps: tuple[jax.Array, ...], idx: jax.Array, vals: tuple[jax.Array, ...]) -> Any:
    return tuple(
        m.at[idx].set(v.astype(m.dtype), mode="drop") for m, v in zip(maps, vals, strict=True)
    )


@jax.jit
def _resolve(tok: jax.Array, lens: jax.Array, ids: jax.Array, idx: jax.Array, decode: Any) -> Any:
    ids = jnp.where(ids < 0, tok[jnp.clip(-ids, 0)], ids)
    return ids, jnp.where(decode, lens[idx], 0)


@jax.jit
def _resolve_mixed(tok: jax.Array, ids: jax.Array, seq_lens: jax.Array) -> Any:
    return jnp.where(ids < 0, tok[jnp.clip(-ids, 0)], ids), seq_lens


@jax.jit
def _resolve_draft(maps: tuple[jax.Array, ...], lens: jax.Array, idx: jax.Array) -> Any:
    return tuple(m[idx] for m in maps), lens[idx]


@jax.jit
def _invalidate(idx: jax.Array) -> Any:
    return -idx, -idx


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """The naive maps' ops (no debug mode: it has no checks; sentinel protocol only)."""
    if debug or cfg.gather:
        return {}
    dd = device_data(cfg, data)
    dt = int_dtype(cfg)
    r = cfg.pool
    box: dict[str, Any] = {
        "tok": jnp.zeros((r,), dt),
        "lens": jnp.zeros((r,), dt),
        "ids": -dd.idx,
    }
    if cfg.spec:
        box["extras"] = (
            jnp.zeros((r, cfg.topk), jnp.float32),
            jnp.zeros((r, cfg.topk), dt),
            jnp.zeros((r, cfg.hidden), dd.hidden.dtype),
        )
    idx = dd.idx
    extras_in = (dd.topk_p, dd.topk_index, dd.hidden)

    def publish() -> None:
        box["lens"] = _set(box["lens"], idx, dd.lens)
        wait_jax(box["lens"])

    def stash() -> None:
        box["tok"] = _set(box["tok"], idx, dd.tokens)
        wait_jax(box["tok"])

    def stash_spec() -> None:
        box["tok"] = _set(box["tok"], idx, dd.tokens)
        box["extras"] = _set_draft(box["extras"], idx, extras_in)
        wait_jax((box["tok"], box["extras"]))

    sentinels = -dd.idx

    def resolve_decode() -> None:
        wait_jax(_resolve(box["tok"], box["lens"], sentinels, idx, dd.decode_mode))

    def resolve_mixed() -> None:
        wait_jax(_resolve_mixed(box["tok"], dd.mixed_ids, dd.mixed_lens))

    def resolve_spec() -> None:
        wait_jax(_resolve_draft((box["tok"], *box["extras"]), box["lens"], idx))

    def invalidate() -> None:
        wait_jax(_invalidate(idx))

    def step() -> None:
        if cfg.spec:
            got = _resolve_draft((box["tok"], *box["extras"]), box["lens"], idx)
        else:
            got = _resolve(box["tok"], box["lens"], box["ids"], idx, dd.decode_mode)
        box["lens"] = _set(box["lens"], idx, dd.lens)
        if cfg.spec:
            box["tok"] = _set(box["tok"], idx, dd.tokens)
            box["extras"] = _set_draft(box["extras"], idx, extras_in)
        else:
            box["tok"] = _set(box["tok"], idx, dd.tokens)
        box["ids"], sentinel_lens = _invalidate(idx)
        wait_jax((got, box["tok"], box["lens"], box.get("extras"), sentinel_lens))

    table = {"publish": publish, "invalidate": invalidate, "step": step}
    if cfg.spec:
        table.update(stash_spec=stash_spec, resolve_spec=resolve_spec)
    else:
        table.update(stash=stash, resolve_decode=resolve_decode, resolve_mixed=resolve_mixed)
    return {k: Op(v) for k, v in table.items() if k in ops}
