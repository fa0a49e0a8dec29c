"""The executables a FutureMap serves, one per bucket, compiled ahead of time.

A plan lists every (entry point, per-rank sizes) that serving reaches for a map's buckets:
the tail ops (publish, stash, finish, the sentinels, and `seq_lens_at` on a spec map) once
per batch bucket; resolve once per token bucket and mode (the token bucket fixes its rows,
`buckets.resolve_sizes`), twice on a spec map (with and without a draft), and in the gather
protocol also with a MIXED batch's token slots (and without the sentinels). So the count
grows with the sum of the buckets, not their product. Each is traced and lowered (no
argument is read or donated) and compiled on a thread pool: XLA's compile releases the
GIL, tracing and lowering do not. The arguments are placed as serving's host inputs are,
so a compiled plan fills the jit's own cache and the serving calls that follow find their
executables there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from jax import monitoring

from fm_jax._src.buckets import resolve_sizes
from fm_jax._src.errors import FutureMapError
from fm_jax._src.host_inputs import HostInputs, Rows
from fm_jax._src.packing import PackSpec
from fm_jax._src.relay_fields import element_dtype
from fm_jax._src.types import Batch, FutureMapState, SpecConfig, draft_payload, relay_protocol


class Key(NamedTuple):
    """Which executable serves a call: an entry point (`FutureMap.executables()` name) and
    the static per-rank sizes and inputs it was traced for. The class, its engine step,
    warm-up and the serving guard all key executables by it, so a call finds what warm-up
    compiled for it by construction.

    Attributes:
      name: the entry point's name.
      rows: rows per rank (a batch bucket).
      tokens: tokens per rank (a resolve's or a step's token bucket); 0 for an op that
        takes no token ids.
      draft: a resolve with draft indices.
      slots: a resolve with token slots.
    """

    name: str
    rows: int
    tokens: int = 0
    draft: bool = False
    slots: bool = False


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compile or a cache load
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # a load from the persistent cache


@dataclass(frozen=True)
class WarmUpReport:
    """What `FutureMap.warm_up` compiled.

    Attributes:
      executables: entry-point executables made ready (by name: `by_op`).
      compiled: XLA compiles seen during warm-up.
      from_cache: executables loaded from JAX's persistent compilation cache instead.
      seconds: wall time of the warm-up.
      by_op: executables per entry point name (as in `FutureMap.executables()`; those fed
        one packed host buffer as "name (packed)").
    """

    executables: int
    compiled: int
    from_cache: int
    seconds: float
    by_op: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        return (
            f"fm_jax warm-up: {self.executables} executables in {self.seconds:.2f} s "
            f"({self.compiled} compiled, {self.from_cache} from the persistent cache)"
        )


class Planned(NamedTuple):
    """One executable to make ready: its key, its jitted entry point, its arguments, and
    for one that takes its host arguments as one packed buffer, their layout."""

    key: Key
    fn: Any
    args: tuple[Any, ...]
    packed: PackSpec | None = None


def plan(
    fns: dict[str, Any],
    inputs: HostInputs,
    state: FutureMapState,
    spec: SpecConfig | None,
    *,
    debug: bool,
    traced_modes: bool,
    protocol: str = "sentinel",
) -> list[Planned]:
    """Every executable serving reaches for the map's buckets, with its arguments: zeros
    placed by `inputs` exactly as serving's host inputs are (so with their shardings).

    Args:
      fns: the map's entry points by name (`FutureMap.executables()`).
      inputs: the map's input placement (its layout, int dtype and buckets).
      state: the map's state (read for its types only).
      spec: the map's spec shapes, or None.
      debug: a debug map (its tail ops also serve unchecked, for slots already checked).
      traced_modes: also resolve with a traced forward mode (one per rank on a mesh).
      protocol: the map's protocol ('gather': no sentinels; MIXED resolves take slots).
    """
    dp, dt = inputs.dp, inputs.dtype
    batch_buckets, token_buckets = inputs.batch_buckets, inputs.token_buckets
    relay = relay_protocol(protocol)

    def rows(like: Rows, *tail: int, dtype: Any = dt) -> Any:
        zeros = np.zeros((dp * like.size, *tail), dtype)
        return inputs.matched("warm-up rows", zeros, like, ints=dtype is dt)

    def payload(idx: Rows) -> Any:
        if spec is None:
            return rows(idx)
        return draft_payload(
            {f.name: rows(idx, *f.shape, dtype=element_dtype(f, dt)) for f in spec.fields()}
        )

    out: list[Planned] = []
    tails = ["publish", "stash", "finish"]
    prefixes = ["", "unchecked_"] if debug else [""]
    for b in batch_buckets:
        idx = inputs.slots("warm-up slots", np.zeros(dp * b, dt), b)
        args = {
            "publish": (idx.array, rows(idx)),
            "stash": (idx.array, payload(idx)),
            "finish": (idx.array, rows(idx), payload(idx)),
        }
        for prefix in prefixes:
            for name in tails:
                out.append(Planned(Key(prefix + name, b), fns[prefix + name], (state, *args[name])))
        if relay.invalidates:
            for prefix in prefixes:
                name = prefix + "sentinels"
                out.append(Planned(Key(name, b), fns[name], (idx.array,)))
        else:  # a gather DECODE places no ids (spec: with its draft): one per batch bucket
            draft = None if spec is None else idx.array
            batch = Batch(None, idx.array, None, rows(idx), draft)
            key = Key("resolve_fixed_decode", b, b, draft is not None)
            out.append(Planned(key, fns["resolve_fixed_decode"], (state, batch)))
        if spec is not None:  # resolve_seq_lens_cpu is a spec step's op
            out.append(Planned(Key("seq_lens_at", b), fns["seq_lens_at"], (state, idx.array)))

    traced = np.zeros((dp,) if dp > 1 else (), np.int32)
    largest = batch_buckets[-1]
    _, decode_tokens = resolve_sizes(largest, largest, batch_buckets, token_buckets)
    # The (rows, tokens) pairs serving reaches: one per token bucket that is a pair's own
    # (a token bucket the batch buckets skip past pairs with the next one's rows).
    pairs = dict.fromkeys(resolve_sizes(0, t, batch_buckets, token_buckets) for t in token_buckets)
    for b, t in pairs:
        idx = inputs.slots("warm-up slots", np.zeros(dp * b, dt), b)
        placed = inputs.token_ids("warm-up tokens", np.zeros(dp * t, dt), t)
        ids = placed.array
        modes: list[tuple[str, Any]] = [("resolve_fixed_extend", None)]
        # A non-spec decode row is one token; a gather DECODE has its own plan (above).
        if spec is not None or (t <= decode_tokens and not relay.gathers_decode_ids):
            modes.append(("resolve_fixed_decode", None))
        if traced_modes:
            modes.append(("resolve", traced))
        slot_lists: list[Rows | None] = [None]
        if relay.takes_token_slots:  # a MIXED batch (not DECODE, or traced) brings them
            slot_lists.append(inputs.token_slots("warm-up slots", np.zeros(dp * t, dt), placed))
        for draft in [None, idx.array] if spec is not None else [None]:
            for name, mode in modes:
                for slots in slot_lists:
                    if slots is not None and name == "resolve_fixed_decode":
                        continue
                    arr = None if slots is None else slots.array
                    batch = Batch(mode, idx.array, ids, rows(idx), draft, arr)
                    key = Key(name, b, t, draft is not None, slots is not None)
                    out.append(Planned(key, fns[name], (state, batch)))
    return out


def compile_plan(planned: list[Planned], threads: int | None = None) -> list[Any]:
    """Lower each planned executable, compile them on `threads` threads; in plan order."""
    lowered = [p.fn.trace(*p.args).lower() for p in planned]
    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda lo: lo.compile(), lowered))


class _Counter:
    """Counts compile events (compiles and persistent-cache loads) while registered."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executables = 0
        self.cache_hits = 0

    def duration(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == _COMPILE_EVENT:
            with self.lock:
                self.executables += 1

    def event(self, event: str, **kwargs: str | int) -> None:
        if event == _CACHE_HIT_EVENT:
            with self.lock:
                self.cache_hits += 1


@contextmanager
def counting_compiles() -> Iterator[_Counter]:
    """Count the process's compiles and cache loads inside the block (every thread's)."""
    counter = _Counter()
    monitoring.register_event_duration_secs_listener(counter.duration)
    monitoring.register_event_listener(counter.event)
    try:
        yield counter
    finally:
        monitoring.unregister_event_duration_listener(counter.duration)
        monitoring.unregister_event_listener(counter.event)


def report(planned: list[Planned], counter: _Counter, seconds: float) -> WarmUpReport:
    """The summary of a compiled plan."""
    by_op: dict[str, int] = {}
    for p in planned:
        name = p.key.name if p.packed is None else f"{p.key.name} (packed)"
        by_op[name] = by_op.get(name, 0) + 1
    return WarmUpReport(
        executables=len(planned),
        compiled=counter.executables - counter.cache_hits,
        from_cache=counter.cache_hits,
        seconds=seconds,
        by_op=by_op,
    )


class Guarded:
    """A compiled executable that refuses, instead of compiling, arguments it was not built
    for (a shape, dtype or sharding serving did not warm)."""

    __slots__ = ("compiled", "key")

    def __init__(self, compiled: Any, key: Key) -> None:
        self.compiled = compiled
        self.key = key

    def __call__(self, *args: Any) -> Any:
        try:
            return self.compiled(*args)
        except (TypeError, ValueError) as e:  # raised while matching arguments (a shape,
            # a dtype, a device or sharding it was not built for): nothing ran
            raise FutureMapError(
                f"serving guard: {describe(self.key)} was warmed for other arguments and would "
                f"compile again: {e}"
            ) from None


def describe(key: Key) -> str:
    """`key` in words: the op and its per-rank sizes."""
    if not key.tokens:
        return f"{key.name} at {key.rows} rows per rank"
    return (
        f"{key.name} at {key.rows} rows x {key.tokens} tokens per rank"
        f"{' with a draft' if key.draft else ''}{' with token slots' if key.slots else ''}"
    )
