"""One host-to-device transfer for every host array of a call.

Each numpy argument of a jitted call is its own transfer (30-55 us of host time apiece on
a GPU host). `pack` lays every host leaf end to end in one uint32 buffer, each leaf on a
word; inside the jit `unpack` slices each leaf out and bitcasts it to its dtype. Words,
not bytes: a 4-byte leaf comes back by an elementwise bitcast that XLA fuses into its
consumers (from bytes it would be a reduction with a kernel of its own). Device leaves
pass through. A call's `PackSpec` is static: part of the executable's key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Leaf = tuple[int, tuple[int, ...], np.dtype] | None
"""A packed leaf's (word offset, shape, dtype); None for a leaf passed as it is."""

WORD = 4
"""Bytes per word of the packed buffer (uint32)."""


class PackSpec:
    """Where each leaf of a call's argument tree lives: static, hashable (its hash made
    once: it is looked up on every call).

    Attributes:
      treedef: the argument tree's structure.
      leaves: per leaf, its (word offset, shape, dtype), or None for a device leaf.
      nbytes: the packed buffer's size in bytes, whole words (0: nothing packed).
      words, same: every host leaf is 4 bytes wide (its words go in as they are); and
        of one dtype (the leaves concatenated, viewed once).
    """

    __slots__ = ("_hash", "leaves", "nbytes", "same", "treedef", "words")

    def __init__(self, treedef: Any, leaves: tuple[Leaf, ...], nbytes: int) -> None:
        self.treedef = treedef
        self.leaves = leaves
        self.nbytes = nbytes
        self._hash = hash((treedef, leaves, nbytes))
        dtypes = {leaf[2] for leaf in leaves if leaf is not None}
        self.words = all(d.itemsize == WORD for d in dtypes)
        self.same = self.words and len(dtypes) == 1

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, PackSpec) or self._hash != other._hash:
            return False
        return (self.treedef, self.leaves, self.nbytes) == (
            other.treedef,
            other.leaves,
            other.nbytes,
        )

    def __repr__(self) -> str:
        return f"PackSpec({self.nbytes} bytes, {len(self.leaves)} leaves)"


def _words(nbytes: int) -> int:
    return -(-nbytes // WORD)


def pack(tree: Any) -> tuple[PackSpec, np.ndarray | None, tuple[Any, ...]]:
    """Split `tree`'s leaves into (spec, one packed uint32 buffer of its numpy leaves or
    None when it has none, its other leaves in order). Pad bytes after a leaf are zero."""
    flat, treedef = jax.tree_util.tree_flatten(tree)
    spec: list[Leaf] = []
    host: list[np.ndarray] = []
    device: list[Any] = []
    offset = 0  # words
    for x in flat:
        if isinstance(x, np.ndarray | np.generic):
            a = np.asarray(x)
            # The dtype itself (hashable, no name lookup; bf16's .str is the opaque '|V2').
            spec.append((offset, a.shape, a.dtype))
            host.append(a)
            offset += _words(a.nbytes)
        else:
            spec.append(None)
            device.append(x)
    packed = PackSpec(treedef, tuple(spec), offset * WORD)
    return packed, pack_leaves(packed, host), tuple(device)


def pack_leaves(spec: PackSpec, host: Sequence[np.ndarray]) -> np.ndarray | None:
    """The host leaves of a call laid out by `spec`, in its order, in one uint32 buffer
    (None when there are none)."""
    if not host:
        return None
    if spec.same:  # one 4-byte dtype: their words end to end
        return np.concatenate(host, axis=None).view(np.uint32)
    if spec.words:
        parts = [(a if a.ndim == 1 else a.reshape(-1)).view(np.uint32) for a in host]
        return np.concatenate(parts) if len(parts) != 1 else parts[0]
    raw: list[np.ndarray] = []
    for a in host:
        x = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        raw += [x, np.zeros(-x.size % WORD, np.uint8)]
    return np.concatenate(raw).view(np.uint32)


def _leaf(packed: Any, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """Inside jit: the leaf at word `offset` of `packed` (uint32), at its shape and dtype."""
    if dtype.kind == "c":
        # No bitcast makes a complex number: its interleaved parts come out as floats.
        part = np.dtype(f"float{4 * dtype.itemsize}")
        parts = _leaf(packed, offset, (*shape, 2), part)
        return jax.lax.complex(parts[..., 0], parts[..., 1])
    n = int(np.prod(shape, dtype=np.int64))
    size = dtype.itemsize
    words = jax.lax.slice(packed, (offset,), (offset + _words(n * size),))
    if size == WORD:  # elementwise, same shape: fuses into the consumers
        value = jax.lax.bitcast_convert_type(words, dtype)
    elif size > WORD:  # 8-byte leaves: each value from size // WORD words
        value = jax.lax.bitcast_convert_type(words.reshape(n, size // WORD), dtype)
    else:  # 1- and 2-byte leaves: each word holds WORD // size values, then the pad goes
        as_int = np.dtype(f"uint{8 * size}")
        parts = jax.lax.bitcast_convert_type(words, as_int).reshape(-1)[:n]
        value = parts != 0 if dtype == np.bool_ else jax.lax.bitcast_convert_type(parts, dtype)
    return jnp.reshape(value, shape)


def unpack(spec: PackSpec, packed: Any, device: tuple[Any, ...]) -> Any:
    """Inside jit: the tree `pack` split, host leaves sliced from `packed` at their dtype."""
    out = []
    it = iter(device)
    for leaf in spec.leaves:
        out.append(next(it) if leaf is None else _leaf(packed, *leaf))
    return jax.tree_util.tree_unflatten(spec.treedef, out)
