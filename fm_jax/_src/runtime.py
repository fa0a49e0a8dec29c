"""A map's mutable state, shared by its class and its engine steps: one place that runs.

`MapRuntime` holds what changes as a map serves: the buffers (donated to each op that
writes them), the step count, the lock every op takes, the debug channel, the host copy
of the last published lengths, and which slots the last debug resolve checked. `run` is
the one way an executable is called on the state: the map's ops and its engine steps
both go through it, so the state, the step count and the debug record move together.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from fm_jax._src.debug_channel import DebugChannel
from fm_jax._src.host_inputs import Rows
from fm_jax._src.host_lengths import HostLengths
from fm_jax._src.types import FutureMapState


class MapRuntime:
    """One map's state as it serves.

    Attributes:
      lock: one op at a time (each op donates the state the next one reads); reentrant:
        an op may call another (check).
      state: the current buffers.
      step: resolves (and engine steps) so far; debug violations name it.
      debug: the debug channel, or None.
      host_lengths: the last publish's lengths on their way to the host, or None.
    """

    def __init__(
        self, state: FutureMapState, debug: DebugChannel | None, host_lengths: HostLengths | None
    ) -> None:
        self.lock = threading.RLock()
        self.state = state
        self.step = 0
        self.debug = debug
        self.host_lengths = host_lengths
        # The jax array of slots the last debug resolve checked on the device, weakly
        # (holding it would keep it alive). jax arrays are immutable: a second check of
        # the same array would find the same.
        self._checked: weakref.ref[jax.Array] | None = None

    def last_checked(self) -> jax.Array | None:
        """The slots (a jax array) the last debug resolve checked, if still alive."""
        return self._checked() if self._checked is not None else None

    def run(
        self,
        exe: Callable[..., Any],
        args: Sequence[Any],
        ops: Sequence[str],
        *,
        with_state: bool = True,
        new_step: bool = False,
    ) -> Any:
        """`exe(state, *args)` (or `exe(*args)`); returns its outputs.

        Args:
          exe: the executable.
          args: its arguments after the state.
          ops: the op names its debug errors are recorded as (a debug executable returns
            one packed error, or one per op of a step, before its outputs); empty for an
            executable without checks.
          with_state: the executable takes the state first.
          new_step: the call starts a step (a resolve, an engine step); a refusal before
            it ran takes no step.
        """
        if new_step:
            self.step += 1
        try:
            out = exe(self.state, *args) if with_state else exe(*args)
        except BaseException:
            if new_step:
                self.step -= 1  # refused, or failed: no step was taken
            raise
        if not ops or self.debug is None:
            return out
        errors, out = out
        errors = errors if len(ops) > 1 else (errors,)
        for op, err in zip(ops, errors, strict=True):
            self.debug.record(self.step, op, err)
        return out

    def resolved(self, idx: Rows) -> None:
        """Debug, after a resolve ran: its slots were checked on the device (only now)."""
        self._checked = weakref.ref(idx.array) if idx.counts is None else None

    def published(self, idx: Rows, lens: Any) -> None:
        """A publish wrote `lens` at `idx` (as placed): start their copy to the host."""
        if self.host_lengths is not None:
            self.host_lengths.published(idx, lens)
