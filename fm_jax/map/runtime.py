"""A map's mutable state, shared by its class and its engine steps: one place that runs.

`MapRuntime` holds what changes as a map serves: the buffers (donated to each op that
writes them), the step count, the lock every op takes, the debug channel, the host copy
of the last published lengths, and which slots the last debug resolve checked. `run` is
the one way an executable is called on the state: the map's ops and its engine steps
both go through it, so the state, the step count and the debug record move together.

A call that fails is diagnosed there, on the failure path only (the call itself pays
nothing): an executable that failed after consuming the donated state leaves the map lost
(`StateLost`, until `reset`); a call JAX refused before running (an argument deleted, or
one of the map's own buffers passed in) leaves the state as it was and is named as a
`FutureMapError`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from fm_jax.host.buckets import Rows
from fm_jax.map.debug_channel import DebugChannel
from fm_jax.map.host_copies import ConfidenceRing, HostLengths
from fm_jax.ops.checks import FRESH_PUBLISH
from fm_jax.ops.errors import FutureMapError, StateLost
from fm_jax.ops.types import FutureMapState


class MapRuntime:
    """One map's state as it serves.

    Attributes:
      lock: one op at a time (each op donates the state the next one reads); reentrant:
        an op may call another (check).
      state: the current buffers.
      step: resolves (and engine steps) so far; debug violations name it.
      debug: the debug channel, or None.
      host_lengths: the last publish's lengths on their way to the host, or None.
      confidence: the confidence relay's host ring, or None (no relay declared).
      lost: the StateLost of the call that consumed the state, or None (the state is
        whole). While set, every op is refused with it (`refuse_if_lost`).
      unstashed: per DP rank, the optional draft fields (`relay_fields.optional`) no
        stash has written there since the state was made; None once every rank has had
        every one (the steady state: one check per call).
      armed: debug, spec: per DP rank, whether a publish came since the last read of
        lengths (`resolve_seq_lens_cpu`), which consumes it; None otherwise.
    """

    def __init__(
        self,
        fresh: Callable[[], FutureMapState],
        state: FutureMapState,
        debug: DebugChannel | None,
        host_lengths: HostLengths | None,
        confidence: ConfidenceRing | None = None,
        optional: tuple[str, ...] = (),
        dp: int = 1,
        spec: bool = False,
    ) -> None:
        self.lock = threading.RLock()
        self.confidence = confidence
        self._fresh = fresh
        self._optional = optional
        self._dp = dp
        self.unstashed: list[set[str]] | None = None
        self._unstash()
        self.state = state
        self.lost: StateLost | None = None
        self.step = 0
        self.debug = debug
        self.host_lengths = host_lengths
        # Debug, spec: a resolve consumes the lengths it reads (the host copy of a publish
        # is then stale), and a read of lengths waits for a fresh publish.
        self.armed: list[bool] | None = None
        if debug is not None and spec:
            self.armed = [False] * debug.layout.dp
        # The jax array of slots the last debug resolve checked on the device, weakly
        # (holding it would keep it alive). jax arrays are immutable: a second check of
        # the same array would find the same.
        self._checked: weakref.ref[jax.Array] | None = None

    def refuse_if_lost(self) -> None:
        """Raise StateLost (a new instance: the message, attributes and cause of the first)
        while a failed call has left the map without its state."""
        lost = self.lost
        if lost is not None:
            raise StateLost(str(lost), lost.call, lost.step, lost.consumed_args) from lost.__cause__

    def reset(self) -> None:
        """The initial state again (every slot's rows and lengths as at construction): no
        request is relayed any more, nothing published is read back. The step count and
        pending debug errors are kept."""
        self.state = self._fresh()
        self.lost = None
        self._unstash()
        if self.host_lengths is not None:
            self.host_lengths = HostLengths()
        ring = self.confidence
        if ring is not None:
            self.confidence = ConfidenceRing(
                ring.pool_size, ring.dp, ring.rank_of, tuple(ring.ranks)
            )
        if self.armed is not None:
            self.armed = [False] * len(self.armed)  # as at construction: no publish yet

    def _unstash(self) -> None:
        """No optional field stashed yet, on any rank."""
        self.unstashed = [set(self._optional) for _ in range(self._dp)] if self._optional else None

    def stashed(self, idx: Rows, omits: Sequence[str]) -> None:
        """A stash at `idx` (as placed) wrote every optional field but `omits` on each rank
        with a row there (every rank for jax-array slots, whose rows are not read)."""
        pending = self.unstashed
        if pending is None:
            return
        for d in _ranks_with_rows(idx, len(pending)):
            pending[d].intersection_update(omits)
        if not any(pending):
            self.unstashed = None

    def relayed(self, rank: int) -> tuple[str, ...]:
        """The optional fields a stash has written on DP rank `rank`, in declared order."""
        left = self.unstashed[rank] if self.unstashed is not None else ()
        return tuple(f for f in self._optional if f not in left)

    def last_checked(self) -> jax.Array | None:
        """The slots (a jax array) the last debug resolve checked, if still alive."""
        return self._checked() if self._checked is not None else None

    def run(
        self,
        exe: Callable[..., Any],
        args: Sequence[Any],
        ops: Sequence[str],
        *,
        call: str,
        with_state: bool = True,
        new_step: bool = False,
        engine_args: Sequence[Any] = (),
        donated: Sequence[int] = (),
    ) -> Any:
        """`exe(state, *args, *engine_args)` (or `exe(*args)`); returns its outputs.

        Args:
          exe: the executable.
          args: its arguments after the state, as placed.
          ops: the op names its debug errors are recorded as (a debug executable returns
            one packed error, or one per op of a step, before its outputs); empty for an
            executable without checks.
          call: the call in words, for its errors ('publish', 'engine step').
          with_state: the executable takes the state first.
          new_step: the call starts a step (a resolve, an engine step); a refusal before
            it ran takes no step.
          engine_args: an engine step's own arguments, after `args`.
          donated: which of `engine_args` the executable donates.
        """
        if new_step:
            self.step += 1
        try:
            out = exe(self.state, *args, *engine_args) if with_state else exe(*args)
        except BaseException as failure:
            if new_step:
                self.step -= 1  # refused, or failed: no step was taken
            named = self._diagnose(failure, call, args, engine_args, donated, with_state)
            if named is None or not isinstance(failure, Exception):
                raise
            raise named from failure
        if not ops or self.debug is None:
            return out
        errors, out = out
        errors = errors if len(ops) > 1 else (errors,)
        for op, err in zip(ops, errors, strict=True):
            self.debug.record(self.step, op, err)
        return out

    def _diagnose(
        self,
        err: BaseException,
        call: str,
        args: Sequence[Any],
        engine_args: Sequence[Any],
        donated: Sequence[int],
        with_state: bool,
    ) -> FutureMapError | None:
        """What a failed call did, in words: StateLost when it consumed the state (the map
        is lost from here on); a FutureMapError naming the argument when JAX refused it
        before running (the state untouched); None when neither (the error stands)."""
        state = _named_leaves(self.state) if with_state else {}
        if any(_deleted(x) for x in state.values()):
            consumed = tuple(
                i for i in donated if any(map(_deleted, jax.tree.leaves(engine_args[i])))
            )
            self.lost = _state_lost(err, call, self.step, tuple(state), donated, consumed)
            return self.lost
        ids = {id(x): name for name, x in state.items()}
        given = [(f"engine step argument {i} (args[{i}])", a) for i, a in enumerate(engine_args)]
        given += [(f"{call}: an input", a) for a in args]
        for what, arg in given:
            for leaf in jax.tree.leaves(arg):
                if id(leaf) in ids:
                    return FutureMapError(
                        f"{what} is the map's own buffer {ids[id(leaf)]!r} (fm.state, "
                        f"fm.buffers()), which the call donates: pass a copy "
                        "(fm.buffers(copy=True)); nothing ran"
                    )
                if _deleted(leaf):
                    return FutureMapError(
                        f"{what} is a deleted jax array ({leaf.aval.str_short()}): donated "
                        "to an earlier call (an engine step returns the new one in its "
                        "out) or deleted; nothing ran"
                    )
        return None

    def resolved(self, idx: Rows) -> None:
        """Debug, after a resolve ran: its slots were checked on the device (only now);
        a spec map's resolve may have consumed the lengths last published (their host
        copy is then not the buffer's: a read gathers, and finds the poison)."""
        self._checked = weakref.ref(idx.array) if idx.counts is None else None
        if self.armed is not None and self.host_lengths is not None:
            self.host_lengths.forget()

    def published(self, idx: Rows, lens: Any) -> None:
        """A publish wrote `lens` at `idx` (as placed): start their copy to the host
        (debug, spec: and arm the ranks it wrote)."""
        if self.host_lengths is not None:
            self.host_lengths.published(idx, lens)
        if self.armed is not None:
            for d in _ranks_with_rows(idx, len(self.armed)):
                self.armed[d] = True

    def check(self) -> None:
        """Raise InvariantViolation listing every failed debug check since the last call
        (a host sync); without debug, nothing to check."""
        if self.debug is not None:
            self.debug.check()

    def read_lengths(self, idx: Rows) -> None:
        """Debug, spec: a read of lengths at `idx` waits for each rank's last publish,
        which no read may have consumed before ('fresh publish', SGLang's consume-once
        wait); it consumes them. A violation goes to the debug channel (`check()`)."""
        armed, debug = self.armed, self.debug
        if armed is None or debug is None:
            return
        for d in _ranks_with_rows(idx, len(armed)):
            if not armed[d]:
                debug.host_violation(
                    self.step,
                    "resolve_seq_lens_cpu",
                    FRESH_PUBLISH,
                    "a read of lengths waited for a publish that an earlier read already "
                    "consumed, or that never came",
                    d,
                )
            armed[d] = False


def _ranks_with_rows(idx: Rows, dp: int) -> list[int]:
    """The DP ranks given rows in `idx` (every rank for a jax array: not read)."""
    return [d for d in range(dp) if idx.has_rows(d)]


def _deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.is_deleted()


def _named_leaves(state: FutureMapState) -> dict[str, jax.Array]:
    """The state's buffers by name (an engine field as 'extras[name]')."""
    out = {k: v for k, v in state._asdict().items() if isinstance(v, jax.Array)}
    out.update({f"extras[{k!r}]": v for k, v in (state.extras or {}).items()})
    return out


def _state_lost(
    err: BaseException,
    call: str,
    step: int,
    buffers: Sequence[str],
    donated: Sequence[int],
    consumed: tuple[int, ...],
) -> StateLost:
    """The StateLost of `call`, which failed with `err` after consuming the state."""
    cause = str(err).strip().splitlines()  # its last line: a callback's own error
    words = (
        f"{call} failed while it ran ({type(err).__name__}: {cause[-1] if cause else ''}) "
        f"after consuming the map's donated state: every slot's relay rows and lengths "
        f"({', '.join(buffers)}) are gone, and with them every request the map was relaying."
    )
    if donated:
        words += f" The step's donated args consumed too: {list(consumed)}; rebuild them."
    words += (
        " Every op of this map raises StateLost until FutureMap.reset() re-creates its "
        "initial state: then start every running request again (a new prefill)."
    )
    return StateLost(words, call, step, consumed)
