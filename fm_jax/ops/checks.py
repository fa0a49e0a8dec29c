"""An op's checks of its arguments: their structure when traced (a FutureMapError, nothing
run), and in debug mode their values on device, as checkify checks whose message starts
with the invariant's name in brackets. Cost: every check's payload is one scalar of the
map's int dtype, so checkify merges an op's checks into one error, and a call reports its
first failed check only, in the order added (later checks assume the earlier held).
Nothing touches the pool: flat in R."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from fm_jax.ops import errors
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.types import ForwardMode


def _dtype(x: Any) -> np.dtype:
    return np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)


def check_1d_int(name: str, x: Any, into: np.dtype | None = None, rows: int | None = None) -> None:
    """FutureMapError unless `x` is a 1-D integer array (whose values all fit `into`; of
    `rows` entries, one per batch row, where given)."""
    shape = jnp.shape(x)
    if len(shape) != 1:
        raise FutureMapError(f"{name} must be 1-D, got shape {shape}")
    check_ints(name, x, into)
    if rows is not None and shape[0] != rows:
        raise FutureMapError(f"{name} has {shape[0]} rows, indices have {rows}")


def check_ints(name: str, x: Any, into: np.dtype | None = None) -> None:
    """FutureMapError unless `x` has an int dtype whose every value (as JAX holds it) fits
    `into` without a cast that could change it (int64 rows for int32 buffers are refused)."""
    if not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must have an integer dtype, got {_dtype(x)}")
    held = jax.dtypes.canonicalize_dtype(_dtype(x))
    if into is not None and not np.can_cast(held, into, "safe"):
        raise FutureMapError(
            f"{name} has dtype {held}, which the {np.dtype(into)} buffers cannot hold without "
            "a value check: cast it first"
        )


def check_array(name: str, x: Any, shape: tuple[int, ...], dtype: np.dtype | None = None) -> None:
    """FutureMapError unless `x` is given with exactly `shape` (and, given, `dtype`: the
    declared dtype of a field that is not an int)."""
    if x is None:
        raise FutureMapError(f"{name} is missing")
    if tuple(jnp.shape(x)) != shape:
        raise FutureMapError(f"{name} must have shape {shape}, got {tuple(jnp.shape(x))}")
    if dtype is not None and _dtype(x) != dtype:
        raise errors.not_the_declared_dtype(name, _dtype(x), dtype)


def check_int_array(name: str, x: Any) -> None:
    """FutureMapError unless `x` is an integer array or scalar (of any shape)."""
    if x is None or isinstance(x, str) or not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must be an int array, got {x!r}")


def check_scalar_int(name: str, x: Any) -> None:
    """FutureMapError unless `x` is a 0-d integer (the forward mode)."""
    shape = np.shape(x)  # no jnp.shape: it refuses None and strings
    if shape != () or not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must be an int scalar, got shape {shape} {_dtype(x)}")


def host_mode(mode: Any, where: str) -> ForwardMode:
    """A forward mode given on the host: an int of a ForwardMode value, never a bool, float
    or string (int() would make DECODE of True, 1.7 and "1")."""
    if isinstance(mode, bool | np.bool_) or not isinstance(mode, int | np.integer):
        raise FutureMapError(f"{where} must be a ForwardMode, got {mode!r}")
    try:
        return ForwardMode(int(mode))
    except ValueError:
        raise FutureMapError(f"{where} must be a ForwardMode, got {mode!r}") from None


FRESH_PUBLISH = "fresh publish"
FORWARD_MODE = "forward mode"
PUBLISHED_LENGTHS = "published lengths >= 0"
STASHED_TOKENS = "stashed tokens >= 0"
BATCH_FIELDS = "batch fields"

SLOT_NAMED = re.compile(r"\bslot (-?\d+)")
"""Where a check's message names the slot it failed at (every check's but the mode's)."""


def check(ok: jax.Array, msg: str, dtype: Any, value: jax.Array) -> None:
    """One checkify check whose only payload, `{value}` in `msg`, is a scalar of `dtype`."""
    checkify.check(ok, msg, value=value.astype(dtype))


class OpChecks:
    """The debug checks of one op, their row reductions in one stacked max: a check's
    vector's max is its witness (a slot, 0 when clean; a masked max, not argmax plus a
    gather). XLA:CPU makes each scalar reduction two kernels and runs an executable of more
    than 8 across its thread pool: one reduction per check made a debug resolve 17."""

    def __init__(self) -> None:
        self._terms: list[tuple[jax.Array | None, Callable[[jax.Array], None]]] = []

    def add(self, vector: jax.Array | None, emit: Callable[[jax.Array], None]) -> int | None:
        """Queue `emit(max(vector))` (`emit(None)` without a vector); returns its position
        in `run`'s result. An empty vector is not queued (its padded max would not be 0)."""
        if vector is not None and vector.shape[0] == 0:
            return None
        self._terms.append((vector, emit))
        if vector is None:
            return None
        return sum(v is not None for v, _ in self._terms) - 1

    def run(self) -> jax.Array | None:
        """Reduce every queued vector in one stacked max, then emit the checks in order.
        Returns the maxima (they data-depend on every vector), or None without a vector."""
        vectors = [v for v, _ in self._terms if v is not None]
        maxima = None
        if vectors:
            wide = jnp.result_type(*(v.dtype for v in vectors))
            n = max(v.shape[0] for v in vectors)
            low = jnp.iinfo(wide).min
            rows = [
                jnp.pad(v.astype(wide), (0, n - v.shape[0]), constant_values=low) for v in vectors
            ]
            maxima = jnp.max(jnp.stack(rows), axis=1)
        k = 0
        for vector, emit in self._terms:
            emit(None if vector is None else maxima[k])  # type: ignore[arg-type, index]
            k += vector is not None
        self._terms = []
        return maxima


def witness(mask: jax.Array, slots: jax.Array) -> jax.Array:
    """slots where mask, else 0: its max is a masked slot, 0 when none (slots >= 0)."""
    return jnp.where(mask, slots, 0)


def _no_slot(into: OpChecks, mask: jax.Array, slots: jax.Array, msg: str, dtype: Any) -> Any:
    """Queue: no live slot of `slots` is masked (the witness, the largest, must be 0)."""
    return into.add(witness(mask, slots), lambda slot: check(slot == 0, msg, dtype, slot))


def valid_slots(name: str, indices: jax.Array, pool_size: int, dtype: Any, into: OpChecks) -> None:
    """Every slot of `indices` lies in [0, pool_size) and no live slot (>= 1) repeats; one
    unstable sort serves both."""
    if indices.shape[0] == 0:
        return
    s = jax.lax.sort(indices, is_stable=False)
    lo, hi = s[0], s[-1]
    in_range = (lo >= 0) & (hi < pool_size)
    msg = f"[slot range] {name} holds slot {{value}} outside [0, {pool_size})"
    into.add(None, lambda _: check(in_range, msg, dtype, jnp.where(hi >= pool_size, hi, lo)))
    # In range, a repeated slot 0 yields 0; out of range, the check above fires first. One
    # row: no pair, the empty witness is not queued.
    dup_msg = f"[duplicate live slot] {name} holds live slot {{value}} more than once"
    into.add(
        witness(s[1:] == s[:-1], s[1:]),
        lambda dup: check(~in_range | (dup == 0), dup_msg, dtype, dup),
    )


def _min_at_least(into: OpChecks, ids: jax.Array, ok: Callable[[Any], Any], msg: str) -> None:
    """Queue `ok(min(ids))`, the payload what `msg` says of the min: max(~x) = ~min(x),
    with no overflow."""

    def emit(not_lo: jax.Array) -> None:
        lo = ~not_lo.astype(ids.dtype)
        good, value = ok(lo)
        check(good, msg, ids.dtype, value)

    into.add(~ids, emit)


def sentinels_in_range(input_ids: jax.Array, pool_size: int, into: OpChecks) -> None:
    """A sentinel -s names a slot s in [0, pool_size)."""
    msg = (
        f"[sentinel range] input_ids holds a sentinel naming slot {{value}}, outside "
        f"[0, {pool_size})"
    )
    _min_at_least(into, input_ids, lambda lo: (lo > -pool_size, -lo), msg)


def ids_not_negative(input_ids: jax.Array, into: OpChecks) -> None:
    """Gather protocol: every input id is a token id, >= 0 (there are no sentinels)."""
    msg = (
        f"[{BATCH_FIELDS}] input_ids holds a negative id {{value}}: the gather protocol "
        "has no sentinels (token ids are >= 0)"
    )
    _min_at_least(into, input_ids, lambda lo: (lo >= 0, lo), msg)


def relayed_values(
    name: str, invariant: str, values: jax.Array, indices: jax.Array, dtype: Any, into: OpChecks
) -> None:
    """Every token or length a forward relays is >= 0, padding rows included (docs/CONTRACT.md,
    'Sentinels': a stashed -1 would read as the poison, a negative length as a sentinel).
    Names the largest slot written a negative value (-1 when none)."""
    msg = f"[{invariant}] {name} holds a negative value for slot {{value}}"
    into.add(jnp.where(values < 0, indices, -1), lambda slot: check(slot < 0, msg, dtype, slot))


def positive_lengths(
    is_decode: jax.Array, seq_lens: jax.Array, indices: jax.Array, into: OpChecks
) -> int | None:
    """After a DECODE restore, every live row's length is > 0; returns its witness's
    position in `into.run()`'s result (the spec lengths' poison is ordered after it). Names
    the slot, not its length: a read of the buffer would not be ordered before a later
    in-place publish in a fused step (a whole-buffer copy)."""
    msg = (
        "[seq_lens > 0] resolve restored a length <= 0 for slot {value}: the slot's "
        "length was never published (spec: or a resolve read it since its last publish)"
    )
    return into.add(
        witness(seq_lens <= 0, indices),
        lambda slot: check(~is_decode | (slot == 0), msg, seq_lens.dtype, slot),
    )


def lengths_unconsumed(lengths: jax.Array, indices: jax.Array, into: OpChecks) -> None:
    """A length read back (`resolve_seq_lens_cpu`) at a live slot is >= 0: not the poison
    of one never published or consumed by a spec resolve since. Assumes `indices` >= 0."""
    msg = (
        "[consume lengths (WRWR)] resolve_seq_lens_cpu read slot {value}, whose length was "
        "never published or was read by a resolve since its last publish"
    )
    _no_slot(into, lengths < 0, indices, msg, lengths.dtype)


def running_rows_match(
    running: jax.Array, idx: jax.Array, slots: jax.Array, j: jax.Array, into: OpChecks
) -> None:
    """Spec MIXED: the j-th running row (`running`; `j`, each row's place among them) holds
    the j-th nonzero token slot. Their lengths are bound at their own slots, so a row out of
    place would read another's."""
    if idx.shape[0] == 0 or slots.shape[0] == 0:
        return
    nz = slots > 0
    at = jnp.where(nz, jnp.cumsum(nz) - 1, slots.shape[0])  # the nonzero slots, in order
    named = jnp.zeros_like(slots).at[at].set(slots, mode="drop")
    expect = named.at[jnp.clip(j, 0, slots.shape[0] - 1)].get(mode="clip").astype(idx.dtype)
    msg = (
        f"[{BATCH_FIELDS}] a spec MIXED batch's running row at slot {{value}} is not in "
        "token-slot order (prefill rows, then one row per nonzero token slot, in order)"
    )
    _no_slot(into, running & (expect != idx), idx, msg, idx.dtype)


def consumed_values_valid(values: jax.Array, source_slots: jax.Array, into: OpChecks) -> int | None:
    """Every value gathered from a live slot of a consume-tracked buffer is >= 0 (a -1 is
    an RR or a read before the first write). Returns the position in `into.run()`'s result
    of a scalar that data-depends on all of `values` (None without rows)."""
    msg = (
        "[consume (WRWR)] slot {value} was read with no write since its last read (RR) "
        "or before its first write"
    )
    return _no_slot(into, values < 0, source_slots, msg, values.dtype)  # type: ignore[no-any-return]
