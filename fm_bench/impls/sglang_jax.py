"""sglang-jax's future token map, reproduced as its overlap worker runs it.

The peer (sgl-project/sglang-jax, `python/sgl_jax/srt/managers/utils.py` and
`tp_worker_overlap_thread.py`) keeps one int32 map of `R + 2` entries, where R is the request
pool size. A request's slot is `req_pool_idx + 1`; a padding row (seq_len 0) gets slot
`R + 2`, past the end, so the scatter drops it, and its placeholder is 0. The map lives
replicated on the mesh (`P(None)`) and is never donated: every write returns a new map.

Per step the peer runs, in this order:
- on the host, while building the batch: the slots and the placeholders `-slot` from the
  batch's numpy `seq_lens` and `req_pool_indices`;
- at forward entry, one jitted dispatch (mesh static): reshard the batch's `input_ids` (a
  device array sharded `P("data")`) to replicated, `where(ids < 0, map[clip(-ids, 0)], ids)`,
  reshard back to `P("data")`;
- after sampling, one jitted dispatch (mesh static): reshard the sampled tokens (a device
  array sharded `P("data")`) and the numpy slots to replicated, and
  `map.at[slots].set(tokens, mode="drop")`.

Tokens only: no lengths, no spec extras, no debug mode. The map is int32 whatever the
configuration's dtype (the peer's map always is). The mesh is the peer's ("data", "tensor")
mesh with explicit axes, here over one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fm_bench.impls import Op
from fm_bench.timing import wait_jax
from fm_bench.workload import Config, HostData

MAP_DTYPE = np.int32
"""The peer's map dtype, in every configuration."""


def make_mesh() -> Mesh:
    """The peer's ("data", "tensor") mesh with explicit axes, over the first device."""
    devices = np.array(jax.devices()[:1]).reshape(1, 1)
    return Mesh(devices, ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)


@jax.jit(static_argnames=("mesh",))
def resolve_future_token_ids(input_ids: jax.Array, token_map: jax.Array, mesh: Mesh) -> jax.Array:
    """Placeholders (< 0) replaced from the map; other ids kept. Output sharded P("data")."""
    ids = jax.sharding.reshard(input_ids, NamedSharding(mesh, P()))
    ids = jnp.where(ids < 0, token_map[jnp.clip(-ids, min=0)], ids)
    return jax.sharding.reshard(ids, NamedSharding(mesh, P("data")))


@jax.jit(static_argnames=("mesh",))
def set_future_token_ids(
    token_map: jax.Array, slots: Any, tokens: jax.Array, mesh: Mesh
) -> jax.Array:
    """A new map with `tokens` at `slots` (slots past the end dropped); the old map kept."""
    tokens = jax.sharding.reshard(tokens, NamedSharding(mesh, P()))
    slots = jax.sharding.reshard(slots, NamedSharding(mesh, P()))
    return token_map.at[slots].set(tokens, mode="drop")


def future_slots(seq_lens: np.ndarray, req_pool_indices: np.ndarray, map_size: int) -> np.ndarray:
    """Host: each row's map slot, `req_pool_idx + 1`; padding rows (seq_len 0) `map_size`."""
    live = seq_lens > 0
    return np.where(live, req_pool_indices.astype(np.int32) + 1, np.int32(map_size)).astype(
        np.int32
    )


def placeholders(seq_lens: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Host: the next batch's input ids for these rows, `-slot` (padding rows 0)."""
    return np.where(seq_lens > 0, -slots, 0).astype(np.int32)


class FutureTokenMap:
    """The peer's map and its two jitted ops on one mesh (the map replicated, not donated).

    Args:
      pool_size: R, rows of the request pool; the map has R + 2 entries.
      mesh: defaults to `make_mesh()`.
    """

    def __init__(self, pool_size: int, mesh: Mesh | None = None) -> None:
        self.mesh = mesh if mesh is not None else make_mesh()
        self.size = pool_size + 2
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.map = jax.device_put(
            jnp.zeros((self.size,), MAP_DTYPE), NamedSharding(self.mesh, P(None))
        )

    def on_mesh(self, a: np.ndarray) -> jax.Array:
        """A host array as the peer's batch arrays arrive: int32, sharded P("data")."""
        return jax.device_put(np.asarray(a, MAP_DTYPE), self.batch_sharding)

    def set(self, slots: np.ndarray, tokens: jax.Array) -> None:
        """`map[slots] := tokens` (a new map; numpy slots, device tokens, as the peer)."""
        self.map = set_future_token_ids(self.map, slots, tokens, self.mesh)

    def resolve(self, input_ids: jax.Array) -> jax.Array:
        """The batch's input ids with placeholders filled from the map."""
        return resolve_future_token_ids(input_ids, self.map, self.mesh)  # type: ignore[no-any-return]


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """The peer's ops on a plain map (none for spec or debug: it has neither, and none for
    the gather protocol: the peer relays by placeholders).

    'stash' is the set dispatch, 'resolve_decode' / 'resolve_mixed' the resolve dispatch,
    'invalidate' the host work that stands in for it (slots and placeholders), and 'step'
    all three in the peer's order. 'step' returns the resolved ids.
    """
    if debug or cfg.spec or cfg.gather:
        return {}
    fm = FutureTokenMap(cfg.pool)
    # The bench's slots play the peer's req_pool_indices; host seq_lens are all live.
    rpi, seq_lens = data.idx, data.lens
    slots = future_slots(seq_lens, rpi, fm.size)
    tokens = fm.on_mesh(data.tokens)  # the sampler's output: on the device, P("data")
    decode_ids = fm.on_mesh(placeholders(seq_lens, slots))
    # MIXED: prefill ids, then the running rows' placeholders (bench sentinel -s -> -(s+1)).
    mixed = data.mixed_ids
    mixed_ids = fm.on_mesh(np.where(mixed < 0, mixed - 1, mixed))
    fm.set(slots, tokens)
    wait_jax(fm.map)

    def stash() -> None:
        fm.set(slots, tokens)
        wait_jax(fm.map)

    def resolve(ids: jax.Array) -> jax.Array:
        return wait_jax(fm.resolve(ids))

    def invalidate() -> np.ndarray:
        return placeholders(seq_lens, future_slots(seq_lens, rpi, fm.size))

    def step() -> jax.Array:
        s = future_slots(seq_lens, rpi, fm.size)
        placeholders(seq_lens, s)  # handed to the scheduler for the next batch
        out = fm.resolve(decode_ids)
        fm.set(s, tokens)
        return wait_jax((out, fm.map))[0]

    table = {
        "stash": Op(stash),
        "resolve_decode": Op(lambda: resolve(decode_ids)),
        "resolve_mixed": Op(lambda: resolve(mixed_ids)),
        "invalidate": Op(invalidate),
        "step": Op(step),
    }
    return {k: v for k, v in table.items() if k in ops}
