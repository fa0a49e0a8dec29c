"""Errors raised by fm_jax."""

from __future__ import annotations


class FutureMapError(ValueError):
    """Bad input from the host side: raised before anything is written."""


class InvariantViolation(RuntimeError):
    """A debug-mode invariant failed on device; raised at `FutureMap.check()` or a sync point.

    Attributes:
      invariant: short name of the invariant (e.g. 'consume (WRWR)', 'seq_lens > 0').
      step: the FutureMap step (number of resolves so far) of the failing op, if known.
      op: the op that failed, if known.
    """

    def __init__(self, message: str, invariant: str = "", step: int | None = None, op: str = ""):
        self.invariant = invariant
        self.step = step
        self.op = op
        super().__init__(message)
