"""A map that holds its state and replaces it through donated jitted ops (shared by classes)."""

from __future__ import annotations

from typing import Any

from fm_jax._src.types import FutureMapState

MAX_PENDING_ERRORS = 4096
"""Debug errors kept on device before the map checks them itself (one host sync per this many)."""


class HeldState:
    """Mixin: `_state` is replaced by each donated op; in debug mode each op's checkify error
    stays on device, tagged with the step and op, until `check()` (a host sync) reads them."""

    debug: bool
    step: int
    _state: FutureMapState
    _pending: list[tuple[int, str, Any]]  # (step, op, checkify.Error or a packed error)

    def check(self) -> None:
        raise NotImplementedError

    def _apply(self, op: str, fn: Any, *args: Any) -> None:
        """Run donated `fn(state, *args)` and keep the new state (and, in debug, the error)."""
        if self.debug:
            err, self._state = fn(self._state, *args)
            self._record(op, err)
        else:
            self._state = fn(self._state, *args)

    def _record(self, op: str, err: Any) -> None:
        self._pending.append((self.step, op, err))
        if len(self._pending) >= MAX_PENDING_ERRORS:
            self.check()
