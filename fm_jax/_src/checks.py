"""Debug-mode invariants as `jax.experimental.checkify` checks (carried on device).

Each message starts with the invariant's name in brackets, so that a thrown error can be
mapped back to it. These run only when the ops were built with debug=True; the caller
wraps its jitted step in `checkify.checkify(..., errors=checkify.user_checks)`.

Cost model (XLA:CPU, where the debug overhead is mostly fixed cost per op, not bandwidth):
- every check passes the same payload, one scalar of the map's int dtype (the slot, or the
  sentinel), so checkify merges all checks of an op into one error (a pred, a code and one
  payload output) whatever their number;
- the offending slot is found with masked max/min reductions (one pass over the rows), not
  argmax plus a gather (a variadic reduce, ~8x the flops);
- slot range and duplicate live slots share one sort of the indices (its ends are the min
  and max); no check allocates or touches anything of pool size, so the cost is flat in R.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from fm_jax._src.errors import InvariantViolation

SLOT_RANGE = "slot range"
DUPLICATE_SLOT = "duplicate live slot"
SENTINEL_RANGE = "sentinel range"
POSITIVE_LENGTHS = "seq_lens > 0"
CONSUME = "consume (WRWR)"


def _check(ok: jax.Array, msg: str, dtype: Any, value: jax.Array) -> None:
    """One checkify check whose only payload, `{value}` in `msg`, is a scalar of `dtype`."""
    checkify.check(ok, msg, value=value.astype(dtype))


def _masked_max(mask: jax.Array, values: jax.Array) -> jax.Array:
    """max(values where mask, else 0): for non-negative `values`, 0 means none is masked."""
    return jnp.max(jnp.where(mask, values, 0))


def valid_slots(name: str, indices: jax.Array, pool_size: int, dtype: Any) -> None:
    """Every slot of `indices` lies in [0, pool_size) and no live slot (>= 1) repeats.

    Slot 0 (padding) may repeat. One unstable sort serves both checks: its ends are the
    smallest and largest slot, and equal neighbours are the repeats.
    """
    if indices.shape[0] == 0:
        return
    s = jax.lax.sort(indices, is_stable=False)
    lo, hi = s[0], s[-1]
    in_range = (lo >= 0) & (hi < pool_size)
    _check(
        in_range,
        f"[{SLOT_RANGE}] {name} holds slot {{value}} outside [0, {pool_size})",
        dtype,
        jnp.where(hi >= pool_size, hi, lo),
    )
    if indices.shape[0] < 2:
        return
    # With every slot in range, a repeat of slot 0 yields 0 (no violation); out of range,
    # the range check above already fired and comes first.
    dup = _masked_max(s[1:] == s[:-1], s[1:])
    _check(
        ~in_range | (dup == 0),
        f"[{DUPLICATE_SLOT}] {name} holds live slot {{value}} more than once",
        dtype,
        dup,
    )


def sentinels_in_range(input_ids: jax.Array, pool_size: int) -> None:
    """A sentinel -s names a slot s in [0, pool_size)."""
    if input_ids.shape[0] == 0:
        return
    lo = jnp.min(input_ids)
    _check(
        lo > -pool_size,
        f"[{SENTINEL_RANGE}] input_ids holds sentinel {{value}} naming a slot outside "
        f"[0, {pool_size})",
        input_ids.dtype,
        lo,
    )


def positive_lengths(is_decode: jax.Array, seq_lens: jax.Array, indices: jax.Array) -> None:
    """After a DECODE restore, every live row's length is > 0 (it was published).

    Assumes `indices` >= 0 (checked first). Slot 0 is padding: its length is garbage. The
    message names the slot, not its length: reading the length buffer at the slot would
    not be ordered before a later in-place publish in a fused step (a whole-buffer copy).
    """
    if indices.shape[0] == 0:
        return
    slot = _masked_max(seq_lens <= 0, indices)  # 0: none (or only padding rows)
    _check(
        ~is_decode | (slot == 0),
        f"[{POSITIVE_LENGTHS}] DECODE restored a length <= 0 for slot {{value}}: "
        "the slot's length was never published",
        seq_lens.dtype,
        slot,
    )


def consumed_values_valid(values: jax.Array, source_slots: jax.Array) -> jax.Array:
    """Every value gathered from a live slot of output_tokens is >= 0 (a -1 is an RR or a
    read before the first write). Reads of slot 0 (padding rows) are garbage, never checked.

    Assumes `source_slots` >= 0 (0 where a row read nothing).

    Returns:
      the reported slot (0 when clean): a scalar that data-depends on all of `values`.
    """
    if values.shape[0] == 0:
        return jnp.zeros((), values.dtype)
    slot = _masked_max(values < 0, source_slots)
    _check(
        slot == 0,
        f"[{CONSUME}] slot {{value}} was read with no write since its last read (RR) "
        "or before its first write",
        values.dtype,
        slot,
    )
    return slot


_INVARIANT = re.compile(r"^\[([^\]]+)\]")


def raise_if_violated(err: checkify.Error, *, step: int | None = None, op: str = "") -> None:
    """Raise InvariantViolation if `err` (from a checkified fm_jax step) holds a failure.

    This reads the error on the host: a sync. Call it where the engine syncs anyway.
    """
    msg = err.get()
    if msg is None:
        return
    m = _INVARIANT.match(msg)
    where = "" if step is None else f"step {step}, "
    where += f"{op}: " if op else ""
    raise InvariantViolation(
        f"FutureMap invariant violated at {where}{msg}",
        invariant=m.group(1) if m else "",
        step=step,
        op=op,
    )
