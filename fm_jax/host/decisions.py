"""A call's placement decided once per layout (`Decision`, run on every call of it), the
executable's `Key`, and packing: every host array of a call in one uint32 buffer, one
transfer (each numpy argument of a jitted call is a transfer of its own, 30-55 us of host
time apiece on a GPU host), sliced out inside the jit by `unpack`. Words, not bytes: a
4-byte leaf comes back by an elementwise bitcast XLA fuses into its consumers."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax.ops import relay_fields as rf
from fm_jax.ops.types import Batch, DraftPayload, ForwardMode

FIXED_MODES = {m.name.lower(): m for m in ForwardMode}
"""The ForwardMode a fixed-mode executable is traced with, by its key's mode (`Key.mode`)."""


class Key(NamedTuple):
    """One executable: an operation ('publish', ..., 'resolve', or an engine's 'step') and
    the static sizes and inputs it was traced for. `mode`: a resolve's kind fixed in it
    ('extend': not DECODE, 'decode'), 'traced', a step's ForwardMode name, or '' for the
    other ops; `ids` False: a gather-protocol DECODE (T = B); `omits`: a partial stash's
    fields left out."""

    op: str
    rows: int
    tokens: int = 0
    draft: bool = False
    slots: bool = False
    mode: str = ""
    ids: bool = True
    confidence: bool = False
    omits: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The executable's name as `FutureMap.executables()` and warm-up reports give it:
        'resolve_fixed_extend', 'publish', 'step_fixed_mixed', 'resolve'."""
        fixed = self.mode in FIXED_MODES
        base = f"{self.op}_fixed_{self.mode}" if fixed else self.op
        return base + ("_with_confidence" if self.confidence else "")

    def describe(self) -> str:
        """The key in words: the op and its per-rank sizes."""
        if not self.tokens:
            partial = f" without {', '.join(self.omits)}" if self.omits else ""
            return f"{self.name} at {self.rows} rows per rank{partial}"
        return (
            f"{self.name} at {self.rows} rows x {self.tokens} tokens per rank"
            f"{' with a draft' if self.draft else ''}{' with token slots' if self.slots else ''}"
        )


Placer = Callable[[Any], Any] | None
"""A value of a decided layout -> what the executable takes; None: taken as it is."""


class Rows(NamedTuple):
    """One input's row layout and its placer; with `array`, a value placed.

    Attributes:
      array: what the executable takes; None in a decision.
      size: rows per DP rank after padding (a bucket size).
      counts: real rows per DP rank, all ranks in order; None for a jax array (not read).
      by_rank: given as a mapping DP rank -> rows.
      place: the placer of values of this layout (None: taken as it is).
    """

    array: Any
    size: int
    counts: tuple[int, ...] | None
    by_rank: bool
    place: Placer = None

    @property
    def empty(self) -> bool:
        """No real row on any rank (an idle call)."""
        return self.counts is not None and not any(self.counts)

    def has_rows(self, rank: int) -> bool:
        """Whether DP rank `rank` has real rows (a jax array's are not read: taken as yes)."""
        return self.counts is None or bool(self.counts[rank])

    def placed(self, x: Any) -> Rows:
        """`x` placed, with this row layout."""
        place = self.place
        return Rows(x if place is None else place(x), self.size, self.counts, self.by_rank, place)


Leaf = tuple[int, tuple[int, ...], np.dtype] | None
"""A packed leaf's (word offset, shape, dtype); None for a leaf passed as it is."""

WORD = 4
"""Bytes per word of the packed buffer (uint32)."""


class PackSpec:
    """Where each leaf of a call's argument tree lives: static, part of the executable's
    key, its hash made once (looked up on every call). `words`: every host leaf 4 bytes
    wide; `same`: and of one dtype (the leaves concatenated, viewed once)."""

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


class Placed(NamedTuple):
    """A call placed for its executable: its arguments after the state (an engine step's
    `(packed, device leaves)`), their packing (None: not packed), the slots as placed and a
    tail's lengths as placed (for their host copy)."""

    key: Key
    args: tuple[Any, ...]
    pack: PackSpec | None
    idx: Rows
    lens: Any = None


_JAX_TYPES: set[type] = set()
"""The concrete jax.Array types seen (an isinstance check of the ABC costs ~1 us)."""


def _kind(x: Any) -> Any:
    """One value's part of a layout; raises TypeError for a value with no layout."""
    t = type(x)
    if t is np.ndarray:
        return (x.shape, x.dtype)
    if x is None or t is ForwardMode:
        return x
    if t in _JAX_TYPES or isinstance(x, jax.Array):
        _JAX_TYPES.add(t)
        aval = x.aval  # one attribute read: its shape and dtype properties read it each
        if 0 not in aval.shape:  # an empty jax array is placed as a host one
            return ("jax", aval.shape, aval.dtype)
    raise TypeError


def signature(
    op: str, values: Sequence[Any], rows: int | None, tokens: int | None, kinds: Any = None
) -> tuple[Any, ...] | None:
    """The layout of a call of `op` on `values` (None: a call with no layout, such as a
    mapping of ranks, a list, an empty jax array or a plain int mode)."""
    if not values:
        return None
    try:
        return (op, rows, tokens, kinds, *map(_kind, values))
    except TypeError:
        return None


def resolve_values(
    batch: Any, step: Sequence[Any] | None, inputs: Mapping[str, Any] | None
) -> tuple[Any, ...]:
    """A resolve call's values in decision order: the batch's fields, then the declared
    inputs (() for a call with no layout: a mapping of ranks, inputs not a dict)."""
    if type(batch) is not Batch:
        return ()
    head = tuple(batch)
    if step is None:
        return head
    if inputs is None:  # as `{}` (refused later if some are declared)
        inputs = {}
    if type(inputs) is not dict or len(inputs) != len(step):
        return ()
    try:
        return head + tuple(inputs[d.name] for d in step)
    except KeyError:
        return ()


def payload_values(fields: tuple[rf.RelayField, ...], payload: Any) -> tuple[Any, ...]:
    """A tail call's payload leaves in decision order (a DraftPayload: its declared fields)."""
    if type(payload) is DraftPayload:
        if payload.extras is not None and type(payload.extras) is not dict:
            return (payload,)  # refused when decided, named there
        return tuple(rf.get(payload, f.name) for f in fields)
    if payload is None:  # a publish: no payload leaves
        return (None,) * max(len(fields), 1)
    return (payload,)


def payload_kind(payload: Any) -> Any:
    """What a payload is, for a layout's signature: tokens, or a DraftPayload's field set."""
    if type(payload) is DraftPayload:
        extras = () if payload.extras is None else tuple(sorted(payload.extras))
        return ("draft", extras)
    return "rows"


def constant(value: Any) -> Callable[[Any], Any]:
    """A placer that places `value` whatever it is given (a mode fixed in the executable;
    ids never read)."""
    return lambda _: value


class Decision:
    """How every call of one layout is placed: per value its placer, `assemble` (placed
    values -> the executable's arguments), the slots' layout at `idx_at`, a tail's lengths
    at `lens_at`, the batch's value rules, and whether the arguments are packed (a step)."""

    def __init__(
        self,
        key: Key,
        placers: Sequence[Callable[[Any], Any] | None],
        assemble: Callable[[list[Any]], tuple[Any, ...]],
        *,
        idx: Rows,
        idx_at: int,
        lens_at: int | None = None,
        batch_check: Callable[[Sequence[Any], list[Any]], None] | None = None,
        packed: bool = False,
    ) -> None:
        self.key = key
        # (position, placer) of the values not taken as they are
        self.placers = tuple((i, p) for i, p in enumerate(placers) if p is not None)
        self.assemble = assemble
        self.idx, self.idx_at, self.lens_at = idx, idx_at, lens_at
        self.batch_check = batch_check
        self.packed = packed
        self.pack: PackSpec | None = None  # a step's, laid out by its first call
        self._host: list[int] = []  # positions of the packed host leaves among the values
        self._device: list[int] = []  # and of the device leaves passed beside the buffer

    def run(self, values: Sequence[Any]) -> Placed:
        """Place a call of this layout: value checks, padding, packing."""
        placed = list(values)  # as many as the placers: the layout's signature matched
        for i, place in self.placers:
            placed[i] = place(placed[i])
        if self.batch_check is not None:
            self.batch_check(values, placed)
        idx = self.idx
        rows = Rows(placed[self.idx_at], idx.size, idx.counts, idx.by_rank, idx.place)
        key = self.key
        lens = None if self.lens_at is None else placed[self.lens_at]
        if not self.packed:
            return Placed(key, self.assemble(placed), None, rows, lens)
        if self.pack is None:  # the layout's first call: its packing laid out as it packs
            spec, buffer, device = pack(self.assemble(placed))
            self._layout(spec, placed)
            return Placed(key, (buffer, device), spec, rows, lens)
        buffer = pack_leaves(self.pack, [placed[i] for i in self._host])
        return Placed(key, (buffer, tuple(placed[i] for i in self._device)), self.pack, rows, lens)

    def _layout(self, spec: PackSpec, placed: list[Any]) -> None:
        """Record `spec`, the packing laid out by the first call, and which value positions
        are its host leaves (packed, in tree order) and which its device leaves."""
        self.pack = spec
        markers = [None if x is None else i for i, x in enumerate(placed)]
        order = jax.tree_util.tree_leaves(self.assemble(markers))
        for i, leaf in zip(order, spec.leaves, strict=True):
            (self._device if leaf is None else self._host).append(i)
