"""A FutureMap's parts and its life around the relay ops.

`MapCore` assembles a map from its constructor's arguments (each checked there: a
FutureMapError names the first that is wrong) and holds its parts: the layout and its
lifted ops, the placement (the caller's arguments checked, padded, a key), the
registry (the executable of each key), the runtime (the state, the lock, the debug
channel) and the host reads. It serves what is not a step's op: the state and its
buffers, `reset`, the executables, the debug `check` and `warm_up`. `FutureMap` adds the
ops an engine calls each step and the engine step (`engine_step`) over these parts.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fm_jax.host import buckets as bk
from fm_jax.host.decisions import Key, Placed, takes_state
from fm_jax.host.host_inputs import HostInputs
from fm_jax.host.place import Placement
from fm_jax.map.debug_channel import DebugChannel
from fm_jax.map.entry_points import entry_points
from fm_jax.map.executables import Registry, WarmUpReport, compiler_options
from fm_jax.map.host_copies import ConfidenceRing, HostLengths
from fm_jax.map.host_reads import HostReads
from fm_jax.map.runtime import MapRuntime
from fm_jax.map.warm_up import class_calls
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.ops import future_map
from fm_jax.ops.protocol import parse_protocol
from fm_jax.ops.relay_fields import SpecConfig
from fm_jax.ops.sharding import (
    MeshLayout,
    lift,
    mesh_layout,
    single_device_layout,
)
from fm_jax.ops.types import FutureMapState

_log = logging.getLogger("fm_jax")
_M = TypeVar("_M", bound=Callable[..., Any])


def serialized(method: _M) -> _M:
    """`method` run under the map's lock: calls from several threads take turns (each op
    donates the state the next one reads). Uncontended, the lock and the extra frame cost
    about 1 us a call or less (0.6-0.8 us waited, 0.9-1.3 us host on a 2-core CPU). A map
    whose state a failed call consumed refuses it (`StateLost`, until `reset`)."""

    @functools.wraps(method)
    def locked(self: MapCore, *args: Any, **kwargs: Any) -> Any:
        runtime = self._runtime
        with runtime.lock:
            if runtime.lost is not None:
                runtime.refuse_if_lost()
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


class MapCore:
    """A FutureMap's parts, state and set-up (`FutureMap` documents the arguments)."""

    def __init__(
        self,
        pool_size: int,
        *,
        mesh: Mesh | None = None,
        dp_axis: str | None = "dp",
        tp_axis: str | None = None,
        dtype: Any = jnp.int32,
        spec: SpecConfig | None = None,
        debug: bool = False,
        batch_buckets: Sequence[int] | None = None,
        token_buckets: Sequence[int] | None = None,
        device: jax.Device | None = None,
        protocol: str = "sentinel",
        needs_cpu_seq_lens: bool = True,
    ) -> None:
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
        if (
            local.spec is not None
            and local.spec.kernel == "pallas"
            and platform not in ("cpu", "gpu")
        ):
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
            # A batch has at least one token per row (a DECODE row one): its rows are padded to
            # a batch bucket and its tokens to a token bucket >= those rows (resolve_sizes).
            raise FutureMapError(
                f"token_buckets {token_buckets} must reach the largest batch bucket "
                f"{batch_buckets[-1]}: a batch of B rows carries at least B tokens (a DECODE "
                "row one), so the largest token bucket must be >= the largest batch bucket "
                "(or a resolve of those rows, and warm_up, could not be placed)"
            )
        inputs = HostInputs(
            layout,
            pool_size,
            local.dtype,
            batch_buckets,
            token_buckets,
            proto,
        )
        debug_channel = DebugChannel(layout) if debug else None
        fresh: Callable[[], FutureMapState] = jax.jit(ops.init, out_shardings=layout.sharding)
        try:
            state = fresh()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise FutureMapError(
                f"pool_size {pool_size}: the buffers do not fit the device's memory ({e})"
            ) from None
        options = compiler_options(platform)
        if not isinstance(needs_cpu_seq_lens, bool):
            raise FutureMapError(f"needs_cpu_seq_lens must be a bool, got {needs_cpu_seq_lens!r}")
        # The last publish's lengths on their way to the host (one process only).
        lengths = HostLengths() if needs_cpu_seq_lens and inputs.single_process else None
        ring = None
        if local.spec is not None and local.spec.confidence:
            ring = ConfidenceRing(pool_size, layout.dp, layout.rank_of, layout.local_ranks())
        optional = rf.optional(local.spec.fields()) if local.spec is not None else ()
        runtime = MapRuntime(
            fresh,
            state,
            debug_channel,
            lengths,
            ring,
            optional,
            layout.dp,
            spec=local.spec is not None,
        )
        placement = Placement(inputs, proto, local.spec, debug=debug)
        placement.last_checked = runtime.last_checked
        # Debug: the tail ops' only checks are slot checks; slots already checked take
        # executables without them (a checked one costs ~35 us more per call on XLA:CPU).
        unchecked = (
            lift(future_map(pool_size, dtype=dtype, spec=spec, protocol=protocol), layout)
            if debug
            else ops
        )
        build = entry_points(ops, unchecked, proto, token_buckets, debug_channel, options)
        registry = Registry(build, _refusal(batch_buckets, token_buckets))
        self.layout: MeshLayout = layout
        self.ops = ops
        self.pool_size = pool_size
        self.dtype: np.dtype = inputs.dtype
        self.spec: SpecConfig | None = placement.spec
        self.debug = debug
        self._protocol = proto
        self.protocol: str = proto.name
        self.batch_buckets = inputs.batch_buckets
        self.token_buckets = inputs.token_buckets
        self.local_ranks: tuple[int, ...] = layout.local_ranks()
        self._options = options
        self._placement: Placement = placement
        self._optional = frozenset(optional)
        self._runtime: MapRuntime = runtime
        self._registry: Registry = registry
        self._reads = HostReads(placement, runtime)

    # ------------------------------------------------------------------------------ state
    @property
    @serialized
    def state(self) -> FutureMapState:
        """The map's own global buffers, read under its lock.

        The next op donates them (deletes them): they are valid only until then, so read
        them only from the thread that serves, between its ops. From another thread, or
        to keep them, take `buffers(copy=True)`.
        """
        return self._runtime.state

    @property
    def step(self) -> int:
        """Resolves (and engine steps) so far: the step debug violations name."""
        return self._runtime.step

    @serialized
    def buffers(self, *, copy: bool = False) -> dict[str, jax.Array]:
        """The present buffers by name, global [DP*R, ...] (DLPack-exportable on one device).

        Args:
          copy: False: the map's own buffers (as `state`): the next op donates them, so they
            are valid only until then, and a live DLPack export of one blocks that op's
            donation (release it first). True: copies made on the device under the map's
            lock (no host sync): the caller's own, valid whatever ops follow, from any
            thread (a monitor's read while other threads serve).
        """
        out = {k: v for k, v in self._runtime.state._asdict().items() if v is not None}
        return {k: jax.tree.map(jnp.copy, v) for k, v in out.items()} if copy else out

    def reset(self) -> None:
        """Re-create the initial state: every slot's rows and lengths as at construction.

        Every request the map was relaying is forgotten (start each again with a prefill);
        the step count and pending debug errors are kept. The recovery from `StateLost`,
        which every op raises once a failed call consumed the state; also serves to drop
        every request at once.
        """
        with self._runtime.lock:  # not refused when lost: it is the way back
            self._runtime.reset()

    def executables(self) -> dict[str, Any]:  # jax's jitted-function type is private
        """The jitted entry points by name (for compile counting and HLO inspection).

        `resolve` takes a traced mode, `resolve_fixed_{extend,decode}` a mode known on the
        host; a debug map's `unchecked_*` are its tail ops for slots already checked.
        """
        keys = [Key(op, 0) for op in ("publish", "stash", "finish", "sentinels", "seq_lens_at")]
        keys += [Key("resolve", 0, mode=m) for m in ("traced", "extend", "decode")]
        if self.debug:
            keys += [k._replace(checked=False) for k in keys]
        return {k.name: self._registry.jitted(k) for k in keys}

    # -------------------------------------------------------------------------------- run
    def _run(self, placed: Placed, op: str, *, new_step: bool = False) -> Any:
        """Placed call `placed` on its executable; its debug error recorded as `op`'s."""
        key = placed.key
        exe = self._registry.executable(key, placed.pack)
        ops = (op,) if self.debug and key.checked else ()
        return self._runtime.run(
            exe, placed.args, ops, call=op, with_state=takes_state(key.op), new_step=new_step
        )

    @serialized
    def check(self) -> None:
        """Raise InvariantViolation listing every failed debug check since the last call.

        A host sync. Names each violation's invariant, step (resolves so far), op and, on
        a map with several DP ranks, the rank. Without debug: nothing to check.
        """
        self._runtime.check()

    # ------------------------------------------------------------------------ engine step
    # ---------------------------------------------------------------------------- warm-up
    @serialized
    def warm_up(
        self,
        *,
        guard: bool = False,
        traced_modes: bool = True,
        threads: int | None = None,
        partial_stashes: Sequence[Collection[str]] = (),
    ) -> WarmUpReport:
        """Compile every executable serving calls, for every bucket, ahead of time.

        The calls (`warm_up.empty_tails`, `empty_batches`): publish, stash, finish and the
        sentinels per batch bucket (a debug map's tail ops also unchecked; a spec map's
        `seq_lens_at` too); resolve per token bucket (which fixes its rows) and resolve
        variant (mode fixed not DECODE, fixed DECODE, traced; token slots in the gather
        protocol), with and without a draft on a spec map. Each is an empty batch placed
        as serving places its inputs; traced,
        lowered and compiled on `threads` threads; nothing runs and no buffer changes.
        Logs the report at INFO on the "fm_jax" logger.

        Args:
          guard: afterwards, serve only the warmed executables: a call that would compile
            (a shape, dtype or sharding not warmed) raises FutureMapError naming the op,
            its sizes and the buckets, before anything runs.
          traced_modes: also warm resolve with a traced forward mode (a jax array, and a
            mesh's ranks in different kinds); False for an engine that gives every batch
            a host ForwardMode on one device.
          threads: compile threads; default min(8, CPU count).
          partial_stashes: spec: the partial stashes the engine makes, each the names of
            the fields its drafts give (e.g. `[("bonus_tokens",)]` for a bonus-only
            stash): stash and finish are warmed for each too (a partial stash is an
            executable of its own). A set a stash would refuse is refused here.

        Returns:
          What was compiled, what came from JAX's persistent cache, and the time.
        """
        calls = class_calls(
            self._placement,
            self._runtime.state,
            debug=self.debug,
            traced_modes=traced_modes,
            partial=partial_stashes,
        )
        summary = self._registry.warm_up(calls, guard=guard, threads=threads)
        _log.info("%s", summary)
        return summary


def _refusal(
    batch_buckets: tuple[int, ...], token_buckets: tuple[int, ...]
) -> Callable[[Key], str]:
    """The serving guard's words for a class call warm-up did not compile."""

    def words(key: Key) -> str:
        return (
            f"serving guard: {key.describe()} was not compiled by warm_up() (batch buckets "
            f"{batch_buckets}, token buckets {token_buckets}); a call would "
            "compile it: add its bucket, or pass inputs padded to a warmed one"
        )

    return words
