"""The engine's own step with the FutureMap inside: one jitted, donated dispatch per step
(resolve, the engine's `forward`, publish, stash and the sentinels), no host sync added."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax.host.decisions import FIXED_MODES, Key, PackSpec, unpack
from fm_jax.host.place import Placement
from fm_jax.host.validate import StepInput, check_declared
from fm_jax.ops import errors
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.ops import FutureMapOps
from fm_jax.ops.rows import gather
from fm_jax.ops.types import Batch, ForwardMode

__all__ = ["EngineStep", "Forward", "HostOut", "StepInput", "StepOutput", "StepResult"]


class StepOutput(NamedTuple):
    """What the engine's `forward` returns to the step's tail.

    Attributes:
      new_seq_lens: [B] each row's length after this forward, published (a forward that
        owns the buffer, `StepInput("new_seq_lens", "slot")`: the whole buffer, written).
      payload: [B] sampled tokens (non-spec), or a DraftPayload of [B, ...] rows (spec),
        stashed at the batch's `req_pool_indices` (owned `output_tokens`: the buffer).
      out: anything else (the updated KV cache, the tokens for the host), returned as is.
      confidence: [B, gamma] float32 confidence rows, published with the lengths
        (`SpecConfig(confidence=gamma)`; the step then takes `generation=`), or None.
    """

    new_seq_lens: Any
    payload: Any
    out: Any = None
    confidence: Any = None


class StepResult(NamedTuple):
    """What one call of an `EngineStep` returns.

    Attributes:
      out: `StepOutput.out` of the engine's forward.
      batch: the batch for the next step: in the sentinel protocol the invalidated batch,
        its sentinels in the form the slots were given (host slots': host rows; jax slots':
        padded per rank, the ids to the token bucket; docs/CONTRACT.md, 'Sentinels'); in
        the gather protocol the batch as given.
    """

    out: Any
    batch: Batch | Mapping[int, Batch]


class HostOut(NamedTuple):
    """One step's outputs as the host reads them (`EngineStep.read_host`): the step's
    number among this EngineStep's calls (from 0), and what `host_out` picked, in numpy."""

    step: int
    out: Any


Forward = Callable[..., StepOutput]
"""(resolved, batch, inputs, *args) -> StepOutput: the engine's model and sampling."""


class EngineStep:
    """An engine's jitted step with the FutureMap's relay inside, built by
    `FutureMap.engine_step`; call it once per batch: `step(batch, *args, inputs={...})`."""

    def __init__(
        self,
        forward: Forward,
        *,
        ops: FutureMapOps,
        placement: Placement,
        runtime: Any,
        registry: Any,
        tail: Callable[..., Any],
        plan: Callable[..., list[Any]],
        warm: Callable[..., Any],
        inputs: Sequence[StepInput] = (),
        donate_argnums: Sequence[int] = (),
        host_out: Callable[[Any], Any] | None = None,
        host_ring: int = 4,
        options: Mapping[str, Any],
    ) -> None:
        if not callable(forward):
            raise FutureMapError(f"engine_step needs a callable forward, got {forward!r}")
        if host_out is not None and not callable(host_out):
            raise FutureMapError(f"host_out must be callable (out -> arrays), got {host_out!r}")
        if isinstance(host_ring, bool) or not isinstance(host_ring, int) or host_ring < 1:
            raise FutureMapError(f"host_ring must be an int >= 1, got {host_ring!r}")
        if not isinstance(donate_argnums, Sequence) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in donate_argnums
        ):
            raise FutureMapError(
                "donate_argnums must be a sequence of indices >= 0 into the step's args "
                f"(() for none), got {donate_argnums!r}"
            )
        donate = tuple(donate_argnums)
        self._forward = forward
        self._declared = check_declared(inputs, ops.dtype)
        # Host inputs are placed with the batch; owned relay buffers come from the state.
        self._placed = tuple(d for d in self._declared if d.per != "slot")
        self._owned = frozenset(d.name for d in self._declared if d.per == "slot")
        spec = ops.spec
        if "output_tokens" in self._owned and spec is not None and not spec.bonus_tokens:
            raise FutureMapError(
                "StepInput 'output_tokens' per='slot': this spec map relays no bonus tokens, "
                "so its output_tokens buffer carries nothing"
            )
        self._donate = donate
        self._ops = ops
        self._placement = placement
        self._runtime = runtime
        self._protocol = placement.protocol
        self._options = dict(options)
        self._tail = tail(owned=self._owned)
        self._registry = registry  # the map's: this step's executables beside the class's
        self._decided: dict[Any, Any] = {}  # this step's layouts (its inputs are its own)
        self._plan, self._warm = functools.partial(plan, decided=self._decided), warm
        # The declared fields each executable family's payload leaves out (seen when traced).
        self._omits: dict[tuple[str, PackSpec | None, int], tuple[str, ...]] = {}
        # Per step unread: (its number, what host_out picked, copying; or host_out's error).
        self._host_out, self._ring_size = host_out, host_ring
        self._ring: collections.deque[tuple[int, Any]] = collections.deque()
        self._calls = 0

    @property
    def inputs(self) -> tuple[StepInput, ...]:
        """The engine's declared inputs (host arrays, and the relay buffers it owns)."""
        return self._declared

    def __call__(
        self,
        batch: Batch | Mapping[int, Batch],
        *args: Any,
        inputs: Mapping[str, Any] | None = None,
        rows: int | None = None,
        tokens: int | None = None,
        generation: Any = None,
    ) -> StepResult:
        """Run one step: resolve, `forward(resolved, batch, inputs, *args)`, publish, stash.

        Args:
          batch: as `FutureMap.resolve` takes it (host or jax arrays, a host or traced
            mode, or a mapping DP rank -> Batch); checked and placed the same way.
          *args: the engine's own arguments (weights, KV cache, ...), passed to `forward`
            as given; those named by `donate_argnums` are donated.
          inputs: the declared `StepInput`s by name: host arrays of the batch's real rows
            or tokens (padded here like the batch), or jax arrays already padded.
          rows, tokens: per-rank padded sizes (buckets); required across processes.
          generation: with a confidence relay, required: the host's per-slot generation
            counters (as `FutureMap.publish` takes them); refused on other maps.

        Returns:
          StepResult: the forward's `out` and the batch for the next step.
        """
        runtime = self._runtime
        with runtime.lock:  # one op at a time on the map (see FutureMap)
            if runtime.lost is not None:
                runtime.refuse_if_lost()
            if self._host_out is not None and len(self._ring) >= self._ring_size:
                raise FutureMapError(
                    f"the engine step's host ring holds {len(self._ring)} unread steps "
                    f"(host_ring={self._ring_size}): read_host() before the next step"
                )
            ring = runtime.confidence
            if ring is None and generation is not None:
                raise errors.generation_without_confidence("the engine step", relay=False)
            placed = self._placement.resolve(
                batch, rows, tokens, step=self._placed, inputs=inputs, decided=self._decided
            )
            gens = None if ring is None else ring.generations(generation, placed.idx)
            exe = self._registry.executable(placed.key, placed.pack, len(args), self._build)
            ops = ("resolve", "finish") if runtime.debug is not None else ()
            out = runtime.run(
                exe,
                placed.args,
                ops,
                call="the engine step",
                new_step=True,
                engine_args=args,
                donated=self._donate,
            )
            if runtime.debug is not None:
                runtime.resolved()
            runtime.state, result, sentinels, lens, copied = out
            runtime.published(placed.idx, lens, copied, gens)
            if runtime.unstashed is not None:
                family = (placed.key.mode, placed.pack, len(args))
                runtime.stashed(placed.idx, self._omits.get(family, ()))
            if self._host_out is not None:
                self._ring.append((self._calls, _copying(self._host_out, result)))
            self._calls += 1
        given: Any = None
        if not isinstance(batch, Mapping):
            given = batch.req_pool_indices
        else:  # one global batch (the gather protocol: as given)
            given = {r: b.req_pool_indices for r, b in batch.items()}
            if self._protocol.invalidates:
                slots = placed.idx.array
                batch = Batch(None, slots, slots, slots)
        return StepResult(result, self._placement.next_batch(batch, given, placed.idx, sentinels))

    def read_host(self, *, wait: bool = False) -> HostOut | None:
        """The oldest unread step's `host_out` arrays on the host (their copies start as
        the step is enqueued), or None: no step unread, or (`wait` False) that step not
        done yet. With `wait`, waits for that step only. Steps are read in order, each once.
        """
        if self._host_out is None:
            raise FutureMapError("read_host: this engine step was built without host_out=")
        if not self._ring:
            return None
        n, picked = self._ring[0]
        if isinstance(picked, Exception):
            self._ring.popleft()
            raise FutureMapError(f"host_out failed on step {n}: {picked}") from picked
        leaves, tree = jax.tree_util.tree_flatten(picked)
        if not wait and not all(x.is_ready() for x in leaves):
            return None
        self._ring.popleft()
        try:
            host = [np.asarray(x) for x in leaves]
        except RuntimeError as err:  # deleted: a later step took the array donated
            raise FutureMapError(
                f"read_host: step {n}'s host_out picked an array a later step donated "
                "(its copy went with it): pick outputs no step takes back, such as tokens"
            ) from err
        return HostOut(n, jax.tree_util.tree_unflatten(tree, host))

    def _not_warmed(self, key: Key) -> str:
        inputs = self._placement.inputs
        return (
            f"serving guard: the engine step for {key.describe()} with these inputs was "
            f"not compiled by warm_up() (batch buckets {inputs.batch_buckets}, token buckets "
            f"{inputs.token_buckets}); a call would compile it: add its bucket, or pass "
            "inputs placed as warmed (host arrays, or jax arrays for every field)"
        )

    def _build(self, key: Key, pack: PackSpec | None, nargs: int) -> Any:
        """The jitted step of `key`'s family (its mode fixed, or traced) fed as `pack`
        lays out, taking `nargs` engine arguments."""
        bad = [i for i in self._donate if i >= nargs]
        if bad:
            raise FutureMapError(
                f"donate_argnums {bad} name no argument: the step got {nargs} args"
            )
        assert pack is not None  # a step is always packed

        def record(omits: tuple[str, ...]) -> None:
            self._omits[(key.mode, pack, nargs)] = omits

        return jax.jit(
            self._body(FIXED_MODES.get(key.mode), pack, record),
            donate_argnums=(0, *(3 + i for i in self._donate)),
            compiler_options=self._options,
        )

    def _body(
        self,
        fixed: ForwardMode | None,
        spec: PackSpec,
        record: Callable[[tuple[str, ...]], None],
    ) -> Callable[..., Any]:
        """(state, packed, device leaves, *args) -> (state, out, sentinels, lengths, a copy
        of the confidence buffer when the forward published confidence rows); with debug
        ((resolve's packed error, the tail's), that). `record` is told, when traced, which
        declared fields the forward's payload leaves out (a partial stash)."""
        forward, tail_fn, ops, owned = self._forward, self._tail, self._ops, self._owned
        fields = self._placement.fields
        debug, dtype = self._runtime.debug, ops.dtype
        copies_lengths = self._runtime.copies_lengths
        rows_of = ops.map_ranks(gather)  # each rank's buffer rows at its slots
        # Host slots' sentinels are made on the host (`Placement.next_batch`): one output less.
        on_host = jax.tree_util.tree_unflatten(spec.treedef, [x is not None for x in spec.leaves])
        host_slots = on_host[0].req_pool_indices

        def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
            if debug is None:
                return lambda *a: (None, fn(*a))
            # Each shard_map checked on its own (`executables.tail`).
            return debug.checked(fn)

        def body(state: Any, packed: Any, device: Any, *args: Any) -> Any:
            batch, inputs = unpack(spec, packed, device)
            if fixed is not None:
                batch = batch._replace(forward_mode=int(fixed))
            e_head, (state, res) = checked(ops.resolve)(state, batch)
            if owned:  # the buffers as resolve left them, for the forward to write
                inputs = {**inputs, **{name: getattr(state, name) for name in owned}}
            got = forward(res, batch, inputs, *args)
            if not isinstance(got, StepOutput):
                raise FutureMapError(
                    f"the engine's forward must return a StepOutput, got {type(got).__name__}"
                )
            idx = batch.req_pool_indices
            try:  # the tail's trace-time checks judge only what the forward returned
                e_tail, (state, sentinels) = checked(tail_fn)(
                    state, idx, got.new_seq_lens, got.payload, got.confidence
                )
            except FutureMapError as e:
                raise FutureMapError(
                    f"the engine's forward returned a StepOutput the map cannot relay: {e}"
                ) from None
            if fields:
                record(tuple(f.name for f in fields if rf.get(got.payload, f.name) is None))
            # The published lengths leave the step only when the host reads them.
            lens = None
            if copies_lengths:
                lens = (
                    rows_of(state.new_seq_lens, idx)
                    if "new_seq_lens" in owned
                    else jnp.asarray(got.new_seq_lens, dtype)
                )
            copied = None if got.confidence is None else state.confidence
            out = (state, got.out, None if host_slots else sentinels, lens, copied)
            return out if debug is None else ((e_head, e_tail), out)

        return body

    def warm_up(
        self, *args: Any, guard: bool = False, traced_modes: bool = True, threads: int | None = None
    ) -> Any:  # a WarmUpReport
        """Compile the step for every bucket serving reaches, ahead of time: resolve's
        batches (`FutureMap.warm_up`) and zeros for the declared inputs, as host arrays and
        (in one process) jax arrays. Nothing runs, nothing is donated.

        Args:
          *args: the engine's arguments as serving passes them (only their shapes,
            dtypes and shardings are read).
          guard: afterwards, serve only the warmed executables: a call that would compile
            raises FutureMapError before anything runs.
          traced_modes: also warm a traced forward mode (see `FutureMap.warm_up`).
          threads: compile threads; default min(8, CPU count).
        """
        runtime = self._runtime
        with runtime.lock:
            runtime.refuse_if_lost()
            calls = self._plan(self._placement, self._placed, runtime.state, args, traced_modes)
            return self._warm(
                self._registry,
                calls,
                guard=guard,
                threads=threads,
                build=self._build,
                refusal=self._not_warmed,
            )


def _copying(host_out: Callable[[Any], Any], out: Any) -> Any:
    """`host_out(out)` with each array's host copy started; the error it raised, if any
    (the step has run: `read_host` reports it, the step's result stands)."""
    try:
        picked = host_out(out)
        leaves = jax.tree_util.tree_leaves(picked)
        bad = sorted({type(x).__name__ for x in leaves if not isinstance(x, jax.Array)})
        if bad or not leaves:
            raise TypeError(f"it must pick jax arrays from StepOutput.out, got {bad or 'none'}")
        for x in leaves:
            x.copy_to_host_async()
    except Exception as err:  # noqa: BLE001 - reported by read_host, never absorbed
        return err
    return picked
