"""Checkify errors carried out of a jitted op as one small int array (the FutureMap class).

A `checkify.Error` leaves a jitted call as several scalar arrays plus a Python-level pytree
rebuild (~7 us a call here), paid on every debug op. The class's debug ops return instead
one int array: an id naming the trace that produced it, then the error's leaves widened to
one int dtype. `ErrorPacker.unpack` rebuilds the Error on the host when the map checks, off
the per-step path. The leaves stack along a new last axis, so sharded leaves would stay
sharded (no collective); the packer is used for single-device maps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from fm_jax._src.errors import FutureMapError


class ErrorPacker:
    """Packs checkify errors inside jitted ops and unpacks them on the host.

    One packer per map: it remembers, per trace of any of the map's ops, the error's pytree
    structure and leaf dtypes (a few per bucket and op; traces happen at warm-up).
    """

    def __init__(self) -> None:
        self._layouts: list[tuple[Any, list[tuple[tuple[int, ...], np.dtype]]]] = []

    def pack(self, err: checkify.Error) -> jax.Array:
        """Inside jit: `err` as one int array [..., 1 + leaves] (trace id first)."""
        leaves, treedef = jax.tree_util.tree_flatten(err)
        if not leaves:
            raise FutureMapError("internal: a checkified op produced an error with no leaves")
        shape = jnp.shape(leaves[0])
        for leaf in leaves:
            kind = jnp.dtype(leaf.dtype).kind
            if jnp.shape(leaf) != shape or kind not in "biu":
                raise FutureMapError(
                    f"internal: cannot pack a checkify error leaf {leaf.shape} {leaf.dtype}"
                )
        wide = jnp.result_type(*(leaf.dtype for leaf in leaves), jnp.int32)
        trace_id = len(self._layouts)
        self._layouts.append((treedef, [(tuple(jnp.shape(x)), np.dtype(x.dtype)) for x in leaves]))
        parts = [jnp.full(shape, trace_id, wide), *(leaf.astype(wide) for leaf in leaves)]
        return jnp.stack(parts, axis=-1)

    def unpack(self, packed: np.ndarray) -> checkify.Error:
        """On the host: the checkify.Error that `pack` packed into `packed`."""
        flat = np.asarray(packed)
        trace_id = int(flat[..., 0].reshape(-1)[0])
        treedef, metas = self._layouts[trace_id]
        leaves = [
            flat[..., 1 + i].astype(dtype).reshape(shape) for i, (shape, dtype) in enumerate(metas)
        ]
        return jax.tree_util.tree_unflatten(treedef, leaves)  # type: ignore[no-any-return]
