"""The errors fm_jax raises, and the refusals several modules make (the class on the host,
the pure ops when traced), each worded once; `where` prefixes the field with its batch."""

from __future__ import annotations

from collections.abc import Sequence


class FutureMapError(ValueError):
    """Bad input from the host side: raised before anything is written (except its
    subclass `StateLost`)."""


class StateLost(FutureMapError):
    """A map call failed after its executable had consumed the map's donated state: every
    op is refused with it until `FutureMap.reset()`.

    Attributes:
      call: the call that failed ('engine step', or the class op's name).
      step: the step count when it failed (the failed call took no step).
      consumed_args: the engine step's arguments (indices into its args) the failed call
        consumed too; () for a class op.
    """

    def __init__(
        self, message: str, call: str = "", step: int = 0, consumed_args: Sequence[int] = ()
    ) -> None:
        self.call = call
        self.step = step
        self.consumed_args = tuple(consumed_args)
        super().__init__(message)


class InvariantViolation(RuntimeError):
    """A debug-mode invariant failed on device; raised at `FutureMap.check()` or a sync point.
    Its attributes describe the first violation (in op order), `violations` lists them all.

    Attributes:
      invariant: the invariant's short name (e.g. 'consume (WRWR)', 'seq_lens > 0').
      step: the FutureMap step (resolves so far) of the failing op, if known.
      op: the op that failed, if known.
      rank: the DP rank whose pool failed, on a map with more than one; else None.
      slots: the rank-local slot the failed check names (its largest offender), or [].
      violations: every violation reported with this one, in op order.
    """

    def __init__(
        self,
        message: str,
        invariant: str = "",
        step: int | None = None,
        op: str = "",
        rank: int | None = None,
        violations: Sequence[InvariantViolation] = (),
        slots: Sequence[int] = (),
    ) -> None:
        self.invariant = invariant
        self.step = step
        self.op = op
        self.rank = rank
        self.slots = list(slots)
        self.violations: list[InvariantViolation] = list(violations) or [self]
        super().__init__(message)


def tokens_on_spec_map(per_rank: bool = False) -> FutureMapError:
    """stash on a spec map got something other than a DraftPayload."""
    tail = " (per rank on a mapping)" if per_rank else ""
    return FutureMapError(f"stash on a spec map takes a DraftPayload{tail}")


def draft_indices_on_plain_map() -> FutureMapError:
    """A batch brings draft indices to a map built without spec."""
    return FutureMapError("batch.draft_indices given but the map was built without spec")


def token_slots_in_sentinel_protocol(where: str = "batch.") -> FutureMapError:
    """A batch brings token slots to a sentinel-protocol map."""
    return FutureMapError(
        f"{where}token_slots is for the gather protocol; this map relays by sentinels"
    )


def token_slots_for_decode(where: str = "") -> FutureMapError:
    """A DECODE batch brings token slots (gather protocol: it gathers at its slots)."""
    return FutureMapError(
        f"{where}token_slots given for a DECODE batch: it gathers at req_pool_indices"
    )


def mixed_without_token_slots(where: str = "") -> FutureMapError:
    """A MIXED batch in the gather protocol comes without token slots."""
    head = f"{where}token_slots missing: a" if where else "a"
    return FutureMapError(
        f"{head} MIXED batch in the gather protocol needs token_slots (the running rows' "
        "slots at their token positions, 0 elsewhere)"
    )


def spec_mixed_in_sentinel_protocol() -> FutureMapError:
    """A spec MIXED batch reaches a sentinel-protocol map."""
    return FutureMapError(
        "a spec MIXED batch is a gather-protocol feature (its running rows' lengths are "
        "bound at resolve); this map relays by sentinels"
    )


def no_ids_with_traced_mode(where: str = "") -> FutureMapError:
    """A gather-protocol batch without ids whose kind is known only on the device."""
    return FutureMapError(
        f"{where}input_ids is None with a traced forward_mode: a batch whose kind is "
        "known only on the device brings its ids (any id >= 0 at DECODE rows: they are "
        "gathered)"
    )


def no_ids_for_kind(kinds: str, where: str = "") -> FutureMapError:
    """A gather-protocol batch of kind(s) `kinds` (not DECODE) without ids."""
    return FutureMapError(
        f"{where}input_ids is None with forward_mode {kinds}: only a DECODE batch comes "
        "without ids in the gather protocol"
    )


def invalidate_in_gather_protocol() -> FutureMapError:
    """`invalidate` on a gather-protocol map, which leaves no sentinels."""
    return FutureMapError(
        "invalidate: the gather protocol leaves no sentinels (resolve gathers the decode ids "
        "at forward entry)"
    )


def not_the_declared_dtype(name: str, given: object, declared: object) -> FutureMapError:
    """Rows of a non-int field in another dtype than the declared one (never cast)."""
    return FutureMapError(
        f"{name} has dtype {given}, declared {declared}: give its rows in that dtype"
    )


def confidence_not_declared() -> FutureMapError:
    """Confidence rows given to a map whose spec declares no confidence relay."""
    return FutureMapError(
        "confidence given but the map relays none: declare its width, "
        "SpecConfig(..., confidence=gamma)"
    )


def generation_without_confidence(call: str, relay: bool) -> FutureMapError:
    """`generation=` given without confidence rows, on a map with the relay or without."""
    if relay:
        return FutureMapError(
            f"{call}: generation given without confidence: the generations are snapshotted "
            "with confidence rows only; pass both, or neither"
        )
    return FutureMapError(
        f"{call}: generation given but the map relays no confidence (declare its width, "
        "SpecConfig(..., confidence=gamma)); pass generation only with confidence rows"
    )
