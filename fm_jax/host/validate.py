"""Every check of a caller's host values (`HostChecks`), of a batch's form and values, and
of an engine step's declared inputs; each refusal a FutureMapError naming the field."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.ops import errors
from fm_jax.ops.checks import host_mode
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import Part, Protocol, Rules
from fm_jax.ops.types import Batch, ForwardMode

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

    def ints(self, name: str, a: np.ndarray, into: np.dtype | None = None) -> np.ndarray:
        """`a` (host, integer) in the int dtype `into` (default the map's): itself when it
        has that dtype already, else a cast; refuses values that do not fit."""
        to = self.dtype if into is None else into
        dt = a.dtype
        if dt is to or dt == to:
            return a
        if dt.kind not in "iu":
            raise FutureMapError(f"{name} must have an integer dtype, got {dt}")
        if into is None:
            safe, lo, hi = dt in self.safe, self._lo, self._hi
        else:
            info = np.iinfo(to)
            safe, lo, hi = np.can_cast(dt, to, "safe"), int(info.min), int(info.max)
        if not safe and a.size and (int(a.min()) < lo or int(a.max()) > hi):
            raise FutureMapError(f"{name} holds values that do not fit the {to} buffer")
        return a.astype(to)

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

    def check(
        self, kind: str, name: str, a: np.ndarray, into: np.dtype | None = None
    ) -> np.ndarray:
        """One rank's host rows checked as a `kind` of input, in the dtype the map stores
        them: 'slots', 'ids' (the protocol's rule), 'ints' (that fit `into`, default the
        map's), 'relayed' (ints >= 0), 'values' (a non-int field's: dtype `into` only)."""
        if kind == "values":
            assert into is not None
            return self.declared(name, a, into)
        a = self.ints(name, a, into)
        if kind == "slots":
            self.slots(name, a)
        elif kind == "ids":
            self._check_ids(name, a)
        elif kind == "relayed":
            _non_negative(name, a)
        return a

    def checker(
        self, kind: str, name: str, dtype: np.dtype, into: np.dtype | None = None
    ) -> Callable[[np.ndarray], Any] | None:
        """`check(kind, name, a, into)` for host arrays `a` of `dtype`, its dispatch done
        once: None where the dtype alone says every such array passes as it is."""
        to = self.dtype if into is None else into
        if dtype != to:
            return functools.partial(self.check, kind, name, into=into)  # a cast, or refused
        if kind in ("values", "ints"):
            return None
        if kind == "slots":
            return functools.partial(_checked, self.slots, name)
        if kind == "ids":
            return functools.partial(_checked, self._check_ids, name)
        return functools.partial(_non_negative, name)

    def _check_ids(self, name: str, ids: np.ndarray) -> None:
        """Token ids by value: a sentinel -s names a slot s in [0, R); the gather protocol
        has none (every id >= 0: a decode row's id is gathered at its slot)."""
        low = 1 - self.pool_size if self.protocol.invalidates else 0
        if not ids.size or ids.min() >= low:
            return
        bad = ids[ids < low]
        if self.protocol.invalidates:
            raise FutureMapError(
                f"{name} holds sentinels {bad.tolist()} naming slots outside [0, {self.pool_size})"
            )
        raise FutureMapError(
            f"{name} holds negative ids {bad[:8].tolist()}: the gather protocol has no "
            "sentinels (a decode row's id is gathered at its slot)"
        )

    @staticmethod
    def declared(name: str, a: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """`a`, refused unless it has `dtype`, a non-int field's declared dtype (never cast)."""
        if a.dtype != dtype:
            raise errors.not_the_declared_dtype(name, a.dtype, dtype)
        return a


def batch_values(
    rules: Rules,
    modes: Sequence[ForwardMode],
    given: Sequence[Any],
    idx: Any,
    slots: Any,
) -> None:
    """A batch's host values against its protocol's `rules`: token slots that must gather
    nothing are all 0, and a spec MIXED batch's running rows are its last live rows in
    token-slot order, as resolve binds their lengths there. `given`: each part's token
    slots as given; `idx`, `slots`: as placed (jax arrays are not read: debug checks them)."""
    for i, where, kinds in rules.zero_slots:
        if not _all_zero(given[i]):
            raise FutureMapError(
                f"{where}token_slots of a batch of kind {kinds} name slots (or are a jax "
                "array, not read here): only a MIXED batch has running rows to gather"
            )
    if not rules.mixed_order or slots is None:
        return
    if isinstance(idx, jax.Array) or isinstance(slots, jax.Array):
        return
    rows = np.asarray(idx).reshape(len(modes), -1)
    toks = np.asarray(slots).reshape(len(modes), -1)
    for r, m in enumerate(modes):
        if m != ForwardMode.MIXED:
            continue
        running = toks[r][toks[r] > 0]
        live = rows[r][rows[r] > 0]
        tail = live[len(live) - len(running) :]
        if len(running) > len(live) or not np.array_equal(tail, running):
            where = f"batch[rank {r}]." if len(modes) > 1 else "batch."
            raise FutureMapError(
                f"{where}token_slots name running slots {running.tolist()}, but the "
                f"batch's last live rows hold {tail.tolist()}: a spec MIXED batch lists "
                "its running rows last, one per nonzero token slot, in that order"
            )


def one_id_per_row(
    rules: Rules,
    modes: Sequence[ForwardMode],
    ids: tuple[int, ...] | None,
    rows: tuple[int, ...] | None,
) -> None:
    """A DECODE rank's batch has one input id per row (`Rules.ids_per_row`); `ids`, `rows`:
    real counts per DP rank (None: a jax array, not read)."""
    if not rules.ids_per_row or ids is None or rows is None:
        return
    decode = [m == ForwardMode.DECODE for m in modes]
    for d, (t, b) in enumerate(zip(ids, rows, strict=True)):
        if decode[d if len(decode) > 1 else 0] and t != b:
            where = f" on DP rank {d}" if len(ids) > 1 else ""
            raise FutureMapError(
                f"input_ids of a DECODE batch has {t} ids for {b} rows{where}: a decode "
                "row carries one id"
            )


def _all_zero(slots: Any) -> bool:
    """Host token slots that gather nothing (a jax array is not read: False)."""
    if isinstance(slots, jax.Array):
        return False
    try:
        return not np.any(np.asarray(slots))
    except (TypeError, ValueError):
        return False  # not an array: placing it names the field


def _checked(check: Callable[[str, np.ndarray], None], name: str, a: np.ndarray) -> np.ndarray:
    """`a`, after `check(name, a)` found nothing wrong."""
    check(name, a)
    return a


def row_kind(dtype: np.dtype | None, relayed: bool) -> str:
    """The `HostChecks.check` kind of a field's rows, the field declared `dtype` (None: the
    map's int dtype). A relayed field is an int (relay_fields refuses any other)."""
    if dtype is None or np.dtype(dtype).kind in "iu":
        return "relayed" if relayed else "ints"
    assert not relayed
    return "values"


def _non_negative(name: str, a: np.ndarray) -> np.ndarray:
    """`a`, refused if it holds a negative value (a stashed -1 reads as the poison)."""
    if a.size and a.min() < 0:
        raise FutureMapError(
            f"{name} holds negative values {np.unique(a[a < 0])[:8].tolist()}: token ids and "
            "lengths are >= 0"
        )
    return a


class StepInput(NamedTuple):
    """One of the engine's own per-step host arrays (positions, offsets, sampling params).

    Attributes:
      name: its key in the step's `inputs` mapping, and in `forward`'s.
      per: "row" ([B, *shape], padded like `req_pool_indices`), "token" ([T, *shape],
        padded like `input_ids`), padding 0; or "slot": one of the map's relay buffers
        (`OWNABLE`) handed to the forward, which writes it and returns it in `StepOutput`
        (docs/CONTRACT.md, 'Engine-owned relay buffers').
      shape: the trailing shape of one row or token.
      dtype: its dtype; host arrays of another dtype are cast only where no value can
        change (numpy's 'safe' casting, or ints into an int dtype their values fit).
    """

    name: str
    per: str
    shape: tuple[int, ...] = ()
    dtype: Any = np.int32


OWNABLE = ("new_seq_lens", "output_tokens")
"""The relay buffers an engine's forward may own (`StepInput(name, per="slot")`)."""


def check_declared(inputs: Sequence[StepInput], map_dtype: np.dtype) -> tuple[StepInput, ...]:
    """The engine's declared inputs checked and normalised (tuple shapes, numpy dtypes)."""
    out, seen = [], set()
    for d in inputs:
        if not isinstance(d, StepInput):
            raise FutureMapError(f"engine_step inputs must be StepInputs, got {d!r}")
        if not isinstance(d.name, str) or not d.name or d.name in seen:
            raise FutureMapError(f"engine_step input names must be distinct strings: {d.name!r}")
        if d.per not in ("row", "token", "slot"):
            raise FutureMapError(
                f"StepInput {d.name!r}: per must be 'row', 'token' or 'slot', got {d.per!r}"
            )
        try:
            shape = tuple(int(n) for n in d.shape)
            dtype = np.dtype(d.dtype)
        except TypeError:
            raise FutureMapError(f"StepInput {d.name!r}: bad shape or dtype {d}") from None
        if d.per == "slot":
            if d.name not in OWNABLE:
                raise FutureMapError(
                    f"StepInput {d.name!r}: per='slot' hands the forward one of the map's "
                    f"relay buffers {OWNABLE}, not {d.name!r}"
                )
            if shape != () or dtype != map_dtype:
                raise FutureMapError(
                    f"StepInput {d.name!r}: the map's {d.name} buffer is one {map_dtype} "
                    f"per slot: declare shape () and dtype {map_dtype}, got {shape} {dtype}"
                )
        if any(n < 0 for n in shape) or jax.dtypes.canonicalize_dtype(dtype) != dtype:
            raise FutureMapError(
                f"StepInput {d.name!r}: shape {shape} and dtype {dtype} must be ones JAX keeps "
                "(float64 and int64 need x64 mode)"
            )
        seen.add(d.name)
        out.append(d._replace(shape=shape, dtype=dtype))
    return tuple(out)


def given_inputs(
    declared: Sequence[StepInput], given: Mapping[str, Any] | None
) -> Mapping[str, Any]:
    """An engine step's `inputs`, refused unless a mapping of exactly the declared names."""
    given = {} if given is None else given
    if not isinstance(given, Mapping):
        raise FutureMapError(f"inputs must be a mapping name -> array, got {type(given).__name__}")
    names = {d.name for d in declared}
    if set(given) != names:
        missing, extra = sorted(names - set(given)), sorted(set(given) - names)
        raise FutureMapError(
            f"inputs must be exactly the declared StepInputs: missing {missing}, undeclared {extra}"
        )
    return given


class Given(NamedTuple):
    """A batch as its caller gave it, its forward modes parsed: `parts` (the batch, or
    each rank's of a mapping, as its protocol judges it), a mapping's `ranks` (None for a
    Batch), a `traced` mode or the host `modes`, then the fields (a mapping's by rank)."""

    parts: tuple[Part, ...]
    ranks: tuple[Any, ...] | None
    traced: Any
    modes: tuple[ForwardMode, ...]
    slots: Any
    ids: Any
    lens: Any
    draft: Any
    token_slots: Any


def given_batch(batch: Batch | Mapping[int, Batch], dp: int) -> Given:
    """`batch` (a Batch, or a mapping DP rank -> Batch) as given, its forward modes parsed
    once each, on a map of `dp` ranks."""
    if isinstance(batch, Mapping):
        return _by_rank(batch)
    if not isinstance(batch, Batch):
        raise FutureMapError(f"resolve takes a Batch or a mapping DP rank -> Batch, got {batch!r}")
    mode, traced, scalar = batch.forward_mode, None, True
    modes: tuple[ForwardMode, ...] = ()
    if isinstance(mode, jax.Array):
        if mode.dtype != np.int32 or mode.shape not in ((), (dp,)):
            raise FutureMapError(
                f"a traced forward_mode must be int32 of shape () or ({dp},), "
                f"got {mode.dtype}{list(mode.shape)}"
            )
        traced = mode
    elif type(mode) is ForwardMode:  # the per-step case: one mode known on the host
        modes = (mode,)
    elif isinstance(mode, np.ndarray) and mode.ndim == 1:
        modes, scalar = tuple(host_mode(m, "forward_mode") for m in mode.tolist()), False
    else:
        modes = (host_mode(mode, "forward_mode"),)
    ids, token_slots = batch.input_ids, batch.token_slots
    on_host = None if traced is not None else modes
    part = Part(on_host, scalar, ids is not None, token_slots is not None, "")
    return Given((part,), None, traced, modes, *batch[1:])  # the fields, in Batch order


def _by_rank(batches: Mapping[int, Batch]) -> Given:
    for r, b in batches.items():
        if not isinstance(b, Batch):
            raise FutureMapError(f"batch[rank {r}] must be a Batch, got {type(b).__name__}")
    parts, modes = [], []
    for r, b in batches.items():
        m = host_mode(b.forward_mode, f"batch[rank {r}].forward_mode")
        modes.append(m)
        where = f"batch[rank {r}]."
        parts.append(Part((m,), True, b.input_ids is not None, b.token_slots is not None, where))
    slots, ids, lens, draft, token_slots = (
        {r: b[i] for r, b in batches.items()} for i in range(1, 6)
    )
    draft = {r: d for r, d in draft.items() if d is not None}
    token_slots = {r: s for r, s in token_slots.items() if s is not None}
    fields = (slots, ids, lens, draft, token_slots)
    return Given(tuple(parts), tuple(batches), None, tuple(modes), *fields)
