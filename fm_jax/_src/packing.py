"""One host-to-device transfer for every host array of a call.

Each numpy argument of a jitted call is its own transfer: on a GPU host about 30-55 us of
host time apiece, several times the dispatch itself. `pack` lays every host leaf of a call's
arguments end to end in one uint8 buffer built on the host; inside the jit `unpack` slices
each leaf back out and bitcasts it to its dtype (XLA fuses the slice into its consumer:
no extra kernel, no copy). Device leaves (jax arrays) pass through as they are. A call's
`PackSpec` (the tree's structure, and each leaf's offset, shape and dtype) is static: it is
part of the executable's key, so one executable serves every call of the same layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Leaf = tuple[int, tuple[int, ...], np.dtype] | None
"""A packed leaf's (byte offset, shape, dtype); None for a leaf passed as it is."""


class PackSpec(NamedTuple):
    """Where each leaf of a call's argument tree lives: static, hashable.

    Attributes:
      treedef: the argument tree's structure.
      leaves: per leaf, its (offset, shape, dtype) in the packed buffer, or None for a
        device leaf, passed on its own.
      nbytes: the packed buffer's size (0: nothing packed).
    """

    treedef: Any
    leaves: tuple[Leaf, ...]
    nbytes: int


def pack(tree: Any) -> tuple[PackSpec, np.ndarray | None, tuple[Any, ...]]:
    """Split `tree`'s leaves into one packed host buffer and the device leaves.

    Host leaves are numpy arrays and numpy scalars; every other leaf (a jax array) is a
    device leaf. Returns (spec, the packed uint8 buffer or None when no leaf is on the
    host, the device leaves in order).
    """
    flat, treedef = jax.tree_util.tree_flatten(tree)
    spec: list[Leaf] = []
    host: list[np.ndarray] = []
    device: list[Any] = []
    offset = 0
    for x in flat:
        if isinstance(x, np.ndarray | np.generic):
            a = np.asarray(x)
            if not a.flags.c_contiguous:
                a = a.copy()  # (np.ascontiguousarray would make a scalar 1-D)
            # The dtype itself (hashable, no name lookup; bf16's .str is the opaque '|V2').
            spec.append((offset, a.shape, a.dtype))
            host.append(a.reshape(-1).view(np.uint8))
            offset += a.nbytes
        else:
            spec.append(None)
            device.append(x)
    packed = None
    if host:
        packed = host[0] if len(host) == 1 else np.concatenate(host)
    return PackSpec(treedef, tuple(spec), offset), packed, tuple(device)


def pack_host(tree: Any) -> tuple[PackSpec, np.ndarray] | None:
    """`tree` packed when every leaf is on the host and there is one; else None (checked
    before anything is copied)."""
    flat = jax.tree_util.tree_leaves(tree)
    if not flat or not all(isinstance(x, np.ndarray | np.generic) for x in flat):
        return None
    spec, packed, _ = pack(tree)
    assert packed is not None
    return spec, packed


def unpack(spec: PackSpec, packed: Any, device: tuple[Any, ...]) -> Any:
    """Inside jit: the tree `pack` split, host leaves sliced from `packed` at their dtype."""
    out = []
    it = iter(device)
    for leaf in spec.leaves:
        if leaf is None:
            out.append(next(it))
            continue
        offset, shape, dtype = leaf
        n = int(np.prod(shape, dtype=np.int64))
        raw = jax.lax.slice(packed, (offset,), (offset + n * dtype.itemsize,))
        if dtype == np.bool_:
            value = raw != 0
        elif dtype.itemsize == 1:
            value = jax.lax.bitcast_convert_type(raw, dtype)
        else:
            value = jax.lax.bitcast_convert_type(raw.reshape(n, dtype.itemsize), dtype)
        out.append(jnp.reshape(value, shape))
    return jax.tree_util.tree_unflatten(spec.treedef, out)
