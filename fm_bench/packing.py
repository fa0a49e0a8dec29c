"""A baseline engine's own packing: every host array of a call in one int32 buffer, one
transfer, unpacked inside the jit.

The engine-step group's `no_map_packed` and `no_map_carry` baselines stand for an engine
that packs its own host arrays (vLLM's TPU runner does), so they pack with this, not with
fm_jax's packing (fm_jax packs inside `FutureMap`; the bench compares against an engine
doing the same on its own). The idea is fm_jax's (`fm_jax/host/decisions.py`): leaves laid
end to end as 32-bit words, each sliced back out and bitcast inside the jit, which XLA
fuses into the consumers. This version is the plain one a baseline needs: every leaf is a
numpy array of a 4-byte dtype (int32, uint32, float32); no device leaves, no other sizes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

WORD = np.dtype(np.int32)
"""The packed buffer's element: one 32-bit word."""


class Layout(NamedTuple):
    """Where each leaf of a packed tree lives: static and hashable (close over it in the
    jitted function)."""

    treedef: Any
    leaves: tuple[tuple[int, tuple[int, ...], np.dtype], ...]
    """Per leaf: its word offset, shape and dtype."""


def pack(tree: Any) -> tuple[Layout, np.ndarray]:
    """`tree`'s numpy leaves end to end in one int32 buffer, and their layout.

    Raises:
      TypeError: a leaf is not a numpy array (or scalar) of a 4-byte dtype.
    """
    flat, treedef = jax.tree_util.tree_flatten(tree)
    leaves, words, offset = [], [], 0
    for x in flat:
        if not isinstance(x, np.ndarray | np.generic) or np.asarray(x).dtype.itemsize != 4:
            raise TypeError(f"pack takes numpy leaves of a 4-byte dtype, got {type(x)}")
        a = np.ascontiguousarray(x)
        leaves.append((offset, a.shape, a.dtype))
        words.append(a.reshape(-1).view(WORD))
        offset += a.size
    buf = np.concatenate(words) if words else np.zeros(0, WORD)
    return Layout(treedef, tuple(leaves)), buf


def unpack(layout: Layout, buf: Any) -> Any:
    """Inside jit: the tree `pack` laid out, each leaf sliced from `buf` at its dtype."""
    out = []
    for offset, shape, dtype in layout.leaves:
        n = int(np.prod(shape, dtype=np.int64))
        words = jax.lax.slice(buf, (offset,), (offset + n,))
        value = words if dtype == WORD else jax.lax.bitcast_convert_type(words, dtype)
        out.append(value.reshape(shape))
    return jax.tree_util.tree_unflatten(layout.treedef, out)
