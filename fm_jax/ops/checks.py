"""Debug-mode invariants as `jax.experimental.checkify` checks (carried on device).

Each message starts with the invariant's name in brackets, so that a thrown error can be
mapped back to it. These run only when the ops were built with debug=True; the caller
wraps its jitted step in `checkify.checkify(..., errors=checkify.user_checks)`.

Cost model (XLA:CPU, where the debug overhead is mostly fixed cost per op, not bandwidth):
- every check passes the same payload, one scalar of the map's int dtype (the slot it
  names, or the forward mode), so checkify merges all checks of an op into one error (a
  pred, a code and one payload output) whatever their number. The price: an op call
  reports its first failed check only, in the order the op adds them (slots, forward
  mode, lengths, sentinels, consume; tail ops: slots, then values); most later checks
  assume the earlier ones held. Every failed op call is reported;
- the offending slot is found with masked max reductions (one pass over the rows), not
  argmax plus a gather (a variadic reduce, ~8x the flops), and all of an op's reductions
  are one stacked max (`OpChecks`): fewer kernels per executable;
- slot range and duplicate live slots share one sort of the indices (its ends are the min
  and max); no check allocates or touches anything of pool size, so the cost is flat in R.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from fm_jax.ops.types import ForwardMode

SLOT_RANGE = "slot range"
DUPLICATE_SLOT = "duplicate live slot"
SENTINEL_RANGE = "sentinel range"
POSITIVE_LENGTHS = "seq_lens > 0"
CONSUME = "consume (WRWR)"
CONSUME_LENGTHS = "consume lengths (WRWR)"
FRESH_PUBLISH = "fresh publish"
FORWARD_MODE = "forward mode"
PUBLISHED_LENGTHS = "published lengths >= 0"
STASHED_TOKENS = "stashed tokens >= 0"
BATCH_FIELDS = "batch fields"

SLOT_NAMED = re.compile(r"\bslot (-?\d+)")
"""Where a check's message names the slot it failed at (every check's but the mode's)."""


def _check(ok: jax.Array, msg: str, dtype: Any, value: jax.Array) -> None:
    """One checkify check whose only payload, `{value}` in `msg`, is a scalar of `dtype`."""
    checkify.check(ok, msg, value=value.astype(dtype))


class OpChecks:
    """The debug checks of one op, with their row reductions evaluated together.

    A check that needs a reduction over rows gives a vector whose max is its witness (a
    slot, 0 when clean); all vectors are padded, stacked and max-reduced at once by `run`,
    which then emits every check in the order it was added. XLA:CPU turns each scalar
    reduction into two kernels and runs an executable of more than 8 kernels across its
    thread pool: one reduction per check made a debug resolve 17 kernels.
    """

    def __init__(self) -> None:
        self._terms: list[tuple[jax.Array | None, Callable[[jax.Array], None]]] = []

    def add(self, vector: jax.Array | None, emit: Callable[[jax.Array], None]) -> int | None:
        """Queue a check: `emit(max(vector))` at `run` (`emit(None)` when vector is None).

        Returns the position of `max(vector)` in `run`'s result (None without a vector).
        An empty vector has no row to check and is not queued: padded to the others' length
        its max would be the pad, not the clean 0 a witness reads.
        """
        if vector is not None and vector.shape[0] == 0:
            return None
        self._terms.append((vector, emit))
        if vector is None:
            return None
        return sum(v is not None for v, _ in self._terms) - 1

    def run(self) -> jax.Array | None:
        """Reduce every queued vector in one stacked max, then emit the checks in order.

        Returns:
          the maxima ([checks with a vector]): they data-depend on every queued vector.
          None when no check has a vector.
        """
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
            if vector is None:
                emit(None)  # type: ignore[arg-type]
            else:
                assert maxima is not None
                emit(maxima[k])
                k += 1
        self._terms = []
        return maxima


def _witness(mask: jax.Array, slots: jax.Array) -> jax.Array:
    """slots where mask, else 0: its max is a masked slot, 0 when none (slots >= 0)."""
    return jnp.where(mask, slots, 0)


def valid_slots(name: str, indices: jax.Array, pool_size: int, dtype: Any, into: OpChecks) -> None:
    """Every slot of `indices` lies in [0, pool_size) and no live slot (>= 1) repeats.

    Slot 0 (padding) may repeat. One unstable sort serves both checks: its ends are the
    smallest and largest slot, and equal neighbours are the repeats.
    """
    if indices.shape[0] == 0:
        return
    s = jax.lax.sort(indices, is_stable=False)
    lo, hi = s[0], s[-1]
    in_range = (lo >= 0) & (hi < pool_size)
    into.add(
        None,
        lambda _: _check(
            in_range,
            f"[{SLOT_RANGE}] {name} holds slot {{value}} outside [0, {pool_size})",
            dtype,
            jnp.where(hi >= pool_size, hi, lo),
        ),
    )
    if indices.shape[0] < 2:
        return
    # With every slot in range, a repeat of slot 0 yields 0 (no violation); out of range,
    # the range check above already fired and comes first.
    into.add(
        _witness(s[1:] == s[:-1], s[1:]),
        lambda dup: _check(
            ~in_range | (dup == 0),
            f"[{DUPLICATE_SLOT}] {name} holds live slot {{value}} more than once",
            dtype,
            dup,
        ),
    )


def sentinels_in_range(input_ids: jax.Array, pool_size: int, into: OpChecks) -> None:
    """A sentinel -s names a slot s in [0, pool_size)."""
    if input_ids.shape[0] == 0:
        return

    def emit(not_lo: jax.Array) -> None:
        lo = ~not_lo.astype(input_ids.dtype)  # max(~x) = ~min(x), with no overflow
        _check(
            lo > -pool_size,
            f"[{SENTINEL_RANGE}] input_ids holds a sentinel naming slot {{value}}, outside "
            f"[0, {pool_size})",
            input_ids.dtype,
            -lo,
        )

    into.add(~input_ids, emit)


def ids_not_negative(input_ids: jax.Array, into: OpChecks) -> None:
    """Gather protocol: every input id is a token id, >= 0 (there are no sentinels)."""
    if input_ids.shape[0] == 0:
        return

    def emit(not_lo: jax.Array) -> None:
        lo = ~not_lo.astype(input_ids.dtype)  # max(~x) = ~min(x), with no overflow
        _check(
            lo >= 0,
            f"[{BATCH_FIELDS}] input_ids holds a negative id {{value}}: the gather protocol "
            "has no sentinels (token ids are >= 0)",
            input_ids.dtype,
            lo,
        )

    into.add(~input_ids, emit)


def known_mode(mode: jax.Array, dtype: Any, into: OpChecks) -> None:
    """A traced forward mode is one of the ForwardMode values (0..3)."""
    top = max(int(m) for m in ForwardMode)
    into.add(
        None,
        lambda _: _check(
            (mode >= 0) & (mode <= top),
            f"[{FORWARD_MODE}] forward_mode {{value}} is not a ForwardMode (0..{top}); "
            "the batch ran as one that is not DECODE",
            dtype,
            mode,
        ),
    )


def no_spec_mixed(mode: jax.Array, dtype: Any, into: OpChecks) -> None:
    """Sentinel protocol, spec map, a mode known only on the device: the batch is not MIXED
    (a spec MIXED batch is a gather-protocol feature; here its running rows' sentinels
    would reach the forward unfilled)."""
    into.add(
        None,
        lambda _: _check(
            mode != ForwardMode.MIXED,
            f"[{BATCH_FIELDS}] a spec MIXED batch (forward_mode {{value}}) in the sentinel "
            "protocol: its running rows' ids and lengths were not filled",
            dtype,
            mode,
        ),
    )


def token_slots_only_mixed(
    mode: jax.Array, slots: jax.Array | None, dtype: Any, into: OpChecks
) -> None:
    """Gather protocol, a mode known only on the device: a MIXED batch brings token slots
    (else its running rows would keep the host's ids), and only a MIXED batch has a
    nonzero one (another kind's would gather into its own ids). Assumes slots >= 0."""
    is_mixed = mode == ForwardMode.MIXED
    if slots is None:
        into.add(
            None,
            lambda _: _check(
                ~is_mixed,
                f"[{BATCH_FIELDS}] a MIXED batch (forward_mode {{value}}) came without "
                "token_slots: its running rows kept the host's ids",
                dtype,
                mode,
            ),
        )
        return
    into.add(
        _witness(~is_mixed & (slots > 0), slots),
        lambda slot: _check(
            slot == 0,
            f"[{BATCH_FIELDS}] token_slots name slot {{value}} in a batch that is not MIXED "
            "(only a MIXED batch's running rows gather; the slot was not read)",
            dtype,
            slot,
        ),
    )


def relayed_values(
    name: str, invariant: str, values: jax.Array, indices: jax.Array, dtype: Any, into: OpChecks
) -> None:
    """Every token or length a forward relays is >= 0, padding rows included.

    Token ids and lengths are never negative (docs/CONTRACT.md, 'Sentinels'): a stashed -1 would
    read as the consume poison, a negative length as a sentinel. Names the largest slot
    written a negative value (-1 when none).
    """
    if indices.shape[0] == 0:
        return
    into.add(
        jnp.where(values < 0, indices, -1),
        lambda slot: _check(
            slot < 0,
            f"[{invariant}] {name} holds a negative value for slot {{value}}",
            dtype,
            slot,
        ),
    )


def positive_lengths(
    is_decode: jax.Array, seq_lens: jax.Array, indices: jax.Array, into: OpChecks
) -> int | None:
    """After a DECODE restore, every live row's length is > 0 (it was published, and a
    spec map: not consumed since). Returns the position of its witness in `into.run()`'s
    result (None without rows): the spec lengths' poison is ordered after it.

    Assumes `indices` >= 0 (checked first). Slot 0 is padding: its length is garbage. The
    message names the slot, not its length: reading the length buffer at the slot would
    not be ordered before a later in-place publish in a fused step (a whole-buffer copy).
    """
    if indices.shape[0] == 0:
        return None
    return into.add(
        _witness(seq_lens <= 0, indices),  # max 0: none (or only padding rows)
        lambda slot: _check(
            ~is_decode | (slot == 0),
            f"[{POSITIVE_LENGTHS}] resolve restored a length <= 0 for slot {{value}}: "
            "the slot's length was never published (spec: or a resolve read it since its "
            "last publish)",
            seq_lens.dtype,
            slot,
        ),
    )


def lengths_unconsumed(lengths: jax.Array, indices: jax.Array, into: OpChecks) -> None:
    """A length read back (`resolve_seq_lens_cpu`) at a live slot is >= 0: not the poison
    of a length never published, or consumed by a spec resolve since its last publish.
    Assumes `indices` >= 0 (checked first)."""
    if indices.shape[0] == 0:
        return
    into.add(
        _witness(lengths < 0, indices),
        lambda slot: _check(
            slot == 0,
            f"[{CONSUME_LENGTHS}] resolve_seq_lens_cpu read slot {{value}}, whose length was "
            "never published or was read by a resolve since its last publish",
            lengths.dtype,
            slot,
        ),
    )


def running_rows_match(
    running: jax.Array, idx: jax.Array, slots: jax.Array, j: jax.Array, into: OpChecks
) -> None:
    """Spec MIXED: the running rows (`running`; `j`, each row's place among them) are the
    rows of the nonzero token slots, in their order: the j-th running row holds the j-th
    nonzero slot. Their lengths are bound at their own slots, so a row out of place would
    read another's."""
    if idx.shape[0] == 0 or slots.shape[0] == 0:
        return
    nz = slots > 0
    at = jnp.where(nz, jnp.cumsum(nz) - 1, slots.shape[0])  # the nonzero slots, in order
    named = jnp.zeros_like(slots).at[at].set(slots, mode="drop")
    expect = named.at[jnp.clip(j, 0, slots.shape[0] - 1)].get(mode="clip").astype(idx.dtype)
    into.add(
        _witness(running & (expect != idx), idx),
        lambda slot: _check(
            slot == 0,
            f"[{BATCH_FIELDS}] a spec MIXED batch's running row at slot {{value}} is not in "
            "token-slot order (prefill rows, then one row per nonzero token slot, in order)",
            idx.dtype,
            slot,
        ),
    )


def consumed_values_valid(values: jax.Array, source_slots: jax.Array, into: OpChecks) -> int | None:
    """Every value gathered from a live slot of output_tokens is >= 0 (a -1 is an RR or a
    read before the first write). Reads of slot 0 (padding rows) are garbage, never checked.

    Assumes `source_slots` >= 0 (0 where a row read nothing).

    Returns:
      the position in `into.run()`'s result of a scalar that data-depends on all of
      `values` (None when there are no rows).
    """
    if values.shape[0] == 0:
        return None
    return into.add(
        _witness(values < 0, source_slots),
        lambda slot: _check(
            slot == 0,
            f"[{CONSUME}] slot {{value}} was read with no write since its last read (RR) "
            "or before its first write",
            values.dtype,
            slot,
        ),
    )
