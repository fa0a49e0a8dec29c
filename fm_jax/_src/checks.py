"""Debug-mode invariants as `jax.experimental.checkify` checks (carried on device).

Each message starts with the invariant's name in brackets, so that a thrown error can be
mapped back to it. These run only when the ops were built with debug=True; the caller
wraps its jitted step in `checkify.checkify(..., errors=checkify.user_checks)`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from fm_jax._src.errors import InvariantViolation

SLOT_RANGE = "slot range"
DUPLICATE_SLOT = "duplicate live slot"
SENTINEL_RANGE = "sentinel range"
POSITIVE_LENGTHS = "seq_lens > 0"
CONSUME = "consume (WRWR)"


def _first(mask: jax.Array, values: jax.Array) -> jax.Array:
    """The value at the first True of `mask` (or values[0] when none is True)."""
    return values[jnp.argmax(mask)]


def slots_in_range(name: str, indices: jax.Array, pool_size: int) -> None:
    """Every slot of `indices` lies in [0, pool_size)."""
    if indices.shape[0] == 0:
        return
    bad = (indices < 0) | (indices >= pool_size)
    checkify.check(
        ~jnp.any(bad),
        f"[{SLOT_RANGE}] {name} holds slot {{slot}} outside [0, {pool_size})",
        slot=_first(bad, indices),
    )


def no_duplicate_live_slots(name: str, indices: jax.Array) -> None:
    """No live slot (>= 1) appears twice in one batch; slot 0 (padding) may repeat."""
    if indices.shape[0] < 2:
        return
    s = jnp.sort(indices)
    dup = (s[1:] == s[:-1]) & (s[1:] != 0)
    checkify.check(
        ~jnp.any(dup),
        f"[{DUPLICATE_SLOT}] {name} holds live slot {{slot}} more than once",
        slot=_first(dup, s[1:]),
    )


def sentinels_in_range(input_ids: jax.Array, pool_size: int) -> None:
    """A sentinel -s names a slot s in [0, pool_size)."""
    if input_ids.shape[0] == 0:
        return
    bad = input_ids <= -pool_size
    checkify.check(
        ~jnp.any(bad),
        f"[{SENTINEL_RANGE}] input_ids holds sentinel {{value}} naming a slot outside "
        f"[0, {pool_size})",
        value=_first(bad, input_ids),
    )


def positive_lengths(is_decode: jax.Array, seq_lens: jax.Array, indices: jax.Array) -> None:
    """After a DECODE restore, every live row's length is > 0 (it was published)."""
    if indices.shape[0] == 0:
        return
    bad = (seq_lens <= 0) & (indices != 0)  # slot 0 is padding: its length is garbage
    checkify.check(
        ~(is_decode & jnp.any(bad)),
        f"[{POSITIVE_LENGTHS}] DECODE restored length {{length}} for slot {{slot}}: "
        "the slot's length was never published",
        length=_first(bad, seq_lens),
        slot=_first(bad, indices),
    )


def consumed_values_valid(values: jax.Array, source_slots: jax.Array) -> None:
    """Every value gathered from a live slot of output_tokens is >= 0 (a -1 is an RR or a
    read before the first write). Reads of slot 0 (padding rows) are garbage, never checked.
    """
    if values.shape[0] == 0:
        return
    bad = (values < 0) & (source_slots != 0)
    checkify.check(
        ~jnp.any(bad),
        f"[{CONSUME}] slot {{slot}} was read with no write since its last read (RR) "
        "or before its first write",
        slot=_first(bad, source_slots),
    )


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
