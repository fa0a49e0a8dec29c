"""A call's placement decided once per layout, and the one function that places its values.

A call's layout (`signature`) is its op, the explicit sizes, and per value its kind (a host
array, a jax array, None, a host ForwardMode), shape and dtype. A `Decision` holds all that
placement works out from the layout alone: the key, each value's placer, how arguments are
assembled, the batch's value rules. `Decision.run(values)` places every call of the layout,
its first included; a call with no layout (a mapping of ranks, a list, a plain int mode)
is decided afresh each time. The `Key` names the executable: the class, its engine steps,
warm-up and the serving guard all key executables by it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.host.buckets import Rows
from fm_jax.host.pack import PackSpec, pack, pack_leaves
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.types import Batch, DraftPayload, ForwardMode

FIXED_MODES = {m.name.lower(): m for m in ForwardMode}
"""The ForwardMode a fixed-mode executable is traced with, by its key's mode: a resolve's
keys use 'extend' for every kind but DECODE; an engine step's name its mode exactly."""


class Key(NamedTuple):
    """One executable: an operation and the static sizes and inputs it was traced for.

    Attributes:
      op: a class entry point ('publish', 'stash', 'finish', 'sentinels', 'seq_lens_at',
        'resolve') or an engine's whole 'step'.
      rows: rows per DP rank (a batch bucket).
      tokens: tokens per rank (a resolve's or a step's token bucket); 0 for a tail op.
      draft, slots: a resolve with draft indices; with token slots.
      mode: a resolve's kind fixed in it ('extend': not DECODE, 'decode') or 'traced' (an
        argument); a step's fixed mode is its ForwardMode's name; '' for the other ops.
      checked: a debug map's tail op with its slot checks (False: slots already checked,
        on the host or by the last resolve).
      ids: a resolve that places input ids (False: a gather-protocol DECODE, T = B).
      confidence: a publish or finish that also writes confidence rows (and returns a copy
        of the confidence buffer for its host ring).
      omits: a partial stash's (or finish's) declared fields left out, in stash order.
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
    """Whether `op` writes the map's state, so takes it donated (resolve only in debug:
    the consume poison)."""
    return op in ("publish", "stash", "finish", "step") or (debug and op == "resolve")


def takes_state(op: str) -> bool:
    """Whether `op`'s executable takes the state first (all but the sentinels)."""
    return op != "sentinels"


class Placed(NamedTuple):
    """A call placed for its executable.

    Attributes:
      key: the executable's key.
      args: its arguments after the state: placed arrays (a Batch for a resolve), or for
        an engine step `(packed, device leaves)`.
      pack: the packing layout of `args` (None: not packed); part of the executable's
        identity.
      idx: the slots as placed (their real rows per rank, for host lengths and debug).
      lens: a tail's lengths as placed (for their host copy); else None.
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
    """How every call of one layout is placed.

    Args:
      key: the executable's key (`key_for` may pick its checked twin per call).
      placers: per value, in the call's order, its placer (None: taken as it is).
      assemble: the placed values -> the executable's arguments.
      idx: the slots' layout; `idx_at` their position among the values.
      lens_at: a tail's lengths' position (its host copy), or None.
      batch_check: the batch's value rules on a call's values and placed arrays, or None.
      key_for: a debug map's tail op: whether the placed slots still need their device
        check (True picks the checked key), or None.
      packed: the arguments go as one packed host buffer and the device leaves (a step).
    """

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
        rows = Rows(placed[self.idx_at], idx.size, idx.counts, idx.by_rank, idx.place)
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
        """Record `spec`, the packing laid out by the first call, and which value positions
        are its host leaves (packed, in tree order) and which its device leaves."""
        self.pack = spec
        markers = [None if x is None else i for i, x in enumerate(placed)]
        order = jax.tree_util.tree_leaves(self.assemble(markers))
        for i, leaf in zip(order, spec.leaves, strict=True):
            (self._device if leaf is None else self._host).append(i)
