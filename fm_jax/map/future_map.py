"""`FutureMap`: the pure ops behind jitted, donated entry points, on one device or a mesh.

One device is the one-rank layout: a one-device mesh with one DP rank. A mesh gives each
DP rank its own pool of `pool_size` slots, replicated over the other axes (the layout of
`fm_jax.future_map(..., mesh=)`). Methods, argument rules and return types are the same in
both; `host_inputs` says what a caller may pass.

A call goes one way: the caller's arguments -> `placement` (checked, padded, a key) ->
the `registry`'s executable for that key -> `runtime.run` (the state donated, the debug
error recorded) -> the result. `map_core.MapCore` holds the three (and the state and
warm-up); this class adds the ops an engine calls each step, the host reads
(`host_reads`) and the engine step over the same parts, and says which op is which.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from fm_jax.host.decisions import Placed
from fm_jax.host.validate import StepInput
from fm_jax.map.engine_step import EngineStep, Forward
from fm_jax.map.host_copies import ResolvedConfidence
from fm_jax.map.map_core import MapCore, serialized
from fm_jax.ops import errors
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.relay_fields import DraftPayload, draft_payload
from fm_jax.ops.types import Batch, MixedTails, Resolved, RowsInput

Payload = RowsInput | DraftPayload | Mapping[int, DraftPayload]
"""What `stash` writes: tokens [B] (non-spec) or a DraftPayload of [B, ...] rows (spec), or
per-rank mappings of either."""


class FutureMap(MapCore):
    """A FutureMap that holds its state and updates it in place through donated jitted ops.

    Inputs (see `fm_jax.host.host_inputs`): host arrays are checked by value, padded to a
    bucket per DP rank and handed to the op's executable (one dispatch per call, no
    Python-side transfer); jax arrays are taken as they are (each rank's rows already a
    bucket size); a mapping DP rank -> host rows feeds a mesh's ranks one by one (ranks
    left out are idle). Outputs are global jax arrays, padded per rank to the bucket;
    padding rows carry slot 0 and token 0 (`fm_jax.per_rank` splits them by rank). A call
    of a layout seen before (the same fields, shapes and dtypes) does only the value checks,
    the padding and one lookup (`decisions`).

    Debug mode adds no host sync per step: each op's checkify error stays on device and is
    reported by `check()`, or by `resolve_seq_lens_cpu` (which syncs anyway).

    Threads: a map's ops (and its engine steps) take turns on one lock per map, so several
    threads may call one map; each op sees the state the previous one left. `state` and
    `buffers()` are read under the lock; what they return is donated by the next op, so
    another thread takes `buffers(copy=True)`.

    Failures (docs/CONTRACT.md, 'Donation and lifetimes'): a call refused before it runs
    consumes nothing; a call that fails while it runs, after consuming the donated state,
    raises `StateLost`, and so does every later op until `reset()`.

    Args:
      pool_size: R, slots per DP rank (max running requests + 1); slot 0 is padding.
        Every slot fits `dtype`: R - 1 <= its largest value.
      mesh: a `jax.sharding.Mesh` for one pool per DP rank; None: one device.
      dp_axis: the mesh's data-parallel axis, or None (one pool replicated everywhere).
      tp_axis: the mesh's tensor-parallel axis (buffers replicated on it), or None.
      dtype: int32 (default) or int64 (needs JAX's x64 mode).
      spec: static shapes of the spec extras, or None.
      debug: consume tracking and invariant checks.
      batch_buckets: allowed per-rank batch sizes (rows); default powers of two up to 1024.
      token_buckets: allowed per-rank flat token counts; default powers of two up to 8192.
        The largest is at least the largest batch bucket (a batch has a token per row).
      device: without a mesh, where the buffers live; default JAX's default device.
      protocol: 'sentinel' (default: `invalidate` leaves -slot placeholders that resolve
        fills) or 'gather' (resolve gathers decode ids, MIXED running rows' ids and spec
        lengths at forward entry; no invalidate). docs/CONTRACT.md, 'Two protocols'.
      needs_cpu_seq_lens: the engine reads lengths on the host (`resolve_seq_lens_cpu`):
        each publish starts copying its lengths to the host, so a read of the slots last
        published waits for the publishing step only (`host_copies`). False (SGLang's
        `needs_cpu_seq_lens` off): no copy at all; `resolve_seq_lens_cpu` then gathers
        from the buffer, a sync behind everything queued.
    """

    # ----------------------------------------------------------------------- engine step
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
        unchanged (this map's placement, registry and runtime serve it): see `EngineStep`.

        Args:
          forward: `(resolved, batch, inputs, *args) -> StepOutput`, traced inside the
            step: `resolved` the filled ids, lengths (and draft); `batch` the placed batch
            (its `forward_mode` a fixed mode when known on the host, else traced); `inputs`
            the declared inputs by name; `args` the step's own arguments.
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

    # -------------------------------------------------------------------------------- ops
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
          confidence: a map declaring `SpecConfig(confidence=gamma)`: [B, gamma] float32
            rows, in the same form, written at `indices`; the confidence buffer's copy to
            the host ring starts (`resolve_confidence_cpu`). None: the rows stay.
          generation: with `confidence`, the host's per-slot generation counters ([R]
            ints per DP rank, [DP*R] or a mapping DP rank -> [R]), snapshotted with it;
            refused without it.
        """
        if generation is not None and confidence is None:
            raise self._generation_alone("publish")
        placed = self._placement.tail(
            "publish", indices, new_seq_lens, None, rows, confidence=confidence
        )
        gens = None if confidence is None else self._generations(generation, placed)
        if placed.idx.empty:
            return  # DP idle: nothing ran, nothing to relay
        out = self._run(placed, "publish")
        if gens is None:
            self._runtime.state = out
        else:
            self._runtime.state, copied = out
            self._confidence_published(copied, gens, placed)
        self._runtime.published(placed.idx, placed.lens)

    def _generation_alone(self, call: str) -> FutureMapError:
        """The refusal of `generation=` given to `call` without `confidence=`."""
        return errors.generation_without_confidence(call, self._runtime.confidence is not None)

    def _generations(self, generation: Any, placed: Placed) -> dict[int, np.ndarray]:
        """The generations snapshotted with confidence rows (placed: the map has the relay),
        checked before anything runs."""
        ring = self._runtime.confidence
        assert ring is not None
        return ring.generations(generation, placed.idx)

    def _confidence_published(self, copied: jax.Array, gens: Any, placed: Placed) -> None:
        ring = self._runtime.confidence
        assert ring is not None
        ring.issue(copied, gens, placed.idx)

    @serialized
    def resolve_confidence_cpu(
        self, indices: Any, *, wait: bool = False
    ) -> ResolvedConfidence | None | dict[int, ResolvedConfidence | None]:
        """The confidence rows of slots `indices` from the publish LAG (2) publishes with
        confidence back, and the generations snapshotted with them, without waiting.

        None before two such publishes, for no slots, and (unless `wait`) while that
        publish's host copy is not done. A row whose generation is older than its slot's
        current one was published by the slot's previous request.

        Args:
          indices: host slots [B] (one DP rank), or a mapping DP rank -> slots.
          wait: block until that publish's copy is done (tests, parity) instead of None.

        Returns:
          ResolvedConfidence (rows [B, gamma] float32, generations [B] int64) or None; per
          rank for a mapping.
        """
        return self._reads.confidence(indices, wait)

    @serialized
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
        if self._runtime.unstashed is not None:
            self._runtime.stashed(placed.idx, placed.key.omits)

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
        """The tail of a step in one donated call: publish, stash, then invalidate.

        Equivalent to `publish(indices, new_seq_lens, confidence=, generation=)`,
        `stash(indices, payload)` and `invalidate(batch, indices)`, for engines that hold
        lengths and tokens (or the whole draft) together; one dispatch instead of three.
        Returns the invalidated batch; in the gather protocol (no sentinels) `batch` as given.
        `generation` without `confidence` is refused, as by `publish`.
        """
        if generation is not None and confidence is None:
            raise self._generation_alone("finish")
        placed = self._placement.tail(
            "finish", indices, new_seq_lens, payload, rows, confidence=confidence
        )
        gens = None if confidence is None else self._generations(generation, placed)
        if placed.idx.empty:  # DP idle: nothing to relay
            if not self._protocol.invalidates:
                return batch
            return self._sentinels(batch, indices, rows)
        out = self._run(placed, "finish")
        if gens is not None:
            out, copied = out
            self._confidence_published(copied, gens, placed)
        self._runtime.state, sentinels = out
        self._runtime.published(placed.idx, placed.lens)
        if self._runtime.unstashed is not None:
            self._runtime.stashed(placed.idx, placed.key.omits)
        return self._protocol.next_batch(batch, sentinels)  # type: ignore[no-any-return]

    @serialized
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
        if self._runtime.unstashed is not None and out.draft is not None:
            out = out._replace(draft=self._without_unstashed(out.draft))
        return out  # type: ignore[no-any-return]

    def _without_unstashed(self, draft: DraftPayload) -> DraftPayload:
        """`draft` with None for each optional field no stash has written on any of this
        process's ranks (its rows would be the buffer's initial zeros)."""
        relayed = {f for d in self.local_ranks for f in self._runtime.relayed(d)}
        fields = {f: v for f, v in draft._asdict().items() if f != "extras"}
        fields.update(draft.extras or {})
        return draft_payload(
            {f: v for f, v in fields.items() if f in relayed or f not in self._optional}
        )

    @serialized
    def relayed_fields(self, rank: int = 0) -> tuple[str, ...]:
        """The draft fields a resolve gathers on DP rank `rank`, in stash order: every
        consume-tracked field (each stash writes them), and each other field once a stash
        wrote it on that rank since the map was made or `reset` (before, a resolve's draft
        has it None: SGLang's DSA availability flag). () without spec. `rank` is an int in
        [0, DP); anything else is refused naming it."""
        dp = self.layout.dp
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not 0 <= rank < dp:
            raise FutureMapError(f"rank must be a DP rank, an int in [0, {dp}), got {rank!r}")
        if self.spec is None:
            return ()
        relayed = set(self._runtime.relayed(int(rank)))
        return tuple(f.name for f in self.spec.fields() if f.consumed or f.name in relayed)

    @serialized
    def invalidate(self, batch: Batch, indices: RowsInput, *, rows: int | None = None) -> Batch:
        """Sentinels for the next step: ids and lengths := -indices (padding rows: 0).

        Returns `batch` with `input_ids` and `seq_lens` replaced by the sentinels, global
        and padded per rank to the batch bucket; its other fields as given. Refused in the
        gather protocol, which leaves no sentinels.
        """
        if not self._protocol.invalidates:
            raise errors.invalidate_in_gather_protocol()
        return self._sentinels(batch, indices, rows)

    def _sentinels(self, batch: Batch, indices: RowsInput, rows: int | None) -> Batch:
        """The sentinels of slots `indices`; a debug map checks device slots on the device
        (unless the last resolve checked that very array), host slots were checked here."""
        sentinels = self._run(self._placement.slots_op("sentinels", indices, rows), "invalidate")
        return self._protocol.next_batch(batch, sentinels)  # type: ignore[no-any-return]

    @serialized
    def resolve_seq_lens_cpu(
        self, indices: RowsInput, *, rows: int | None = None
    ) -> np.ndarray | dict[int, np.ndarray]:
        """Host copy of `new_seq_lens[indices]` (pending debug errors raise here).

        At exactly the slots of the last publish (or `finish`, or engine step) it takes the
        copy that publish started: it waits for the publishing step only, not for work
        queued after it (`needs_cpu_seq_lens`). Other slots are gathered from the buffer:
        a sync behind everything queued.

        Debug: every live slot read must hold a length >= 0 (published, and not consumed
        by a spec resolve since: 'consume lengths (WRWR)'); on a spec map each rank read
        must have published since its last read ('fresh publish').

        Returns the lengths in the form `indices` was given: [B] host rows (global, padding
        removed for host input), or a mapping DP rank -> lengths.
        """
        return self._reads.seq_lens(self._run, indices, rows)

    @serialized
    def resolve_mixed_tails_cpu(
        self,
        batch: Batch | Mapping[int, Batch],
        *,
        prefix_lens: RowsInput | Mapping[int, RowsInput] | None = None,
    ) -> MixedTails | dict[int, MixedTails]:
        """A spec MIXED batch's host lengths, its running rows rebound (gather protocol).

        The host side of the late binding whose device side `resolve` does (SGLang's
        `resolve_mixed_spec_tails` rewrites `seq_lens_cpu`, `seq_lens_sum` and
        `prefix_lens` too): each running row's length becomes its published length + 1,
        its prefix length the published one. Reads the lengths the last publish wrote
        (its host copy where the running slots are among its slots, else a gather, as
        `resolve_seq_lens_cpu`; the fresh publish is not consumed): call it after that
        publish and before the next (before the engine step that runs the batch).
        The KV pool's `out_cache_loc` stays the engine's.

        Args:
          batch: the MIXED Batch of host arrays (`req_pool_indices`, `seq_lens`,
            `token_slots`), as `resolve` takes it; or a mapping DP rank -> such a Batch.
          prefix_lens: the host's prefix lengths, one per row (a mapping, with one); None:
            none rebound.

        The batch is checked as `resolve` checks it, and its host lengths (`seq_lens`,
        `prefix_lens`) must be >= 0: a FutureMapError names the field before anything is
        read.

        Returns:
          MixedTails (a mapping DP rank -> MixedTails for a mapping).
        """
        return self._reads.mixed_tails(self._run, batch, prefix_lens)
