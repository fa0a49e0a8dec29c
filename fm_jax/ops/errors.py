"""Errors raised by fm_jax."""

from __future__ import annotations

from collections.abc import Sequence


class FutureMapError(ValueError):
    """Bad input from the host side: raised before anything is written (the one exception
    is its subclass `StateLost`)."""


class StateLost(FutureMapError):
    """A map call failed after its executable had consumed the map's donated state.

    The buffers are gone: every slot's relay rows (tokens, draft) and lengths, so every
    request the map was relaying. The map refuses every op with this error (a new instance,
    the same message and cause) until `FutureMap.reset()` re-creates the initial state.

    Attributes:
      call: the call that failed ('engine step', or the class op's name).
      step: the step count when it failed (the failed call took no step).
      consumed_args: the engine step's arguments (indices into its args) that the failed
        call consumed too; () for a class op.
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

    One exception reports every violation found by that check: its own attributes describe
    the first (in op order), `violations` lists them all (the first included).

    Attributes:
      invariant: short name of the invariant (e.g. 'consume (WRWR)', 'seq_lens > 0').
      step: the FutureMap step (number of resolves so far) of the failing op, if known.
      op: the op that failed, if known.
      rank: the DP rank whose pool failed, on a map with more than one; else None.
      slots: the slots the failed check names (rank-local; one, the largest offending
        slot of that check), or [] (a bad forward mode names none).
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
