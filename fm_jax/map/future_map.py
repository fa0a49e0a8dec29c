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

from fm_jax.host.decisions import Key, Placed
from fm_jax.host.place import Placement
from fm_jax.host.validate import StepInput
from fm_jax.map import host_reads
from fm_jax.map.debug_channel import DebugChannel
from fm_jax.map.engine_step import EngineStep, Forward
from fm_jax.map.executables import assemble, entry_points, tail
from fm_jax.map.host_reads import ConfidenceRing, ResolvedConfidence
from fm_jax.map.runtime import MapRuntime, Registry, serialized
from fm_jax.map.warm_up import WarmUpReport, class_calls, not_warmed, step_calls, warm
from fm_jax.ops import errors
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.sharding import MeshLayout
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

    Host arrays are checked and padded to a bucket per DP rank; a mapping DP rank -> host
    rows feeds a mesh's ranks. Outputs are global arrays padded per rank (`fm_jax.per_rank`
    splits them). One lock per map; debug errors wait for `check()`. A failure after the
    state was donated raises `StateLost` until `reset()` (CONTRACT.md, 'Donation and
    lifetimes').

    Args:
      pool_size: R, slots per DP rank (max running requests + 1, R - 1 fits `dtype`).
      mesh: a `jax.sharding.Mesh` for one pool per DP rank; None: one device.
      dp_axis, tp_axis: the mesh's data-parallel axis (None: one pool replicated) and
        tensor-parallel axis (buffers replicated on it), or None.
      dtype: int32 (default) or int64 (needs JAX's x64 mode).
      spec: static shapes of the spec extras, or None.
      debug: consume tracking and invariant checks.
      batch_buckets: allowed per-rank batch sizes; default powers of two up to 1024.
      token_buckets: allowed per-rank flat token counts; default powers of two up to 8192.
      device: without a mesh, where the buffers live; default JAX's default device.
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
        ops, inputs, fresh, state, options = assemble(
            pool_size,
            mesh,
            dp_axis,
            tp_axis,
            dtype,
            spec,
            debug,
            batch_buckets,
            token_buckets,
            device,
            protocol,
            needs_cpu_seq_lens,
        )
        self.spec: SpecConfig | None = ops.spec
        self.layout: MeshLayout = inputs.layout
        ring = None
        if self.spec is not None and self.spec.confidence:
            ring = ConfidenceRing(pool_size, self.layout)
        channel = DebugChannel(self.layout) if debug else None
        optional = rf.optional(self.spec.fields()) if self.spec is not None else ()
        lengths = needs_cpu_seq_lens and self.layout.single_process  # host copies: one process
        host = (channel, lengths, ring, optional, self.layout.dp, self.spec is not None)
        self._runtime = MapRuntime(fresh, state, *host)
        self._protocol = inputs.protocol
        self._placement = Placement(inputs, self._protocol, self.spec)
        self._options = options
        build = entry_points(ops, self._protocol, inputs.token_buckets, channel, options)
        self._registry = Registry(build, not_warmed(inputs.batch_buckets, inputs.token_buckets))
        self.ops = ops
        self.pool_size = pool_size
        self.dtype: np.dtype = inputs.dtype
        self.debug = debug
        self.protocol: str = self._protocol.name
        self.batch_buckets = inputs.batch_buckets
        self.token_buckets = inputs.token_buckets
        self.local_ranks: tuple[int, ...] = self.layout.local_ranks()

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
        """Placed call `placed` on its executable; its debug error recorded as `op`'s."""
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
        calls = class_calls(
            self._placement, self._runtime.state, traced_modes=traced_modes, partial=partial_stashes
        )
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
        """The engine's jitted step with this map's relay inside (`EngineStep`), one
        dispatch per step.

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
        """Publish, stash or finish placed and run, with its host bookkeeping; returns the
        slots as placed and finish's sentinels."""
        runtime = self._runtime
        if gen is not None and confidence is None:
            raise errors.generation_without_confidence(op, runtime.confidence is not None)
        placed = self._placement.tail(op, indices, lens, payload, rows, confidence=confidence)
        gens = copied = sentinels = None
        if confidence is not None:
            assert runtime.confidence is not None  # placement refuses it undeclared
            gens = runtime.confidence.generations(gen, placed.idx)  # checked before a run
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
        """Fill the batch's placeholders from the buffers, a new step: the Resolved global
        arrays, padded per rank to the buckets.

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
