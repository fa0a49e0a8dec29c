"""Errors raised by the PyTorch FutureMap twin."""

from __future__ import annotations


class FutureMapError(ValueError):
    """Bad input from the caller: raised before any buffer is written."""


class InvariantViolation(RuntimeError):
    """A debug-mode invariant failed (consume check, positive lengths, slot range).

    Attributes:
      invariant: short name of the invariant that failed.
      slots: the offending slots, where known.
    """

    def __init__(self, invariant: str, message: str, slots: list[int] | None = None):
        self.invariant = invariant
        self.slots = list(slots or [])
        where = f" (slots {self.slots})" if self.slots else ""
        super().__init__(f"FutureMap invariant '{invariant}' violated{where}: {message}")
