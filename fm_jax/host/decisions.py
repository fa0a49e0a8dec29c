"""A call's placement decided once per layout, and the one function that places its values.

A call's layout is its op, the explicit sizes, and per value its kind (a host array, a
jax array, None, a host ForwardMode), shape and dtype (`signature`). Everything placement
works out from the layout alone (the padded sizes, the executable's key, each value's
placer, how the arguments are assembled, the protocol's rules on kinds and counts) is a
`Decision`. `Decision.run(values)` places a call: each value through its placer (its value
checks and padding; a jax array as it is), the batch's value rules, the packing. The first
call of a layout runs the decision it was just given; a later call of the layout looks the
decision up and runs it; a call with no layout (a mapping of ranks, a list, a plain int
mode) is decided afresh each time. There is no other placer. Each input's part of a
decision is a `Field` (`host_inputs` decides it); what it places is `Rows`.

Which executable serves a call is its `Key` (made by the decision, read by the registry):
the class, its engine steps, warm-up and the serving guard all key executables by it, so a
call finds what warm-up compiled for it by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.host.packing import PackSpec, pack, pack_leaves
from fm_jax.ops.types import ForwardMode

OPS = ("publish", "stash", "finish", "sentinels", "seq_lens_at", "resolve", "step")
"""The executables' operations: the class's entry points, and an engine's whole step."""

MODES = ("extend", "decode", "traced")
"""How a resolve (or a step) knows its batch's kind: fixed when traced, not DECODE or
DECODE (no branch in the executable), or traced (the mode is an argument)."""

FIXED_MODES = {m.name.lower(): m for m in ForwardMode}
"""The ForwardMode a fixed-mode executable is traced with, by its key's mode. A resolve's
relay depends on the kind only (DECODE or not): its keys use 'extend' for every batch that
is not DECODE. An engine step's forward sees the mode itself: its keys name it exactly."""


class Key(NamedTuple):
    """One executable: an operation and the static sizes and inputs it was traced for.

    Attributes:
      op: one of OPS.
      rows: rows per DP rank (a batch bucket).
      tokens: tokens per rank (a resolve's or a step's token bucket); 0 for a tail op.
      draft: a resolve with draft indices.
      slots: a resolve with token slots.
      mode: a resolve's or a step's mode (one of MODES); '' for the other ops.
      checked: a debug map's tail op with its slot checks (False: slots already checked,
        on the host or by the last resolve).
      ids: a resolve that places input ids (False: a gather-protocol DECODE whose ids are
        gathered, T = B); a spec DECODE at the same sizes may come either way.
      confidence: a publish or finish that also writes confidence rows (and returns a copy
        of the confidence buffer for its host ring).
      omits: a partial stash's (or finish's) declared fields left out, in stash order; ()
        for a full one. Which fields a draft carries is its pytree structure: static.
    """

    op: str
    rows: int
    tokens: int = 0
    draft: bool = False
    slots: bool = False
    mode: str = ""
    checked: bool = True
    ids: bool = True
    confidence: bool = False
    omits: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The executable's name as `FutureMap.executables()` and warm-up reports give it:
        'resolve_fixed_extend', 'unchecked_publish', 'step_fixed_mixed', 'resolve'."""
        fixed = self.mode in FIXED_MODES
        base = f"{self.op}_fixed_{self.mode}" if fixed else self.op
        base += "_with_confidence" if self.confidence else ""
        return base if self.checked else f"unchecked_{base}"

    def describe(self) -> str:
        """The key in words: the op and its per-rank sizes."""
        if not self.tokens:
            partial = f" without {', '.join(self.omits)}" if self.omits else ""
            return f"{self.name} at {self.rows} rows per rank{partial}"
        return (
            f"{self.name} at {self.rows} rows x {self.tokens} tokens per rank"
            f"{' with a draft' if self.draft else ''}{' with token slots' if self.slots else ''}"
        )


def writes_state(op: str, debug: bool) -> bool:
    """Whether `op` writes the map's state, so takes it donated: the tail ops always,
    resolve only in debug (the consume poison), a step always."""
    return op in ("publish", "stash", "finish", "step") or (debug and op == "resolve")


def takes_state(op: str) -> bool:
    """Whether `op`'s executable takes the state first (all but the sentinels)."""
    return op != "sentinels"


Layout = tuple[Any, ...]
"""A call's layout (`signature`): hashable."""


Placer = Callable[[Any], Any] | None
"""A value of a decided layout -> what the executable takes; None: taken as it is."""


class Rows(NamedTuple):
    """One placed input, and the row layout that inputs matched to it must follow.

    Attributes:
      array: what the executable takes (a host array, or the caller's jax array).
      size: rows per DP rank after padding (a bucket size).
      counts: real rows per DP rank, all ranks in order; None for a jax array (not read).
      by_rank: given as a mapping DP rank -> rows.
    """

    array: Any
    size: int
    counts: tuple[int, ...] | None
    by_rank: bool

    @property
    def empty(self) -> bool:
        """No real row on any rank (an idle call)."""
        return self.counts is not None and not any(self.counts)

    def has_rows(self, rank: int) -> bool:
        """Whether DP rank `rank` has real rows (a jax array's are not read: taken as yes)."""
        return self.counts is None or bool(self.counts[rank])


class Field(NamedTuple):
    """One input decided from its form: its row layout (as `Rows` has it) and the placer
    of values of this layout (None: a jax array, taken as it is)."""

    size: int
    counts: tuple[int, ...] | None
    by_rank: bool
    place: Placer

    def rows(self, x: Any) -> Rows:
        """`x` placed, with this field's row layout."""
        return Rows(
            x if self.place is None else self.place(x), self.size, self.counts, self.by_rank
        )


class Placed(NamedTuple):
    """A call placed for its executable.

    Attributes:
      key: the executable's key.
      args: its arguments after the state: placed arrays (a Batch for a resolve), or for
        an engine step `(packed, device leaves)`.
      pack: the packing layout of `args` (None: not packed); part of the executable's
        identity.
      idx: the slots as placed (their real rows per rank, for host lengths and debug).
      lens: a tail's lengths as placed (for the host copy of the lengths); else None.
    """

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
) -> Layout | None:
    """The layout of a call of `op` on `values` (None: a call with no layout, such as a
    mapping of ranks, a list, an empty jax array or a plain int mode)."""
    if not values:
        return None
    try:
        return (op, rows, tokens, kinds, *map(_kind, values))
    except TypeError:
        return None


def constant(value: Any) -> Callable[[Any], Any]:
    """A placer that places `value` whatever it is given (a mode fixed in the executable:
    None; ids that are never read: zeros)."""
    return lambda _: value


class Decision:
    """How every call of one layout is placed.

    Args:
      key: the executable's key (`key_for` may pick its checked twin per call).
      placers: per value, in the call's order, its placer (None: taken as it is).
      assemble: the placed values -> the executable's arguments.
      idx: the slots' field; `idx_at` its position among the values.
      lens_at: a tail's lengths' position (its host copy), or None.
      batch_check: the batch's value rules on a call's values and their placed arrays,
        or None.
      key_for: a debug map's tail op: whether the placed slots still need their device
        check (True picks the checked key), or None.
      packed: the arguments go as one packed host buffer and the device leaves (a step).
    """

    __slots__ = (
        "_device",
        "_host",
        "_keys",
        "assemble",
        "batch_check",
        "idx",
        "idx_at",
        "key",
        "key_for",
        "lens_at",
        "pack",
        "packed",
        "placers",
    )

    def __init__(
        self,
        key: Key,
        placers: Sequence[Callable[[Any], Any] | None],
        assemble: Callable[[list[Any]], tuple[Any, ...]],
        *,
        idx: Field,
        idx_at: int,
        lens_at: int | None = None,
        batch_check: Callable[[Sequence[Any], list[Any]], None] | None = None,
        key_for: Callable[[Rows], bool] | None = None,
        packed: bool = False,
    ) -> None:
        self.key = key
        self.placers = tuple(placers)
        self.assemble = assemble
        self.idx, self.idx_at, self.lens_at = idx, idx_at, lens_at
        self.batch_check = batch_check
        self.key_for = key_for
        self._keys = (key._replace(checked=False), key._replace(checked=True))
        self.packed = packed
        self.pack: PackSpec | None = None  # a step's, laid out by its first call
        self._host: list[int] = []  # positions of the packed host leaves among the values
        self._device: list[int] = []  # and of the device leaves passed beside the buffer

    def run(self, values: Sequence[Any]) -> Placed:
        """Place a call of this layout: value checks, padding, packing."""
        placed = [x if p is None else p(x) for p, x in zip(self.placers, values, strict=True)]
        if self.batch_check is not None:
            self.batch_check(values, placed)
        idx = self.idx
        rows = Rows(placed[self.idx_at], idx.size, idx.counts, idx.by_rank)
        key = self.key if self.key_for is None else self._keys[self.key_for(rows)]
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
        """Record `spec`, the packing of this decision's arguments made from its first
        call's placed values, and which positions are host leaves (packed, in tree order)
        and which device leaves (beside the buffer)."""
        self.pack = spec
        markers = [None if x is None else i for i, x in enumerate(placed)]
        order = jax.tree_util.tree_leaves(self.assemble(markers))
        for i, leaf in zip(order, spec.leaves, strict=True):
            (self._device if leaf is None else self._host).append(i)
