"""A map's state as it serves: the lock, the registry of executables, and `MapRuntime.run`,
the one way an executable is called on the state."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from fm_jax.host.decisions import Key, PackSpec, Rows
from fm_jax.ops.errors import FutureMapError, StateLost
from fm_jax.ops.relay_fields import draft_payload
from fm_jax.ops.types import FutureMapState, SpecConfig

_M = TypeVar("_M", bound=Callable[..., Any])


def serialized(method: _M) -> _M:
    """A map's `method` run under its lock (uncontended about 1 us a call), refused with
    `StateLost` while the map is lost."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = self._runtime
        with runtime.lock:
            if runtime.lost is not None:
                runtime.refuse_if_lost()
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


Build = Callable[[Key, PackSpec | None, int], Any]
"""An owner's builder: (key, packing layout, engine arguments) -> the family's jitted function."""


def _guarded(compiled: Any, key: Key) -> Callable[..., Any]:
    """`compiled`, refusing instead of compiling arguments it was not built for."""

    def call(*args: Any) -> Any:
        try:
            return compiled(*args)
        except (TypeError, ValueError) as e:  # arguments not matched: nothing ran
            raise FutureMapError(
                f"serving guard: {key.describe()} was warmed for other arguments and "
                f"would compile again: {e}"
            ) from None

    return call


class Registry:
    """A map's executables by owner (a `Build`; None: the class's own, `default`) and key,
    each family built once. After `warm_up(guard=True)` an owner's calls are served only by
    what was warmed for it; `refusal(key)` says why not."""

    def __init__(self, default: Build, refusal: Callable[[Key], str]) -> None:
        self.default = default
        self._jitted: dict[tuple[Any, ...], Any] = {}
        # Per guarded owner: its warmed executables, and the guard's words for the others.
        self._serving: dict[Build, tuple[dict[tuple[Key, PackSpec | None], Any], Any]] = {}
        self._refusal = refusal

    def serve(self, build: Build | None, warmed: Any, refusal: Any = None) -> None:
        """After a warm-up: owner `build`'s calls served only by `warmed` (None: unguarded)."""
        owner = build or self.default
        self._serving.pop(owner, None)
        if warmed is not None:
            exes = {kp: _guarded(c, kp[0]) for kp, c in warmed.items()}
            self._serving[owner] = (exes, refusal or self._refusal)

    def jitted(
        self, key: Key, pack: PackSpec | None = None, nargs: int = 0, build: Build | None = None
    ) -> Any:
        """The jitted function of `key`'s family (built on first use)."""
        build = build or self.default
        family = (build, key.op, key.mode, key.confidence, nargs, pack)
        fn = self._jitted.get(family)
        if fn is None:
            fn = self._jitted[family] = build(key, pack, nargs)
        return fn

    def executable(
        self, key: Key, pack: PackSpec | None, nargs: int = 0, build: Build | None = None
    ) -> Any:
        """What serves `key` fed as `pack` lays out: the jitted function, or under the
        owner's serving guard the warmed executable."""
        guarded = self._serving.get(build or self.default) if self._serving else None
        if guarded is None:
            return self.jitted(key, pack, nargs, build)
        exe = guarded[0].get((key, pack))
        if exe is None:
            raise FutureMapError(guarded[1](key))
        return exe


class MapRuntime:
    """One map's state as it serves.

    Attributes:
      lock: one op at a time (each donates the state the next reads); reentrant.
      state, step: the current buffers; resolves (and engine steps) so far.
      debug, confidence: the debug channel and the confidence ring, or None.
      copies_lengths, last_published: a publish's lengths are copied to the host
        (`needs_cpu_seq_lens`, one process); the last one's (slots, lengths), placed (a jax
        array: its host copy started), or None.
      lost: the StateLost of the call that consumed the donated state (every op refused
        with it until `reset`), or None.
      unstashed: per DP rank, the optional draft fields no stash has written there since
        the state was made; None once every rank has had each (one check per call).
      armed: debug, spec: per DP rank, whether a publish came since the last read of
        lengths, which consumes it; None otherwise.
    """

    def __init__(
        self,
        fresh: Callable[[], FutureMapState],
        state: FutureMapState,
        debug: Any,
        copies_lengths: Any,
        confidence: Any = None,
        optional: tuple[str, ...] = (),
        dp: int = 1,
        spec: bool = False,
    ) -> None:
        self.lock = threading.RLock()
        self.confidence = confidence
        self._fresh = fresh
        self.optional = optional
        self._dp = dp
        self.step = 0
        self.debug = debug
        self.copies_lengths = bool(copies_lengths)
        self.armed: list[bool] | None = [] if debug is not None and spec else None
        self._start(state)

    def _start(self, state: FutureMapState) -> None:
        """`state`, as made: not lost, no publish yet, no optional field stashed."""
        self.state = state
        self.lost: StateLost | None = None
        self.last_published: tuple[Rows, Any] | None = None
        self.unstashed: list[set[str]] | None = None
        if self.optional:
            self.unstashed = [set(self.optional) for _ in range(self._dp)]
        if self.confidence is not None:
            self.confidence.clear()
        if self.armed is not None:
            self.armed = [False] * self._dp

    def refuse_if_lost(self) -> None:
        """Raise StateLost (a new instance of the first) while the map is lost."""
        lost = self.lost
        if lost is not None:
            raise StateLost(str(lost), lost.call, lost.step, lost.consumed_args) from lost.__cause__

    def reset(self) -> None:
        """The initial state again (`FutureMap.reset`); step count and debug errors kept."""
        self._start(self._fresh())

    def stashed(self, idx: Rows, omits: Sequence[str]) -> None:
        """A stash at `idx` wrote every optional field but `omits` on each rank with a row."""
        pending = self.unstashed
        if pending is not None:
            for d in _ranks_with_rows(idx, len(pending)):
                pending[d].intersection_update(omits)
            if not any(pending):
                self.unstashed = None

    def relayed(self, rank: int) -> tuple[str, ...]:
        """The optional fields a stash has written on DP rank `rank`, in declared order."""
        left = self.unstashed[rank] if self.unstashed is not None else ()
        return tuple(f for f in self.optional if f not in left)

    def relayed_fields(self, rank: Any, spec: SpecConfig | None) -> tuple[str, ...]:
        """`FutureMap.relayed_fields`, `rank` checked."""
        dp = self._dp
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not 0 <= rank < dp:
            raise FutureMapError(f"rank must be a DP rank, an int in [0, {dp}), got {rank!r}")
        relayed = set(self.relayed(int(rank)))
        fields = spec.fields() if spec is not None else ()
        return tuple(f.name for f in fields if f.consumed or f.name in relayed)

    def without_unstashed(self, draft: Any, ranks: Sequence[int]) -> Any:
        """`draft` with None for each optional field no stash has written on any of `ranks`."""
        relayed = {f for d in ranks for f in self.relayed(d)}
        fields = {f: v for f, v in draft._asdict().items() if f != "extras"}
        fields.update(draft.extras or {})
        keep = {f: v for f, v in fields.items() if f in relayed or f not in self.optional}
        return draft_payload(keep)

    def run(
        self,
        exe: Callable[..., Any],
        args: Sequence[Any],
        ops: Sequence[str],
        *,
        call: str,
        new_step: bool = False,
        engine_args: Sequence[Any] = (),
        donated: Sequence[int] = (),
    ) -> Any:
        """`exe(state, *args, *engine_args)`'s outputs, its debug errors recorded under
        `ops`' names. `call`: the call in words, for errors; `new_step`: a resolve or engine
        step (not counted if it fails); `donated`: which of `engine_args` are donated."""
        if new_step:
            self.step += 1
        try:
            out = exe(self.state, *args, *engine_args)
        except BaseException as failure:
            if new_step:
                self.step -= 1  # refused, or failed: no step was taken
            named = self._diagnose(failure, call, args, engine_args, donated)
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
    ) -> FutureMapError | None:
        """What a failed call did, in words: StateLost when it consumed the state; a
        FutureMapError naming the argument JAX refused before running; else None."""
        state = {k: v for k, v in self.state._asdict().items() if isinstance(v, jax.Array)}
        state.update({f"extras[{k!r}]": v for k, v in (self.state.extras or {}).items()})
        if any(_deleted(x) for x in state.values()):
            consumed = tuple(
                i for i in donated if any(map(_deleted, jax.tree.leaves(engine_args[i])))
            )
            cause = str(err).strip().splitlines()  # its last line: a callback's own error
            words = (
                f"{call} failed while it ran ({type(err).__name__}: "
                f"{cause[-1] if cause else ''}) after consuming the map's donated state: every "
                f"slot's relay rows and lengths ({', '.join(state)}) are gone, and with them "
                "every request the map was relaying."
            )
            if donated:
                words += f" The step's donated args consumed too: {list(consumed)}; rebuild them."
            words += (
                " Every op of this map raises StateLost until FutureMap.reset() re-creates its "
                "initial state: then start every running request again (a new prefill)."
            )
            self.lost = StateLost(words, call, self.step, consumed)
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

    def resolved(self) -> None:
        """Debug, after a resolve ran: a spec map's resolve may have consumed the lengths
        last published (a read then gathers, and finds the poison)."""
        if self.armed is not None:
            self.last_published = None

    def published(self, idx: Rows, lens: Any, copied: Any = None, gens: Any = None) -> None:
        """A publish wrote `lens` at `idx`: start their host copy (debug, spec: arm the
        ranks it wrote); `copied` (the confidence buffer) and `gens` go to the ring."""
        if copied is not None:
            assert self.confidence is not None and gens is not None
            self.confidence.issue(copied, gens, idx)
        if self.copies_lengths:  # its host copy started, for a read at these slots
            if isinstance(lens, jax.Array):
                lens.copy_to_host_async()
            else:  # the caller's own array may be reused for the next batch: a copy
                lens = np.array(lens)
            if idx.counts is not None:
                idx = idx._replace(array=np.array(idx.array))
            self.last_published = (idx, lens)
        if self.armed is not None:
            for d in _ranks_with_rows(idx, len(self.armed)):
                self.armed[d] = True

    def check(self) -> None:
        """`FutureMap.check` (without debug, nothing to check)."""
        if self.debug is not None:
            self.debug.check()


def _ranks_with_rows(idx: Rows, dp: int) -> list[int]:
    """The DP ranks given rows in `idx` (every rank for a jax array: not read)."""
    return [d for d in range(dp) if idx.has_rows(d)]


def _deleted(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.is_deleted()
