"""Errors raised by fm_jax."""

from __future__ import annotations

from collections.abc import Sequence


class FutureMapError(ValueError):
    """Bad input from the host side: raised before anything is written."""


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
