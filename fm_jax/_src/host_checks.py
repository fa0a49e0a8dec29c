"""Host values judged: the one place a host array's values are checked before anything is
written (slot range and duplicates, ints that fit, the protocol's rule for ids, relayed
tokens and lengths >= 0, dtypes the map stores as given).

`HostChecks.check(kind, name, a)` is what the general placement path calls on each rank's
rows; `checker(kind, name, dtype)` is the same check with the dispatch on kind and dtype
done once, for a recorded plan (`plans`). Each raises FutureMapError naming the field.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from fm_jax._src.errors import FutureMapError
from fm_jax._src.protocol import Protocol

INTS = frozenset(
    np.dtype(t)
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
)
"""The integer dtypes a slot, id, length or token may come in."""


class HostChecks:
    """Value checks for one map: its pool size, int dtype and protocol."""

    def __init__(self, pool_size: int, dtype: np.dtype, protocol: Protocol) -> None:
        self.pool_size = pool_size
        self.dtype = dtype
        self.protocol = protocol
        info = np.iinfo(dtype)
        self._lo, self._hi = int(info.min), int(info.max)
        # Int dtypes whose every value fits the map's dtype: cast without a value check.
        self.safe = frozenset(d for d in INTS if np.can_cast(d, dtype, "safe"))

    def ints(self, name: str, a: np.ndarray) -> np.ndarray:
        """`a` (host, integer) in the map's dtype; refuses values that do not fit."""
        dt = a.dtype
        if dt is self.dtype or dt == self.dtype:
            return a
        if dt in self.safe:
            return a.astype(self.dtype)
        if dt.kind not in "iu":
            raise FutureMapError(f"{name} must have an integer dtype, got {dt}")
        if a.size and (int(a.min()) < self._lo or int(a.max()) > self._hi):
            raise FutureMapError(f"{name} holds values that do not fit the {self.dtype} buffer")
        return a.astype(self.dtype)

    def slots(self, name: str, a: np.ndarray) -> None:
        """Every slot in [0, R), no live slot (>= 1) twice. One sort serves both."""
        if a.shape[0] < 2:
            if a.shape[0] and not 0 <= a[0] < self.pool_size:
                raise FutureMapError(
                    f"{name} holds slots {a.tolist()} outside [0, {self.pool_size})"
                )
            return
        s = np.sort(a)
        if s[0] < 0 or s[-1] >= self.pool_size:
            bad = a[(a < 0) | (a >= self.pool_size)]
            raise FutureMapError(f"{name} holds slots {bad.tolist()} outside [0, {self.pool_size})")
        same = s[1:] == s[:-1]
        if not np.count_nonzero(same):
            return  # the common case: no slot twice, not even the padding slot
        rep = s[1:][same]
        if rep[-1] != 0:  # sorted: a live repeat is the largest
            live = np.unique(rep[rep != 0])
            raise FutureMapError(
                f"{name} holds live slots {live.tolist()} more than once in one batch"
            )

    def check(self, kind: str, name: str, a: np.ndarray) -> np.ndarray:
        """One rank's host rows checked by value as a `kind` of input, in the dtype the
        map stores them; the one place host values are judged (the general path and the
        recorded plans both come here).

        Kinds: 'slots' (ints in [0, R), no live slot twice), 'ids' (ints; the protocol's
        rule for ids), 'ints' (ints that fit), 'relayed' (ints >= 0: tokens and lengths a
        forward relays), 'values' (a dtype the map stores as given), 'relayed_values'
        (that, >= 0).
        """
        if kind == "values" or kind == "relayed_values":
            return _non_negative(name, self.stored(name, a), kind == "relayed_values")
        a = self.ints(name, a)
        if kind == "slots":
            self.slots(name, a)
        elif kind == "ids":
            self._check_ids(name, a)
        elif kind == "relayed":
            _non_negative(name, a, True)
        return a

    def checker(self, kind: str, name: str, dtype: np.dtype) -> Callable[[np.ndarray], Any] | None:
        """`check(kind, name, a)` for host arrays `a` of `dtype`, with the dispatch on kind
        and dtype done once: None where the dtype alone (already judged) says every such
        array passes as it is; else a function doing the same checks and cast."""
        if kind == "values" or (kind == "ints" and dtype == self.dtype):
            return None
        if dtype != self.dtype and kind != "relayed_values":
            return functools.partial(self.check, kind, name)  # a cast, value-checked
        if kind == "slots":
            return functools.partial(_checked, self.slots, name)
        if kind == "ids":
            return functools.partial(_checked, self._check_ids, name)
        return functools.partial(_non_negative, name, relayed=True)

    def _check_ids(self, name: str, a: np.ndarray) -> None:
        self.protocol.check_ids(name, a, self.pool_size)

    def stored(self, name: str, a: np.ndarray) -> np.ndarray:
        """`a`, refused unless the map stores its dtype as given."""
        if jax.dtypes.canonicalize_dtype(a.dtype) != a.dtype:
            # The transfer would cast (e.g. float64 -> float32 without x64): refuse instead.
            raise FutureMapError(f"{name} has dtype {a.dtype}, not a dtype the map stores")
        return a


def _checked(check: Callable[[str, np.ndarray], None], name: str, a: np.ndarray) -> np.ndarray:
    """`a`, after `check(name, a)` found nothing wrong."""
    check(name, a)
    return a


def row_kind(ints: bool, relayed: bool) -> str:
    """The `HostInputs.check` kind of per-row values: ints or values as stored, relayed
    ones (tokens, lengths) also >= 0."""
    if ints:
        return "relayed" if relayed else "ints"
    return "relayed_values" if relayed else "values"


def _non_negative(name: str, a: np.ndarray, relayed: bool) -> np.ndarray:
    """`a`, refused if `relayed` and it holds a negative value (token ids and lengths are
    >= 0; a stashed -1 would read as the consume poison)."""
    if relayed and a.size and a.min() < 0:
        raise FutureMapError(
            f"{name} holds negative values {np.unique(a[a < 0])[:8].tolist()}: token ids and "
            "lengths are >= 0"
        )
    return a
