"""Recorded plans: a layout placed before, placed again with only its value checks.

A call's layout is its op, the explicit sizes, and per value its kind (a host array, a
jax array, None, a host ForwardMode), shape and dtype (`signature`). Everything placement
works out from the layout alone (the padded sizes, the executable's key, the packing
layout, the protocol's rules on kinds and counts) is the same for every call of that
layout, so placement records it once (`Plan.record`) and a later call of the layout only:
- checks each host value by value (`HostInputs.check`: the same checks, and the same
  errors, as the general path's), and the batch's value rules (token slots of a batch
  that is not MIXED all 0; a spec MIXED batch's running rows in order);
- pads each host value to its recorded size, and packs the host leaves into one buffer
  where the layout is packed;
- takes jax arrays as they are (not read: debug checks them on the device).

A plan is kept only if, on the call that recorded it, it rebuilt the general path's
arguments exactly (tree, dtypes and bytes): a layout the plan would place differently is
never planned, and keeps taking the general path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.host.host_inputs import HostInputs, Rows
from fm_jax.host.keys import Key
from fm_jax.host.packing import WORD, PackSpec
from fm_jax.ops.types import ForwardMode

Layout = tuple[Any, ...]
"""A call's layout (`signature`): hashable."""


class Placed(NamedTuple):
    """A call placed for its executable.

    Attributes:
      key: the executable's key.
      args: its arguments after the state: placed arrays (a Batch for a resolve), or
        `(packed,)`, or for an engine step `(packed, device leaves)`.
      pack: the packing layout of `args` (None: not packed); part of the executable's
        identity.
      idx: the slots as placed (their real rows per rank, for host lengths and debug).
      lens: a tail's lengths as placed (for the host copy of the lengths); else None.
      check: a resolve's value rules that its protocol left to its layout (token slots
        all 0, a spec MIXED batch's running rows in order), on a call's values in plan
        order, for a plan of the layout to repeat; None where there are none.
    """

    key: Key
    args: tuple[Any, ...]
    pack: PackSpec | None
    idx: Rows
    lens: Any = None
    check: Callable[[Sequence[Any]], None] | None = None


_JAX_TYPES: set[type] = set()
"""The concrete jax.Array types seen (an isinstance check of the ABC costs ~1 us)."""


def _kind(x: Any) -> Any:
    """One value's part of a layout; raises TypeError for a value no plan takes."""
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
    """The layout of a call of `op` on `values` (None: a call no plan takes, such as a
    mapping of ranks, a list, an empty jax array or a plain int mode)."""
    if not values:
        return None
    try:
        return (op, rows, tokens, kinds, *map(_kind, values))
    except TypeError:
        return None


class Role(NamedTuple):
    """How a plan places one value of a call.

    Attributes:
      kind: the `HostInputs.check` kind of a host value; None for a value passed as it is
        (a jax array) or dropped.
      name: the field, named in errors.
      size: rows per rank after padding.
      keep: whether the value becomes a leaf of the arguments (False: a mode fixed in the
        executable, placed as None).
      into: the dtype of a field's rows (`HostChecks.check`); None: the map's int dtype.
    """

    kind: str | None
    name: str
    size: int
    keep: bool = True
    into: np.dtype | None = None


_DROP = object()
"""A value a plan places as None (a mode fixed in the executable)."""


class Plan:
    """One recorded layout: how each value is placed, how the arguments are assembled,
    the key and the packing layout.

    Built from the call that recorded it (`values` fix every shape and dtype); `record`
    keeps it only if it rebuilds that call's general placement; `run(values)` places a
    later call of the same layout.
    """

    __slots__ = (
        "assemble",
        "batch_check",
        "counts",
        "idx_at",
        "key",
        "key_for",
        "lens_at",
        "pack",
        "_device",
        "_host",
        "_keys",
        "_placers",
        "_same",
        "_words",
    )

    def __init__(
        self,
        key: Key,
        pack: PackSpec | None,
        roles: Sequence[Role],
        assemble: Callable[[list[Any]], tuple[Any, ...]],
        inputs: HostInputs,
        values: Sequence[Any],
        *,
        counts: tuple[int, ...] | None,
        lens_at: int | None = None,
        batch_check: Callable[[Sequence[Any]], None] | None = None,
        checked: Callable[[Rows], bool] | None = None,
    ) -> None:
        self.key = key
        self.pack = pack
        self.assemble = assemble
        self.counts = counts
        self.idx_at = 1 if key.op in ("resolve", "step") else 0
        self.lens_at = lens_at
        self.batch_check = batch_check
        # A debug tail op's key depends on whether its slots are the last resolve's.
        self.key_for = checked
        self._keys = (key._replace(checked=False), key._replace(checked=True))
        self._placers = [_placer(r, x, inputs) for r, x in zip(roles, values, strict=True)]
        # The packed buffer's leaves, in the order `pack` lays them: positions in the list
        # of placed values (host leaves go in the buffer, device leaves beside it).
        self._host: list[tuple[int, bool]] = []  # (position, 1-D)
        self._device: list[int] = []
        self._words = self._same = False
        if pack is not None:
            markers = [
                None if x is None or p is _DROP else i
                for i, (p, x) in enumerate(zip(self._placers, values, strict=True))
            ]
            order = jax.tree_util.tree_leaves(assemble(markers))
            for i, leaf in zip(order, pack.leaves, strict=True):
                if leaf is None:
                    self._device.append(i)
                else:
                    self._host.append((i, len(leaf[1]) == 1))
            # Every host leaf a whole number of words: the buffer is their words end to end.
            self._words = all(leaf[2].itemsize == WORD for leaf in pack.leaves if leaf is not None)
            self._same = self._words and len({leaf[2] for leaf in pack.leaves if leaf}) == 1

    @classmethod
    def record(cls, placed: Placed, values: Sequence[Any], plan: Plan) -> Plan | None:
        """`plan` if it rebuilds `placed` (the general path's placement of `values`)
        exactly; else None (the layout is not planned)."""
        try:
            again = plan.run(values)
        except Exception:  # noqa: BLE001 - a plan that cannot place a valid call is dropped
            return None
        if again.key != placed.key or again.pack != placed.pack:
            return None
        return plan if _same(again.args, placed.args) else None

    def run(self, values: Sequence[Any]) -> Placed:
        """Place a call of this plan's layout: value checks, padding, packing."""
        placed = [
            x if p is None else None if p is _DROP else p(x)  # type: ignore[operator]
            for p, x in zip(self._placers, values, strict=True)
        ]
        if self.batch_check is not None:
            self.batch_check(values)
        rows = Rows(placed[self.idx_at], self.key.rows, self.counts, False)
        key = self.key if self.key_for is None else self._keys[self.key_for(rows)]
        lens = None if self.lens_at is None else placed[self.lens_at]
        if self.pack is None:
            return Placed(key, self.assemble(placed), None, rows, lens)
        return Placed(key, self._packed(placed), self.pack, rows, lens)

    def _packed(self, placed: list[Any]) -> tuple[Any, ...]:
        """The host leaves in one uint32 buffer laid out by the recorded packing (each
        leaf on a word, zero pad bytes); an engine step's device leaves beside it."""
        assert self.pack is not None
        if not self._host:
            packed = None  # every leaf on the device: nothing to pack
        elif self._same:  # one 4-byte dtype: their words end to end, viewed once
            packed = np.concatenate([placed[i] for i, _ in self._host], axis=None)
            packed = packed.view(np.uint32)
        elif self._words:
            u32 = np.uint32
            parts = [
                placed[i].view(u32) if one else np.ravel(placed[i]).view(u32)
                for i, one in self._host
            ]
            packed = np.concatenate(parts) if len(parts) != 1 else parts[0]
        else:
            raw: list[np.ndarray] = []
            for i, _ in self._host:
                x = np.ascontiguousarray(placed[i]).reshape(-1).view(np.uint8)
                raw += [x, np.zeros(-x.size % WORD, np.uint8)]
            packed = np.concatenate(raw).view(np.uint32)
        return (packed, tuple(placed[i] for i in self._device))


def _placer(role: Role, x: Any, inputs: HostInputs) -> Any:
    """How a plan places one value recorded as `x`: None (as it is), `_DROP`, or a
    function of the value (its value checks, then its padding to the role's size)."""
    if not role.keep:
        return _DROP
    if role.kind is None or type(x) is not np.ndarray:
        return None  # a jax array (not read here), or None
    kind, name, size, into = role.kind, role.name, role.size, role.into
    if inputs.dp > 1:
        return lambda a: inputs.host_rows(name, a, size, kind, into)
    check = inputs.checks.checker(kind, name, x.dtype, into)
    n, tail = x.shape[0], x.shape[1:]

    def pad(a: np.ndarray) -> np.ndarray:
        out = np.zeros((size, *tail), a.dtype)
        out[:n] = a
        return out

    if check is not None and n != size:
        return lambda a: pad(check(a))
    return check if n == size else pad


def _nbytes(leaf: tuple[int, tuple[int, ...], np.dtype]) -> int:
    return int(np.prod(leaf[1], dtype=np.int64)) * leaf[2].itemsize


def _same(a: Any, b: Any) -> bool:
    """Two argument trees equal in structure, and leaf by leaf in kind, shape, dtype and
    bytes (a jax array: the same object)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb or len(la) != len(lb):  # type: ignore[operator]
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array) or isinstance(y, jax.Array):
            if x is not y:
                return False
            continue
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.tobytes() != y.tobytes():
            return False
    return True
