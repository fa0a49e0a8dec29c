"""`FutureMap`: the pure ops behind jitted, donated entry points, on one device or a mesh.

One device is the one-rank layout: a one-device mesh with one DP rank. A mesh gives each
DP rank its own pool of `pool_size` slots, replicated over the other axes (see
`fm_jax.sharded_future_map`). Methods, argument rules and return types are the same in
both; `host_inputs` says what a caller may pass.

A call goes one way: the caller's arguments -> `placement` (checked, padded, packed, a
key) -> the `registry`'s executable for that key -> `runtime.run` (the state donated, the
debug error recorded) -> the result. The class holds the three and says which op is which.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fm_jax._src import buckets as bk
from fm_jax._src import refusals
from fm_jax._src.compile_options import compiler_options
from fm_jax._src.debug_channel import DebugChannel
from fm_jax._src.engine_step import EngineStep, Forward
from fm_jax._src.entry_points import entry_points
from fm_jax._src.errors import FutureMapError
from fm_jax._src.host_inputs import HostInputs
from fm_jax._src.host_lengths import HostLengths
from fm_jax._src.keys import Key, takes_state
from fm_jax._src.ops import future_map
from fm_jax._src.packing import pack_host
from fm_jax._src.placement import Placement, StepInput
from fm_jax._src.plans import Placed
from fm_jax._src.protocol import parse_protocol
from fm_jax._src.registry import Call, Registry, WarmUpReport
from fm_jax._src.runtime import MapRuntime
from fm_jax._src.sharding import MeshLayout, lift, mesh_layout, per_rank, single_device_layout
from fm_jax._src.types import Batch, DraftPayload, FutureMapState, Resolved, RowsInput, SpecConfig
from fm_jax._src.warm_up import empty_batches, empty_tails

_log = logging.getLogger("fm_jax")
_M = TypeVar("_M", bound=Callable[..., Any])
Payload = RowsInput | DraftPayload | Mapping[int, DraftPayload]
"""What `stash` writes: tokens [B] (non-spec) or a DraftPayload of [B, ...] rows (spec), or
per-rank mappings of either."""


def _serialized(method: _M) -> _M:
    """`method` run under the map's lock: calls from several threads take turns (each op
    donates the state the next one reads). Uncontended, the lock and the extra frame cost
    about 1 us a call or less (`python -m fm_bench.lock_cost`)."""

    @functools.wraps(method)
    def locked(self: FutureMap, *args: Any, **kwargs: Any) -> Any:
        with self._runtime.lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


class FutureMap:
    """A FutureMap that holds its state and updates it in place through donated jitted ops.

    Inputs (see `fm_jax._src.host_inputs`): host arrays are checked by value, padded to a
    bucket per DP rank and handed to the op's executable (one dispatch per call, no
    Python-side transfer); jax arrays are taken as they are (each rank's rows already a
    bucket size); a mapping DP rank -> host rows feeds a mesh's ranks one by one (ranks
    left out are idle). Outputs are global jax arrays, padded per rank to the bucket;
    padding rows carry slot 0 and token 0 (`fm_jax.per_rank` splits them by rank). A call
    of a layout seen before (the same fields, shapes and dtypes) does only the value checks,
    the padding and one lookup (`plans`).

    Debug mode adds no host sync per step: each op's checkify error stays on device and is
    reported by `check()`, or by `resolve_seq_lens_cpu` (which syncs anyway).

    Threads: a map's ops (and its engine steps) take turns on one lock per map, so several
    threads may call one map; each op sees the state the previous one left.

    Args:
      pool_size: R, slots per DP rank (max running requests + 1); slot 0 is padding.
      mesh: a `jax.sharding.Mesh` for one pool per DP rank; None: one device.
      dp_axis: the mesh's data-parallel axis, or None (one pool replicated everywhere).
      tp_axis: the mesh's tensor-parallel axis (buffers replicated on it), or None.
      dtype: int32 (default) or int64 (needs JAX's x64 mode).
      spec: static shapes of the spec extras, or None.
      debug: consume tracking and invariant checks.
      batch_buckets: allowed per-rank batch sizes (rows); default powers of two up to 1024.
      token_buckets: allowed per-rank flat token counts; default powers of two up to 8192.
      device: without a mesh, where the buffers live; default JAX's default device.
      protocol: 'sentinel' (default: `invalidate` leaves -slot placeholders that resolve
        fills) or 'gather' (resolve gathers decode ids, MIXED running rows' ids and spec
        lengths at forward entry; no invalidate). docs/CONTRACT.md, 'Two protocols'.
      pack_inputs: a call whose arrays are all on the host sends them to the device as
        one packed buffer (`packing`) instead of one transfer per array. Default: on
        where a transfer costs more than packing (GPU, TPU: about 55 us of host time per
        numpy argument), off on CPU (about 2.5 us, less than the packing itself). One
        process only: across processes each array is sharded as given.
      needs_cpu_seq_lens: the engine reads lengths on the host (`resolve_seq_lens_cpu`):
        each publish starts copying its lengths to the host, so a read of the slots last
        published waits for the publishing step only (`host_lengths`). False (SGLang's
        `needs_cpu_seq_lens` off): no copy at all; `resolve_seq_lens_cpu` then gathers
        from the buffer, a sync behind everything queued.
    """

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
        pack_inputs: bool | None = None,
        needs_cpu_seq_lens: bool = True,
    ) -> None:
        if mesh is not None and device is not None:
            raise FutureMapError("pass a mesh or a device, not both")
        if device is not None and not isinstance(device, jax.Device):
            raise FutureMapError(f"device must be a jax.Device, got {device!r}")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise FutureMapError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
        self.layout: MeshLayout = (
            single_device_layout(device or jax.devices()[0])
            if mesh is None
            else mesh_layout(mesh, dp_axis, tp_axis)
        )
        local = future_map(pool_size, dtype=dtype, spec=spec, debug=debug, protocol=protocol)
        platform = self.layout.mesh.devices.flat[0].platform
        if (
            local.spec is not None
            and local.spec.kernel == "pallas"
            and platform not in ("cpu", "gpu")
        ):
            raise FutureMapError(
                f"spec.kernel='pallas' is a Triton kernel (GPU; on CPU interpreted): no "
                f"lowering for {platform}; use kernel='xla'"
            )
        self.ops = lift(local, self.layout)
        self.pool_size = pool_size
        self.dtype: np.dtype = local.dtype
        self.spec: SpecConfig | None = local.spec
        self.debug = debug
        self._protocol = parse_protocol(local.protocol)
        self.protocol: str = self._protocol.name
        self.batch_buckets = bk.normalize_buckets(
            bk.power_of_two_buckets(1024) if batch_buckets is None else batch_buckets
        )
        self.token_buckets = bk.normalize_buckets(
            bk.power_of_two_buckets(8192) if token_buckets is None else token_buckets
        )
        self.local_ranks: tuple[int, ...] = self.layout.local_ranks()
        inputs = HostInputs(
            self.layout,
            pool_size,
            self.dtype,
            self.batch_buckets,
            self.token_buckets,
            self._protocol,
        )
        debug_channel = DebugChannel(self.layout) if debug else None
        try:
            state: FutureMapState = jax.jit(self.ops.init, out_shardings=self.layout.sharding)()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise FutureMapError(
                f"pool_size {pool_size}: the buffers do not fit the device's memory ({e})"
            ) from None
        if pack_inputs is not None and not isinstance(pack_inputs, bool):
            raise FutureMapError(f"pack_inputs must be a bool or None, got {pack_inputs!r}")
        self.pack_inputs: bool = inputs.single_process and (
            platform != "cpu" if pack_inputs is None else pack_inputs
        )
        self._options = compiler_options(platform)
        if not isinstance(needs_cpu_seq_lens, bool):
            raise FutureMapError(f"needs_cpu_seq_lens must be a bool, got {needs_cpu_seq_lens!r}")
        # The last publish's lengths on their way to the host (one process only).
        lengths = HostLengths() if needs_cpu_seq_lens and inputs.single_process else None
        self._runtime = MapRuntime(state, debug_channel, lengths)
        self._placement = Placement(
            inputs, self._protocol, self.spec, pack_inputs=self.pack_inputs, debug=debug
        )
        self._placement.last_checked = self._runtime.last_checked
        # Debug: the tail ops' only checks are slot checks; slots already checked take
        # executables without them (a checked one costs ~35 us more per call on XLA:CPU).
        unchecked = (
            lift(future_map(pool_size, dtype=dtype, spec=spec, protocol=protocol), self.layout)
            if debug
            else self.ops
        )
        build = entry_points(self.ops, unchecked, self._protocol, debug_channel, self._options)
        self._registry = Registry(build, self._not_warmed)

    def _not_warmed(self, key: Key) -> str:
        return (
            f"serving guard: {key.describe()} was not compiled by warm_up() (batch buckets "
            f"{self.batch_buckets}, token buckets {self.token_buckets}); a call would "
            "compile it: add its bucket, or pass inputs padded to a warmed one"
        )

    # ------------------------------------------------------------------------------ state
    @property
    def state(self) -> FutureMapState:
        """The current global buffers. Donated on the next op: keep no references across ops."""
        return self._runtime.state

    @property
    def step(self) -> int:
        """Resolves (and engine steps) so far: the step debug violations name."""
        return self._runtime.step

    def buffers(self) -> dict[str, jax.Array]:
        """The present buffers by name, global [DP*R, ...] (DLPack-exportable on one device).

        Release exported views before the next op: a live external reference blocks donation.
        """
        return {k: v for k, v in self._runtime.state._asdict().items() if v is not None}

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
            exe, placed.args, ops, with_state=takes_state(key.op), new_step=new_step
        )

    # -------------------------------------------------------------------------------- ops
    @_serialized
    def publish(
        self, indices: RowsInput, new_seq_lens: RowsInput, *, rows: int | None = None
    ) -> None:
        """`new_seq_lens[indices] := new_seq_lens`, in place. No real row: a no-op.

        Args:
          indices: slots [B] (rank-local), or a mapping DP rank -> slots.
          new_seq_lens: lengths after this forward, one per slot, in the same form.
          rows: per-rank padded size (a batch bucket); required across processes.
        """
        placed = self._placement.tail("publish", indices, new_seq_lens, None, rows)
        if placed.idx.empty:
            return  # DP idle: nothing ran, nothing to relay
        self._runtime.state = self._run(placed, "publish")
        self._runtime.published(placed.idx, placed.lens)

    @_serialized
    def stash(self, indices: RowsInput, payload: Payload, *, rows: int | None = None) -> None:
        """Write tokens (non-spec) or a DraftPayload (spec) at `indices`, in place.

        Args:
          indices: slots [B] (rank-local), or a mapping DP rank -> slots.
          payload: tokens [B], or a DraftPayload of [B, ...] rows; per-rank mappings
            (of tokens, or DraftPayloads) when `indices` is one.
          rows: per-rank padded size (a batch bucket); required across processes.
        """
        placed = self._placement.tail("stash", indices, None, payload, rows)
        if placed.idx.empty:
            return  # DP idle: nothing ran, nothing to relay
        self._runtime.state = self._run(placed, "stash")

    @_serialized
    def finish(
        self,
        batch: Batch,
        indices: RowsInput,
        new_seq_lens: RowsInput,
        payload: Payload,
        *,
        rows: int | None = None,
    ) -> Batch:
        """The tail of a step in one donated call: publish, stash, then invalidate.

        Equivalent to `publish(indices, new_seq_lens)`, `stash(indices, payload)` and
        `invalidate(batch, indices)`, for engines that hold lengths and tokens (or the whole
        draft) together; one dispatch instead of three. Returns the invalidated batch; in
        the gather protocol (no sentinels) `batch` as given.
        """
        placed = self._placement.tail("finish", indices, new_seq_lens, payload, rows)
        if placed.idx.empty:  # DP idle: nothing to relay
            if not self._protocol.invalidates:
                return batch
            return self._sentinels(batch, indices, rows)
        self._runtime.state, sentinels = self._run(placed, "finish")
        self._runtime.published(placed.idx, placed.lens)
        return self._protocol.next_batch(batch, sentinels)  # type: ignore[no-any-return]

    @_serialized
    def resolve(
        self,
        batch: Batch | Mapping[int, Batch],
        *,
        rows: int | None = None,
        tokens: int | None = None,
    ) -> Resolved:
        """Fill the batch's placeholders from the buffers (see `future_map`'s resolve).

        Starts a new step.

        Args:
          batch: a Batch; its `forward_mode` a ForwardMode known on the host (an
            executable with that mode fixed), or a jax int32 array (traced: a scalar for
            every rank, or one per DP rank). Or a mapping DP rank -> Batch of host rows
            with host modes; local ranks left out are idle.
          rows, tokens: per-rank padded sizes (buckets); required across processes.
            In the gather protocol a non-spec DECODE batch known on the host brings no ids
            (None: they are gathered; ids given are refused), and a MIXED batch's
            `token_slots` are placed like its `input_ids`.

        Returns:
          Resolved ids, lengths and draft: global arrays padded per rank to the buckets.
        """
        placed = self._placement.resolve(batch, rows, tokens)
        out = self._run(placed, "resolve", new_step=True)
        if self.debug:
            self._runtime.state, out = out  # debug: the consume poison was written
            self._runtime.resolved(placed.idx)
        return out  # type: ignore[no-any-return]

    @_serialized
    def invalidate(self, batch: Batch, indices: RowsInput, *, rows: int | None = None) -> Batch:
        """Sentinels for the next step: ids and lengths := -indices (padding rows: 0).

        Returns `batch` with `input_ids` and `seq_lens` replaced by the sentinels, global
        and padded per rank to the batch bucket; its other fields as given. Refused in the
        gather protocol, which leaves no sentinels.
        """
        if not self._protocol.invalidates:
            raise refusals.invalidate_in_gather_protocol()
        return self._sentinels(batch, indices, rows)

    def _sentinels(self, batch: Batch, indices: RowsInput, rows: int | None) -> Batch:
        """The sentinels of slots `indices`; a debug map checks device slots on the device
        (unless the last resolve checked that very array), host slots were checked here."""
        sentinels = self._run(self._placement.slots_op("sentinels", indices, rows), "invalidate")
        return self._protocol.next_batch(batch, sentinels)  # type: ignore[no-any-return]

    @_serialized
    def resolve_seq_lens_cpu(
        self, indices: RowsInput, *, rows: int | None = None
    ) -> np.ndarray | dict[int, np.ndarray]:
        """Host copy of `new_seq_lens[indices]` (pending debug errors raise here).

        At exactly the slots of the last publish (or `finish`, or engine step) it takes the
        copy that publish started: it waits for the publishing step only, not for work
        queued after it (`needs_cpu_seq_lens`). Other slots are gathered from the buffer:
        a sync behind everything queued.

        Returns the lengths in the form `indices` was given: [B] host rows (global, padding
        removed for host input), or a mapping DP rank -> lengths.
        """
        placed = self._placement.slots_op("seq_lens_at", indices, rows)
        inputs, lengths = self._placement.inputs, self._runtime.host_lengths
        copied = None if lengths is None else lengths.read(placed.idx)
        if copied is not None:  # the slots last published: their copy, no gather
            self.check()
            return inputs.unpad(copied, placed.idx)
        out = self._run(placed, "resolve_seq_lens_cpu")
        if inputs.single_process:
            host = np.asarray(jax.device_get(out))
        else:
            blocks = per_rank(out, self.layout)
            size = placed.idx.size
            host = np.concatenate(
                [blocks.get(d, np.zeros(size, self.dtype)) for d in range(self.layout.dp)]
            )
        self.check()
        return inputs.unpad(host, placed.idx)

    @_serialized
    def check(self) -> None:
        """Raise InvariantViolation listing every failed debug check since the last call.

        A host sync. Names each violation's invariant, step (resolves so far), op and, on
        a map with several DP ranks, the rank. Without debug: nothing to check.
        """
        if self._runtime.debug is not None:
            self._runtime.debug.check()

    # ------------------------------------------------------------------------ engine step
    def engine_step(
        self,
        forward: Forward,
        *,
        inputs: Sequence[StepInput] = (),
        donate_argnums: Sequence[int] = (),
        compiler_options: Mapping[str, Any] | None = None,
    ) -> EngineStep:
        """The engine's jitted step with this map's relay inside: the recommended way in.

        One dispatch per step: resolve at the head, `forward` on the resolved ids and
        lengths, publish, stash and (sentinel protocol) the sentinels at the tail; the map's
        state and the arguments named by `donate_argnums` donated. The class's rules hold
        unchanged: the batch's host arrays are checked by value and padded to the buckets
        (by the map's own placement), every host array of a call (the batch's and the
        declared `inputs`) goes to the device in one packed transfer, `EngineStep.warm_up`
        (with `guard=True`) covers the step's executables, and debug errors go to `check()`.

        Args:
          forward: `(resolved, batch, inputs, *args) -> StepOutput`, traced inside the
            step: `resolved` the filled ids, lengths (and draft); `batch` the placed batch
            (its `req_pool_indices` are the rows' slots; `forward_mode` a fixed ForwardMode
            when known on the host, else traced); `inputs` the declared inputs by name;
            `args` the step's own arguments. It returns the new lengths and the payload
            to relay (tokens, or a DraftPayload on a spec map) and its `out`.
          inputs: the engine's own per-row or per-token host arrays (`StepInput`).
          donate_argnums: indices into the step's `args` to donate (the KV cache).
          compiler_options: XLA options of the step; default `fm_jax.compiler_options()`
            for the map's platform (on CPU that keeps the step's elementwise ops on the
            calling thread: pass `{}` for a model that wants XLA's thread pool).

        Returns:
          EngineStep: `step(batch, *args, inputs=...) -> StepResult(out, next batch)`.
        """
        return EngineStep(
            forward,
            ops=self.ops,
            placement=self._placement,
            runtime=self._runtime,
            protocol=self._protocol,
            inputs=inputs,
            donate_argnums=donate_argnums,
            options=self._options if compiler_options is None else compiler_options,
        )

    # ---------------------------------------------------------------------------- warm-up
    @_serialized
    def warm_up(
        self, *, guard: bool = False, traced_modes: bool = True, threads: int | None = None
    ) -> WarmUpReport:
        """Compile every executable serving calls, for every bucket, ahead of time.

        The calls (`warm_up.empty_tails`, `empty_batches`): publish, stash, finish and the
        sentinels per batch bucket (a debug map's tail ops also unchecked; a spec map's
        `seq_lens_at` too); resolve per token bucket (which fixes its rows) and resolve
        variant (mode fixed not DECODE, fixed DECODE, traced; token slots in the gather
        protocol), with and without a draft on a spec map. Each is an empty batch placed
        as serving places its inputs (and, with `pack_inputs`, packed too); traced,
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

        Returns:
          What was compiled, what came from JAX's persistent cache, and the time.
        """
        placement, state = self._placement, self._runtime.state
        inputs, protocol, spec = placement.inputs, self._protocol, self.spec
        placed: list[Placed] = []
        for t in empty_tails(inputs, protocol, spec):
            if t.op in ("sentinels", "seq_lens_at"):
                p = placement.slots_op(t.op, t.indices, t.rows, pack=False)
            else:
                p = placement.tail(t.op, t.indices, t.lens, t.payload, t.rows, pack=False)
            both = self.debug and t.op != "seq_lens_at"
            placed += [p._replace(key=p.key._replace(checked=c)) for c in (True, False)[: 1 + both]]
        for e in empty_batches(inputs, protocol, spec, traced_modes=traced_modes):
            placed.append(placement.resolve(e.batch, e.rows, e.tokens, pack=False))
        calls: list[Call] = []
        for p in placed:
            head = (state,) if takes_state(p.key.op) else ()
            calls.append((p.key, None, (*head, *p.args), 0))
            host = pack_host(p.args) if self.pack_inputs else None
            if host is not None:
                calls.append((p.key, host[0], (*head, host[1]), 0))
        summary = self._registry.warm_up(calls, guard=guard, threads=threads)
        _log.info("%s", summary)
        return summary
