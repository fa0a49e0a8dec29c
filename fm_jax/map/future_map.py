"""`FutureMap`: the pure ops behind jitted, donated entry points, on one device or a mesh
(one device is a mesh of one DP rank; methods, argument rules and return types are the same)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fm_jax.host import buckets as bk
from fm_jax.host.decisions import Key, Placed
from fm_jax.host.host_inputs import HostInputs
from fm_jax.host.place import Placement
from fm_jax.map import host_reads
from fm_jax.map.debug_channel import DebugChannel
from fm_jax.map.engine_step import EngineStep, Forward, StepInput
from fm_jax.map.executables import compiler_options, entry_points, tail
from fm_jax.map.host_reads import ConfidenceRing, ResolvedConfidence
from fm_jax.map.runtime import MapRuntime, Registry, serialized
from fm_jax.map.warm_up import WarmUpReport, class_calls, not_warmed, step_calls, warm
from fm_jax.ops import errors
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.ops import future_map, lift
from fm_jax.ops.protocol import parse_protocol
from fm_jax.ops.sharding import MeshLayout, mesh_layout, single_device_layout
from fm_jax.ops.types import (
    Batch,
    DraftPayload,
    FutureMapState,
    MixedTails,
    Resolved,
    RowsInput,
    SpecConfig,
)

_log = logging.getLogger("fm_jax")

Payload = RowsInput | DraftPayload | Mapping[int, DraftPayload]
"""What `stash` writes: tokens [B], or a DraftPayload of [B, ...] rows; or a mapping."""


class FutureMap:
    """A FutureMap that holds its state and updates it in place through donated jitted ops.

    Host arrays are checked and padded to a bucket per DP rank (a mapping DP rank -> host
    rows feeds a mesh's ranks); outputs are global arrays padded per rank (`fm_jax.per_rank`
    splits them). One lock per map; debug errors wait for `check()`; a failure after the
    donation raises `StateLost` until `reset()` (CONTRACT.md, 'Donation and lifetimes').

    Args:
      pool_size: R, slots per DP rank (max running requests + 1, R - 1 fits `dtype`).
      mesh: a `jax.sharding.Mesh` for one pool per DP rank; None: one device, `device`
        (default JAX's default device).
      dp_axis, tp_axis: the mesh's data-parallel axis (None: one pool replicated) and
        tensor-parallel axis (buffers replicated on it), or None.
      dtype: int32 (default) or int64 (needs JAX's x64 mode).
      spec: static shapes of the spec extras, or None.
      debug: consume tracking and invariant checks.
      batch_buckets, token_buckets: allowed per-rank batch sizes and flat token counts;
        default powers of two up to 1024 and 8192.
      protocol: 'sentinel' (default) or 'gather' (docs/CONTRACT.md, 'Two protocols').
      needs_cpu_seq_lens: each publish starts copying its lengths to the host, so that
        `resolve_seq_lens_cpu` waits for that step only.
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
        needs_cpu_seq_lens: bool = True,
    ) -> None:
        if mesh is not None and device is not None:
            raise FutureMapError("pass a mesh or a device, not both")
        if device is not None and not isinstance(device, jax.Device):
            raise FutureMapError(f"device must be a jax.Device, got {device!r}")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise FutureMapError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
        if mesh is None:
            self.layout: MeshLayout = single_device_layout(device or jax.devices()[0])
        else:
            self.layout = mesh_layout(mesh, dp_axis, tp_axis)
        local = future_map(pool_size, dtype=dtype, spec=spec, debug=debug, protocol=protocol)
        self.spec: SpecConfig | None = local.spec
        platform = self.layout.mesh.devices.flat[0].platform
        pallas = self.spec is not None and self.spec.kernel == "pallas"
        if pallas and platform not in ("cpu", "gpu"):
            raise FutureMapError(
                f"spec.kernel='pallas' is a Triton kernel (GPU; on CPU interpreted): no "
                f"lowering for {platform}; use kernel='xla'"
            )
        self.ops = ops = lift(local, self.layout)
        self._protocol = parse_protocol(local.protocol)
        batches = bk.normalize_buckets(
            bk.power_of_two_buckets(1024) if batch_buckets is None else batch_buckets
        )
        tokens = bk.normalize_buckets(
            bk.power_of_two_buckets(8192) if token_buckets is None else token_buckets
        )
        if tokens[-1] < batches[-1]:
            raise FutureMapError(
                f"token_buckets {tokens} must reach the largest batch bucket "
                f"{batches[-1]}: a batch of B rows carries at least B tokens (a DECODE "
                "row one), so the largest token bucket must be >= the largest batch bucket "
                "(or a resolve of those rows, and warm_up, could not be placed)"
            )
        inputs = HostInputs(self.layout, pool_size, local.dtype, batches, tokens, self._protocol)
        fresh: Callable[[], FutureMapState] = jax.jit(ops.init, out_shardings=self.layout.sharding)
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
        spec, channel = self.spec, DebugChannel(self.layout) if debug else None
        ring = ConfidenceRing(self.layout, inputs.checks) if spec and spec.confidence else None
        optional = rf.optional(spec.fields()) if spec is not None else ()
        lengths = needs_cpu_seq_lens and self.layout.single_process  # host copies: one process
        host = (channel, lengths, ring, optional, self.layout.dp, spec is not None)
        self._runtime = MapRuntime(fresh, state, *host)
        self._placement = Placement(inputs, self._protocol, self.spec)
        self._options = compiler_options(platform)
        build = entry_points(ops, self._protocol, tokens, channel, self._options)
        self._registry = Registry(build, not_warmed(batches, tokens))
        self.pool_size, self.dtype, self.debug = pool_size, inputs.dtype, debug
        self.protocol, self.local_ranks = self._protocol.name, self.layout.local_ranks()
        self.batch_buckets, self.token_buckets = batches, tokens

    @property
    @serialized
    def state(self) -> FutureMapState:
        """The map's own global buffers: valid until the next op donates them."""
        return self._runtime.state

    @property
    def step(self) -> int:
        """Resolves (and engine steps) so far: the step debug violations name."""
        return self._runtime.step

    @serialized
    def buffers(self, *, copy: bool = False) -> dict[str, jax.Array]:
        """The present buffers by name, global [DP*R, ...]: the map's own (as `state`), or
        with `copy` device copies made under the lock, valid whatever ops follow."""
        out = {k: v for k, v in self._runtime.state._asdict().items() if v is not None}
        return {k: jax.tree.map(jnp.copy, v) for k, v in out.items()} if copy else out

    def reset(self) -> None:
        """Re-create the initial state, forgetting every relayed request (each starts again
        with a prefill); step count and debug errors stay. Recovers from `StateLost`."""
        with self._runtime.lock:  # not refused when lost: it is the way back
            self._runtime.reset()

    def executables(self) -> dict[str, Any]:  # jax's jitted-function type is private
        """The jitted entry points by name (compile counting, HLO inspection): `resolve`
        takes a traced mode, `resolve_fixed_{extend,decode}` a host mode."""
        keys = [Key(op, 0) for op in ("publish", "stash", "finish", "sentinels", "seq_lens_at")]
        keys += [Key("resolve", 0, mode=m) for m in ("traced", "extend", "decode")]
        return {k.name: self._registry.jitted(k) for k in keys}

    def _run(self, placed: Placed, op: str, *, new_step: bool = False) -> Any:
        """`placed` run on its executable, its debug error recorded as `op`'s."""
        exe = self._registry.executable(placed.key, placed.pack)
        ops = (op,) if self.debug else ()
        return self._runtime.run(exe, placed.args, ops, call=op, new_step=new_step)

    @serialized
    def check(self) -> None:
        """Raise InvariantViolation listing every failed debug check since the last call
        (a host sync), naming each one's invariant, step, op and (several DP ranks) rank."""
        self._runtime.check()

    @serialized
    def warm_up(
        self,
        *,
        guard: bool = False,
        traced_modes: bool = True,
        threads: int | None = None,
        partial_stashes: Sequence[Collection[str]] = (),
    ) -> WarmUpReport:
        """Compile every executable serving calls, for every bucket, ahead of time; nothing
        runs; logged at INFO.

        Args:
          guard: afterwards a call that would compile raises FutureMapError naming the op,
            its sizes and the buckets, before anything runs.
          traced_modes: also warm resolve with a traced forward mode.
          threads: compile threads; default min(8, CPU count).
          partial_stashes: spec: each partial stash the engine makes, as the names of the
            fields its drafts give (e.g. `[("bonus_tokens",)]`).
        """
        calls = class_calls(self._placement, self._runtime.state, traced_modes, partial_stashes)
        summary = warm(self._registry, calls, guard=guard, threads=threads)
        _log.info("%s", summary)
        return summary

    def engine_step(
        self,
        forward: Forward,
        *,
        inputs: Sequence[StepInput] = (),
        donate_argnums: Sequence[int] = (),
        host_out: Callable[[Any], Any] | None = None,
        host_ring: int = 4,
        compiler_options: Mapping[str, Any] | None = None,
    ) -> EngineStep:
        """The engine's jitted step with this map's relay inside: one dispatch per step.

        Args:
          forward: `(resolved, batch, inputs, *args) -> StepOutput`, traced in the step.
          inputs: the engine's own per-row or per-token host arrays (`StepInput`).
          donate_argnums: indices into the step's `args` to donate (the KV cache).
          host_out: `out -> arrays` the host reads a step late (tokens, logprobs), copied
            as each step is enqueued (`EngineStep.read_host`); at most `host_ring` unread.
          compiler_options: XLA options; default `fm_jax.compiler_options()`.
        """
        return EngineStep(
            forward,
            ops=self.ops,
            placement=self._placement,
            runtime=self._runtime,
            registry=self._registry,
            tail=functools.partial(tail, self.ops, self._protocol, self.token_buckets, ""),
            plan=step_calls,
            warm=warm,
            inputs=inputs,
            donate_argnums=donate_argnums,
            host_out=host_out,
            host_ring=host_ring,
            options=self._options if compiler_options is None else compiler_options,
        )

    @serialized
    def publish(
        self,
        indices: RowsInput,
        new_seq_lens: RowsInput,
        *,
        rows: int | None = None,
        confidence: RowsInput | None = None,
        generation: Any = None,
    ) -> None:
        """`new_seq_lens[indices] := new_seq_lens`, in place. No real row: a no-op.

        Args:
          indices: slots [B] (rank-local), or a mapping DP rank -> slots.
          new_seq_lens: lengths after this forward, one per slot, in the same form.
          rows: per-rank padded size (a batch bucket); required across processes.
          confidence: with `SpecConfig(confidence=gamma)`: [B, gamma] float32 rows in the
            same form, written and copied to the host ring. None: the rows stay.
          generation: required with `confidence` only: the host's per-slot generation
            counters ([DP*R], or a mapping DP rank -> [R]).
        """
        self._tail("publish", indices, new_seq_lens, None, rows, confidence, generation)

    @serialized
    def stash(self, indices: RowsInput, payload: Payload, *, rows: int | None = None) -> None:
        """Write tokens (non-spec) or a DraftPayload (spec) at `indices`, in place: slots
        and `payload` (`Payload`) in the forms and with the `rows` that `publish` takes."""
        self._tail("stash", indices, None, payload, rows, None, None)

    @serialized
    def finish(
        self,
        batch: Batch,
        indices: RowsInput,
        new_seq_lens: RowsInput,
        payload: Payload,
        *,
        rows: int | None = None,
        confidence: RowsInput | None = None,
        generation: Any = None,
    ) -> Batch:
        """A step's tail in one donated call: `publish`, `stash`, then `invalidate(batch,
        indices)`; returns the invalidated batch (the gather protocol: `batch` as given)."""
        idx, sentinels = self._tail(
            "finish", indices, new_seq_lens, payload, rows, confidence, generation
        )
        return self._placement.next_batch(batch, indices, idx, sentinels)  # type: ignore[no-any-return]

    def _tail(
        self, op: str, indices: Any, lens: Any, payload: Any, rows: Any, confidence: Any, gen: Any
    ) -> tuple[Any, Any]:
        """Publish, stash or finish run, with its host bookkeeping: (slots, finish's sentinels)."""
        runtime = self._runtime
        if gen is not None and confidence is None:
            raise errors.generation_without_confidence(op, runtime.confidence is not None)
        placed = self._placement.tail(op, indices, lens, payload, rows, confidence=confidence)
        gens = copied = sentinels = None
        if confidence is not None:  # declared (placement refuses it otherwise): checked first
            gens = runtime.confidence.generations(gen, placed.idx)
        if placed.idx.empty:
            return placed.idx, None
        out = self._run(placed, op)
        if gens is not None:
            out, copied = out
        if op == "finish":
            out, sentinels = out
        runtime.state = out
        if op != "stash":
            runtime.published(placed.idx, placed.lens, copied, gens)
        if op != "publish" and runtime.unstashed is not None:
            runtime.stashed(placed.idx, placed.key.omits)
        return placed.idx, sentinels

    @serialized
    def resolve(
        self,
        batch: Batch | Mapping[int, Batch],
        *,
        rows: int | None = None,
        tokens: int | None = None,
    ) -> Resolved:
        """A new step: the batch's placeholders filled from the buffers, global arrays
        padded per rank to the buckets.

        Args:
          batch: a Batch, its `forward_mode` a host ForwardMode or a jax int32 array
            (traced: a scalar, or one per DP rank); or a mapping DP rank -> host Batch.
          rows, tokens: per-rank padded sizes (buckets); required across processes.
        """
        placed = self._placement.resolve(batch, rows, tokens)
        out = self._run(placed, "resolve", new_step=True)
        if self.debug:
            self._runtime.state, out = out  # debug: the consume poison was written
            self._runtime.resolved()
        if self._runtime.unstashed is not None and out.draft is not None:
            out = out._replace(draft=self._runtime.without_unstashed(out.draft, self.local_ranks))
        return out  # type: ignore[no-any-return]

    @serialized
    def relayed_fields(self, rank: int = 0) -> tuple[str, ...]:
        """The draft fields a resolve gathers on DP rank `rank`, in stash order: the
        consume-tracked ones, and each other once a stash wrote it there since the map was
        made or `reset` (SGLang's DSA availability flag)."""
        return self._runtime.relayed_fields(rank, self.spec)

    @serialized
    def invalidate(self, batch: Batch, indices: RowsInput, *, rows: int | None = None) -> Batch:
        """`batch` with `input_ids` and `seq_lens` := the sentinels -indices: host slots'
        of their real rows, on the host; device slots' (or a mapping's) global, padded per
        rank (docs/CONTRACT.md, 'Sentinels'). Refused in the gather protocol."""
        if not self._protocol.invalidates:
            raise errors.invalidate_in_gather_protocol()
        placed = self._placement.slots_op("sentinels", indices, rows)
        idx, sentinels = placed.idx, None
        if idx.counts is None:  # device slots: made on the device (debug: checked there)
            sentinels = self._run(placed, "invalidate")
        return self._placement.next_batch(batch, indices, idx, sentinels)  # type: ignore[no-any-return]

    @serialized
    def resolve_seq_lens_cpu(
        self, indices: RowsInput, *, rows: int | None = None
    ) -> np.ndarray | dict[int, np.ndarray]:
        """Host copy of `new_seq_lens[indices]`, in the form `indices` was given; pending
        debug errors raise here. The last publish's slots take its copy (waiting for its
        step only), others behind everything queued (debug: CONTRACT.md, 'Lengths')."""
        return host_reads.seq_lens(self._placement, self._runtime, self._run, indices, rows)

    @serialized
    def resolve_mixed_tails_cpu(
        self,
        batch: Batch | Mapping[int, Batch],
        *,
        prefix_lens: RowsInput | Mapping[int, RowsInput] | None = None,
    ) -> MixedTails | dict[int, MixedTails]:
        """A spec MIXED batch's host lengths, its running rows rebound (gather protocol;
        SGLang's `resolve_mixed_spec_tails`): a running row's length := its published
        length + 1, its `prefix_lens` the published one. Reads the last publish's lengths,
        not consuming them: call it before the step that runs the batch."""
        return host_reads.mixed_tails(self._placement, self._runtime, self._run, batch, prefix_lens)

    @serialized
    def resolve_confidence_cpu(
        self, indices: Any, *, wait: bool = False
    ) -> ResolvedConfidence | None | dict[int, ResolvedConfidence | None]:
        """The confidence rows of host slots `indices` (or a mapping DP rank -> slots) from
        two publishes with confidence back, with their generations; None before two such
        publishes, for no slots, and (unless `wait`) while that copy is not done."""
        return host_reads.confidence(self._runtime, indices, wait)
