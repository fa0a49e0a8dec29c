"""A map's parts, assembled from its constructor's arguments, and its state as it serves.

`assemble` checks the arguments (a FutureMapError names the first wrong one) and builds
the parts. `MapRuntime.run` is the one way an executable is called on the state, by the
map's ops and its engine steps alike. A failed call is diagnosed on the failure path only:
one that consumed the donated state leaves the map lost (`StateLost`, until `reset`); one
JAX refused before running leaves the state as it was, named as a `FutureMapError`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
from jax.sharding import Mesh

from fm_jax.host import buckets as bk
from fm_jax.host.buckets import Rows
from fm_jax.host.decisions import Key
from fm_jax.host.host_inputs import HostInputs
from fm_jax.host.place import Placement
from fm_jax.map.debug_channel import DebugChannel
from fm_jax.map.executables import Registry, compiler_options, entry_points
from fm_jax.map.host_reads import ConfidenceRing, HostLengths
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.checks import FRESH_PUBLISH
from fm_jax.ops.errors import FutureMapError, StateLost
from fm_jax.ops.ops import FutureMapOps, future_map, lift
from fm_jax.ops.protocol import Protocol, parse_protocol
from fm_jax.ops.relay_fields import draft_payload
from fm_jax.ops.sharding import MeshLayout, mesh_layout, single_device_layout
from fm_jax.ops.types import FutureMapState, SpecConfig

_M = TypeVar("_M", bound=Callable[..., Any])


def serialized(method: _M) -> _M:
    """A map's `method` run under its lock (each op donates the state the next one reads;
    uncontended about 1 us a call), refused with `StateLost` while the map is lost."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = self._runtime
        with runtime.lock:
            if runtime.lost is not None:
                runtime.refuse_if_lost()
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


class MapParts(NamedTuple):
    """A map's parts (`FutureMap` holds them)."""

    layout: MeshLayout
    ops: FutureMapOps
    inputs: HostInputs
    protocol: Protocol
    runtime: MapRuntime
    placement: Placement
    registry: Registry
    options: dict[str, str]


def assemble(
    pool_size: int,
    mesh: Mesh | None,
    dp_axis: str | None,
    tp_axis: str | None,
    dtype: Any,
    spec: SpecConfig | None,
    debug: bool,
    batch_buckets: Any,
    token_buckets: Any,
    device: Any,
    protocol: str,
    needs_cpu_seq_lens: bool,
) -> MapParts:
    """A map's parts from `FutureMap`'s arguments (documented there), each checked."""
    if mesh is not None and device is not None:
        raise FutureMapError("pass a mesh or a device, not both")
    if device is not None and not isinstance(device, jax.Device):
        raise FutureMapError(f"device must be a jax.Device, got {device!r}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise FutureMapError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
    layout = (
        single_device_layout(device or jax.devices()[0])
        if mesh is None
        else mesh_layout(mesh, dp_axis, tp_axis)
    )
    local = future_map(pool_size, dtype=dtype, spec=spec, debug=debug, protocol=protocol)
    platform = layout.mesh.devices.flat[0].platform
    if local.spec is not None and local.spec.kernel == "pallas" and platform not in ("cpu", "gpu"):
        raise FutureMapError(
            f"spec.kernel='pallas' is a Triton kernel (GPU; on CPU interpreted): no "
            f"lowering for {platform}; use kernel='xla'"
        )
    ops = lift(local, layout)
    proto = parse_protocol(local.protocol)
    batch_buckets = bk.normalize_buckets(
        bk.power_of_two_buckets(1024) if batch_buckets is None else batch_buckets
    )
    token_buckets = bk.normalize_buckets(
        bk.power_of_two_buckets(8192) if token_buckets is None else token_buckets
    )
    if token_buckets[-1] < batch_buckets[-1]:
        raise FutureMapError(
            f"token_buckets {token_buckets} must reach the largest batch bucket "
            f"{batch_buckets[-1]}: a batch of B rows carries at least B tokens (a DECODE "
            "row one), so the largest token bucket must be >= the largest batch bucket "
            "(or a resolve of those rows, and warm_up, could not be placed)"
        )
    inputs = HostInputs(layout, pool_size, local.dtype, batch_buckets, token_buckets, proto)
    fresh: Callable[[], FutureMapState] = jax.jit(ops.init, out_shardings=layout.sharding)
    try:
        state = fresh()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise FutureMapError(
            f"pool_size {pool_size}: the buffers do not fit the device's memory ({e})"
        ) from None
    if not isinstance(needs_cpu_seq_lens, bool):
        raise FutureMapError(f"needs_cpu_seq_lens must be a bool, got {needs_cpu_seq_lens!r}")
    # The last publish's lengths on their way to the host (one process only).
    lengths = HostLengths() if needs_cpu_seq_lens and inputs.single_process else None
    ring = None
    if local.spec is not None and local.spec.confidence:
        ring = ConfidenceRing(pool_size, layout.dp, layout.rank_of, layout.local_ranks())
    optional = rf.optional(local.spec.fields()) if local.spec is not None else ()
    channel = DebugChannel(layout) if debug else None
    runtime = MapRuntime(
        fresh, state, channel, lengths, ring, optional, layout.dp, spec=local.spec is not None
    )
    # One executable per op: a debug map's tail ops check their slots on the device even
    # where the host or the last resolve checked them (~35 us a call on XLA:CPU).
    placement = Placement(inputs, proto, local.spec, debug=False)
    options = compiler_options(platform)
    build = entry_points(ops, proto, token_buckets, channel, options)

    def not_warmed(key: Key) -> str:
        return (
            f"serving guard: {key.describe()} was not compiled by warm_up() (batch buckets "
            f"{batch_buckets}, token buckets {token_buckets}); a call would "
            "compile it: add its bucket, or pass inputs padded to a warmed one"
        )

    registry = Registry(build, not_warmed)
    return MapParts(layout, ops, inputs, proto, runtime, placement, registry, options)


class MapRuntime:
    """One map's state as it serves.

    Attributes:
      lock: one op at a time (each donates the state the next reads); reentrant.
      state, step: the current buffers; resolves (and engine steps) so far.
      debug, host_lengths, confidence: the debug channel, the last publish's lengths on
        their way to the host, the confidence ring; each None when not used.
      lost: the StateLost of the call that consumed the state (every op refused with it),
        or None.
      unstashed: per DP rank, the optional draft fields no stash has written there since
        the state was made; None once every rank has had each (one check per call).
      armed: debug, spec: per DP rank, whether a publish came since the last read of
        lengths, which consumes it; None otherwise.
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
        self.optional = optional
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
            self.host_lengths.forget()
        if self.confidence is not None:
            self.confidence.clear()
        if self.armed is not None:
            self.armed = [False] * len(self.armed)  # as at construction: no publish yet

    def _unstash(self) -> None:
        """No optional field stashed yet, on any rank."""
        self.unstashed = [set(self.optional) for _ in range(self._dp)] if self.optional else None

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
        return tuple(f for f in self.optional if f not in left)

    def without_unstashed(self, draft: Any, ranks: Sequence[int]) -> Any:
        """`draft` with None for each optional field no stash has written on any of
        `ranks` (its rows would be the buffer's initial zeros)."""
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
        with_state: bool = True,
        new_step: bool = False,
        engine_args: Sequence[Any] = (),
        donated: Sequence[int] = (),
    ) -> Any:
        """`exe(state, *args, *engine_args)` (`with_state` False: `exe(*args)`); returns
        its outputs. `ops`: the names its debug errors are recorded as (one packed error,
        or one per op of a step, before the outputs; empty without checks). `call`: the
        call in words, for errors. `new_step`: a resolve or engine step (not counted if it
        fails). `donated`: which of `engine_args` (an engine step's own) are donated.
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

    def resolved(self, idx: Rows) -> None:
        """Debug, after a resolve ran: a spec map's resolve may have consumed the lengths
        last published (their host copy is then not the buffer's: a read gathers, and
        finds the poison)."""
        if self.armed is not None and self.host_lengths is not None:
            self.host_lengths.forget()

    def published(self, idx: Rows, lens: Any, copied: Any = None, gens: Any = None) -> None:
        """A publish wrote `lens` at `idx` (as placed): start their copy to the host
        (debug, spec: and arm the ranks it wrote); with confidence rows, `copied` the
        confidence buffer, `gens` the generations snapshotted, both to the ring."""
        if copied is not None:
            assert self.confidence is not None and gens is not None
            self.confidence.issue(copied, gens, idx)
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
