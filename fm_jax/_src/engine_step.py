"""The engine's own step with the FutureMap inside: one jitted, donated dispatch per step.

`FutureMap.engine_step(forward, ...)` returns an `EngineStep`. Each call:
1. places the batch exactly as `FutureMap.resolve` does (host arrays checked by value and
   padded to the map's buckets; jax arrays taken as they are), and the engine's declared
   host inputs (`StepInput`) padded like the batch's rows or tokens;
2. packs every host array of the call into one buffer (`packing`): one transfer;
3. runs one executable: resolve at the head, the engine's `forward` on the resolved ids and
   lengths, then publish, stash and (sentinel protocol) the sentinels at the tail, with the
   map's state and the engine arguments named by `donate_argnums` donated.

The map adds no dispatch and no host sync: its host work is the checks and the packing,
its device work the relay's gathers and scatters fused into the engine's computation.
Executables are keyed like resolve's (mode, per-rank rows and tokens, draft, token slots)
plus the packing layout; `warm_up` compiles them all for the map's buckets and, with
`guard=True`, serving then refuses any call that would compile. Debug errors go to the
map's channel (`FutureMap.check()`), as the ops' own do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax._src.compile_options import compiler_options
from fm_jax._src.entry_points import tail
from fm_jax._src.errors import FutureMapError
from fm_jax._src.host_inputs import Rows
from fm_jax._src.host_inputs import _host as host_array
from fm_jax._src.packing import PackSpec, pack, unpack
from fm_jax._src.types import Batch, ForwardMode
from fm_jax._src.warm_up import (
    Guarded,
    Key,
    Planned,
    WarmUpReport,
    compile_plan,
    counting_compiles,
    describe,
    plan,
    report,
)

if TYPE_CHECKING:
    from fm_jax._src.future_map import FutureMap

_FIXED_MODE = {
    "step": None,
    "step_fixed_extend": ForwardMode.EXTEND,
    "step_fixed_decode": ForwardMode.DECODE,
}
"""A step executable's name -> the mode it fixes when traced (None: traced)."""


def _step_key(resolve_key: Key) -> Key:
    """The step executable's key for a resolve key: the same sizes, 'resolve' -> 'step'."""
    return resolve_key._replace(name="step" + resolve_key.name.removeprefix("resolve"))


class StepInput(NamedTuple):
    """One of the engine's own per-step host arrays (positions, offsets, sampling params).

    Attributes:
      name: its key in the step's `inputs` mapping, and in `forward`'s.
      per: "row" ([B, *shape], padded like `req_pool_indices`) or "token" ([T, *shape],
        padded like `input_ids`; a gather-protocol DECODE batch has T = B). Padding is 0.
      shape: the trailing shape of one row or token.
      dtype: its dtype; host arrays of another dtype are cast only where no value can
        change (numpy's 'safe' casting), else refused.
    """

    name: str
    per: str
    shape: tuple[int, ...] = ()
    dtype: Any = np.int32


class StepOutput(NamedTuple):
    """What the engine's `forward` returns to the step's tail.

    Attributes:
      new_seq_lens: [B] each row's length after this forward, published.
      payload: [B] sampled tokens (non-spec), or a DraftPayload of [B, ...] rows (spec),
        stashed at the batch's `req_pool_indices`.
      out: anything else (a pytree of arrays: the updated KV cache, the tokens for the
        host), returned to the caller as is.
    """

    new_seq_lens: Any
    payload: Any
    out: Any = None


class StepResult(NamedTuple):
    """What one call of an `EngineStep` returns.

    Attributes:
      out: `StepOutput.out` of the engine's forward.
      batch: the batch for the next step: in the sentinel protocol the invalidated batch
        (`input_ids` and `seq_lens` the sentinels `-req_pool_indices`, padded per rank to
        the batch bucket), in the gather protocol the batch as given.
    """

    out: Any
    batch: Batch | Mapping[int, Batch]


Forward = Callable[..., StepOutput]
"""(resolved, batch, inputs, *args) -> StepOutput: the engine's model and sampling."""


def _check_declared(inputs: Sequence[StepInput]) -> tuple[StepInput, ...]:
    out, seen = [], set()
    for d in inputs:
        if not isinstance(d, StepInput):
            raise FutureMapError(f"engine_step inputs must be StepInputs, got {d!r}")
        if not isinstance(d.name, str) or not d.name or d.name in seen:
            raise FutureMapError(f"engine_step input names must be distinct strings: {d.name!r}")
        if d.per not in ("row", "token"):
            raise FutureMapError(
                f"StepInput {d.name!r}: per must be 'row' or 'token', got {d.per!r}"
            )
        try:
            shape = tuple(int(n) for n in d.shape)
            dtype = np.dtype(d.dtype)
        except TypeError:
            raise FutureMapError(f"StepInput {d.name!r}: bad shape or dtype {d}") from None
        if any(n < 0 for n in shape) or jax.dtypes.canonicalize_dtype(dtype) != dtype:
            raise FutureMapError(
                f"StepInput {d.name!r}: shape {shape} and dtype {dtype} must be ones JAX keeps "
                "(float64 and int64 need x64 mode)"
            )
        seen.add(d.name)
        out.append(d._replace(shape=shape, dtype=dtype))
    return tuple(out)


class EngineStep:
    """An engine's jitted step with the FutureMap's relay inside (see the module docstring).

    Built by `FutureMap.engine_step`; call it once per batch:
    `result = step(batch, *args, inputs={...})`.
    """

    def __init__(
        self,
        fm: FutureMap,
        forward: Forward,
        *,
        inputs: Sequence[StepInput] = (),
        donate_argnums: Sequence[int] = (),
        options: Mapping[str, Any] | None = None,
    ) -> None:
        if not callable(forward):
            raise FutureMapError(f"engine_step needs a callable forward, got {forward!r}")
        donate = tuple(donate_argnums)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in donate):
            raise FutureMapError(
                f"donate_argnums must be indices >= 0 into the step's args, got {donate_argnums!r}"
            )
        self._fm = fm
        self._forward = forward
        self._declared = _check_declared(inputs)
        self._names = frozenset(d.name for d in self._declared)
        self._donate = donate
        platform = fm.layout.mesh.devices.flat[0].platform
        self._options = dict(compiler_options(platform) if options is None else options)
        self._tail = tail(fm.ops)
        self._fns: dict[tuple[str, PackSpec, int], Any] = {}
        # After warm_up(guard=True): the only executables serving may run, by key and layout.
        self._serving: dict[tuple[Key, PackSpec], Guarded] | None = None

    @property
    def inputs(self) -> tuple[StepInput, ...]:
        """The engine's declared host inputs."""
        return self._declared

    # ------------------------------------------------------------------------- the step
    def __call__(
        self,
        batch: Batch | Mapping[int, Batch],
        *args: Any,
        inputs: Mapping[str, Any] | None = None,
        rows: int | None = None,
        tokens: int | None = None,
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

        Returns:
          StepResult: the forward's `out` and the batch for the next step.
        """
        with self._fm._lock:  # one op at a time on the map (see FutureMap)
            return self._step(batch, args, inputs, rows, tokens)

    def _step(
        self,
        batch: Batch | Mapping[int, Batch],
        args: tuple[Any, ...],
        inputs: Mapping[str, Any] | None,
        rows: int | None,
        tokens: int | None,
    ) -> StepResult:
        fm = self._fm
        placed = fm._place(batch, rows, tokens)
        host = self._place_inputs(inputs, placed.idx, placed.ids)
        spec, packed, device = pack((placed.batch, host))
        exe = self._exe(_step_key(placed.key), spec, len(args))
        fm.step += 1
        try:
            out = exe(fm._state, packed, device, *args)
        except FutureMapError:
            fm.step -= 1  # refused before it ran: no step was taken
            raise
        if fm._debug is not None:
            errors, out = out
            for op, err in zip(("resolve", "finish"), errors, strict=True):
                fm._debug.record(fm.step, op, err)
            fm._resolved(placed.idx)
        fm._state, result, sentinels, lens = out
        fm._published(placed.idx, lens)
        if sentinels is None:
            return StepResult(result, batch)
        if isinstance(batch, Mapping):  # per rank: the global sentinels, like `finish`'s
            return StepResult(result, Batch(None, placed.idx.array, sentinels, sentinels))
        return StepResult(result, batch._replace(input_ids=sentinels, seq_lens=sentinels))

    def _place_inputs(
        self, given: Mapping[str, Any] | None, idx: Rows, ids: Rows | None
    ) -> dict[str, Any]:
        """The declared inputs padded like the batch's rows (`idx`) or tokens (`ids`)."""
        given = {} if given is None else given
        if not isinstance(given, Mapping):
            raise FutureMapError(
                f"inputs must be a mapping name -> array, got {type(given).__name__}"
            )
        if set(given) != self._names:
            missing, extra = sorted(self._names - set(given)), sorted(set(given) - self._names)
            raise FutureMapError(
                f"inputs must be exactly the declared StepInputs: missing {missing}, "
                f"undeclared {extra}"
            )
        fm = self._fm
        out = {}
        for d in self._declared:
            like = idx if d.per == "row" or ids is None else ids
            x, name = given[d.name], f"inputs[{d.name!r}]"
            if isinstance(x, jax.Array):
                if x.dtype != d.dtype or x.shape[1:] != d.shape:
                    raise FutureMapError(
                        f"{name} is {x.dtype}{list(x.shape)}, declared {d.dtype} rows of "
                        f"shape {list(d.shape)}"
                    )
            elif not isinstance(x, Mapping):
                x = self._host(name, x, d)
            else:
                x = {r: self._host(f"{name}[rank {r}]", v, d) for r, v in x.items()}
            out[d.name] = fm._inputs.matched(name, x, like, ints=False)
        return out

    @staticmethod
    def _host(name: str, x: Any, d: StepInput) -> np.ndarray:
        """A host input at its declared dtype and trailing shape."""
        a = host_array(name, x)
        if a.ndim < 1 or a.shape[1:] != d.shape:
            raise FutureMapError(
                f"{name} has shape {list(a.shape)}, declared rows of shape {list(d.shape)}"
            )
        if a.dtype != d.dtype:
            if not np.can_cast(a.dtype, d.dtype, "safe"):
                raise FutureMapError(
                    f"{name} has dtype {a.dtype}, which does not cast to the declared "
                    f"{d.dtype} without changing values"
                )
            a = a.astype(d.dtype)
        return a

    # ---------------------------------------------------------------------- executables
    def _exe(self, key: Key, spec: PackSpec, nargs: int) -> Any:
        """The executable for step `key` and packing layout `spec`: the jitted step
        (compiling on new shapes), or under the serving guard a warmed one only."""
        if self._serving is None:
            return self._jitted(key.name, spec, nargs)
        exe = self._serving.get((key, spec))
        if exe is None:
            fm = self._fm
            raise FutureMapError(
                f"serving guard: the engine step for {describe(key)} with these inputs was "
                f"not compiled by warm_up() (batch buckets {fm.batch_buckets}, token buckets "
                f"{fm.token_buckets}); a call would compile it: add its bucket, or pass "
                "inputs placed as warmed (host arrays, or jax arrays for every field)"
            )
        return exe

    def _jitted(self, name: str, spec: PackSpec, nargs: int) -> Any:
        """The jitted step `name` (its mode fixed, or traced)."""
        fn = self._fns.get((name, spec, nargs))
        if fn is None:
            bad = [i for i in self._donate if i >= nargs]
            if bad:
                raise FutureMapError(
                    f"donate_argnums {bad} name no argument: the step got {nargs} args"
                )
            fn = self._fns[(name, spec, nargs)] = jax.jit(
                self._body(_FIXED_MODE[name], spec),
                donate_argnums=(0, *(3 + i for i in self._donate)),
                compiler_options=self._options,
            )
        return fn

    def _body(self, fixed: ForwardMode | None, spec: PackSpec) -> Callable[..., Any]:
        """(state, packed, device leaves, *args) -> (state, out, sentinels); with debug
        ((resolve's packed error, the tail's), that)."""
        fm, forward, tail_fn = self._fm, self._forward, self._tail
        ops, debug = fm.ops, fm._debug

        def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
            if debug is None:
                return lambda *a: (None, fn(*a))
            # Each shard_map checked on its own: checkify cannot merge the errors of
            # consecutive shard_maps (see `entry_points.tail`).
            return debug.checked(fn)

        def body(state: Any, packed: Any, device: Any, *args: Any) -> Any:
            batch, inputs = unpack(spec, packed, device)
            if fixed is not None:
                batch = batch._replace(forward_mode=int(fixed))
            e_head, (state, res) = checked(ops.resolve)(state, batch)
            got = forward(res, batch, inputs, *args)
            if not isinstance(got, StepOutput):
                raise FutureMapError(
                    f"the engine's forward must return a StepOutput, got {type(got).__name__}"
                )
            idx = batch.req_pool_indices
            e_tail, (state, sentinels) = checked(tail_fn)(state, idx, got.new_seq_lens, got.payload)
            # The published lengths leave the step only when the host reads them.
            lens = None if fm._host_lengths is None else jnp.asarray(got.new_seq_lens, fm.dtype)
            out = (state, got.out, sentinels, lens)
            return out if debug is None else ((e_head, e_tail), out)

        return body

    # -------------------------------------------------------------------------- warm-up
    def warm_up(
        self, *args: Any, guard: bool = False, traced_modes: bool = True, threads: int | None = None
    ) -> WarmUpReport:
        """Compile the step for every bucket serving reaches, ahead of time.

        The plan is resolve's (`FutureMap.warm_up`): per token bucket and mode (fixed not
        DECODE, fixed DECODE, traced), with and without a draft on a spec map, with token
        slots in the gather protocol; each with the declared inputs and host arrays
        placed and packed as serving places them. Nothing runs and nothing is donated.

        Args:
          *args: the engine's arguments as serving passes them (only their shapes,
            dtypes and shardings are read).
          guard: afterwards, serve only the warmed executables: a call that would compile
            raises FutureMapError before anything runs.
          traced_modes: also warm a traced forward mode (see `FutureMap.warm_up`).
          threads: compile threads; default min(8, CPU count).
        """
        with self._fm._lock:
            return self._warm_up(args, guard, traced_modes, threads)

    def _warm_up(
        self, args: tuple[Any, ...], guard: bool, traced_modes: bool, threads: int | None
    ) -> WarmUpReport:
        t0 = time.perf_counter()
        fm = self._fm
        inputs = fm._inputs
        resolves = plan(
            fm._fns,
            inputs,
            fm._state,
            fm.spec,
            debug=fm.debug,
            traced_modes=traced_modes,
            protocol=fm.protocol,
        )
        planned: list[Planned] = []
        specs: list[PackSpec] = []
        dp = fm.layout.dp
        for p in resolves:
            key = _step_key(p.key)
            if key.name not in _FIXED_MODE:
                continue  # a tail op's key
            name, b, t = key.name, key.rows, key.tokens
            batch = p.args[1]
            row = inputs.slots("warm-up slots", np.zeros(dp * b, fm.dtype), b)
            like = {
                "row": row,
                "token": row  # a gather DECODE places no ids: T = B
                if batch.input_ids is None
                else inputs.token_ids("warm-up tokens", np.zeros(dp * t, fm.dtype), t),
            }
            host = {
                d.name: inputs.matched(
                    d.name,
                    np.zeros((dp * like[d.per].size, *d.shape), d.dtype),
                    like[d.per],
                    ints=False,
                )
                for d in self._declared
            }
            spec, packed, device = pack((batch, host))
            fn = self._jitted(name, spec, len(args))
            planned.append(Planned(key, fn, (fm._state, packed, device, *args)))
            specs.append(spec)
        with counting_compiles() as counter:
            compiled = compile_plan(planned, threads)
        summary = report(planned, counter, time.perf_counter() - t0)
        if guard:
            self._serving = {
                (p.key, spec): Guarded(c, p.key)
                for p, spec, c in zip(planned, specs, compiled, strict=True)
            }
        else:
            self._serving = None
        return summary
