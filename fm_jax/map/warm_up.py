"""Warm-up: every call serving reaches for a map's buckets, as calls of zeros placed through
the map's placement (so the keys warmed are serving's), compiled on threads (XLA releases
the GIL). The count grows with the sum of the buckets, not their product: the tail ops
once per batch bucket, resolve once per token bucket and variant."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring

from fm_jax.host.buckets import decode_ids, resolve_sizes
from fm_jax.host.decisions import FIXED_MODES, Key, PackSpec
from fm_jax.host.host_inputs import HostInputs
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import Protocol
from fm_jax.ops.relay_fields import draft_payload, element_dtype
from fm_jax.ops.types import Batch, ForwardMode, SpecConfig

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compile or a cache load
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # a load from the persistent cache


@dataclass(frozen=True)
class WarmUpReport:
    """What a warm-up made ready: `executables` (per name, as in `FutureMap.executables()`:
    `by_op`), of which `compiled` by XLA and `from_cache` loaded from JAX's persistent
    compilation cache, in `seconds` of wall time."""

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


def not_warmed(batch_buckets: tuple[int, ...], token_buckets: tuple[int, ...]) -> Any:
    """The class's serving guard's words for a key warm-up did not make."""
    return lambda key: (
        f"serving guard: {key.describe()} was not compiled by warm_up() (batch buckets "
        f"{batch_buckets}, token buckets {token_buckets}); a call would "
        "compile it: add its bucket, or pass inputs padded to a warmed one"
    )


Call = tuple[Key, PackSpec | None, tuple[Any, ...], int]
"""A call to warm: key, packing layout, every argument, how many are an engine step's."""


def warm(
    registry: Any,
    calls: Sequence[Call],
    *,
    guard: bool,
    threads: int | None,
    build: Any = None,
    refusal: Callable[[Key], str] | None = None,
) -> WarmUpReport:
    """Compile `calls` for `registry`'s owner `build` (None: the class); nothing runs.
    With `guard`, that owner is served only them afterwards (`refusal`: the guard's words)."""
    t0 = time.perf_counter()
    # One executable per key and packing layout (calls that place alike compile once).
    unique: dict[tuple[Key, PackSpec | None], Call] = {}
    for call in calls:
        unique.setdefault((call[0], call[1]), call)
    calls = list(unique.values())
    lowered = [
        registry.jitted(k, pack, n, build).trace(*args).lower() for k, pack, args, n in calls
    ]
    workers = threads or min(8, os.cpu_count() or 1)
    with _counting_compiles() as counts, ThreadPoolExecutor(max_workers=workers) as pool:
        compiled = list(pool.map(lambda lo: lo.compile(), lowered))
    warmed = {(key, pack): c for (key, pack, _, _), c in zip(calls, compiled, strict=True)}
    registry.serve(build, warmed if guard else None, refusal)
    return WarmUpReport(
        executables=len(calls),
        compiled=counts[_COMPILE_EVENT] - counts[_CACHE_HIT_EVENT],
        from_cache=counts[_CACHE_HIT_EVENT],
        seconds=time.perf_counter() - t0,
        by_op=dict(Counter(key.name for key, *_ in calls)),
    )


@contextmanager
def _counting_compiles() -> Iterator[dict[str, int]]:
    """Count the process's compiles and persistent-cache loads inside the block."""
    counts = dict.fromkeys((_COMPILE_EVENT, _CACHE_HIT_EVENT), 0)
    lock = threading.Lock()

    def seen(event: str, *args: Any, **kwargs: Any) -> None:
        if event in counts:
            with lock:
                counts[event] += 1

    monitoring.register_event_duration_secs_listener(seen)
    monitoring.register_event_listener(seen)
    try:
        yield counts
    finally:
        monitoring.unregister_event_duration_listener(seen)
        monitoring.unregister_event_listener(seen)


def empty_batches(
    inputs: HostInputs,
    protocol: Protocol,
    spec: SpecConfig | None,
    *,
    traced_modes: bool,
    step: bool = False,
) -> Iterator[tuple[Batch, int, int]]:
    """Every resolve serving reaches, as (batch of zeros, per-rank rows, tokens): per token
    bucket and resolve variant, with and without a draft on a spec map; a DECODE that
    places no ids per batch bucket. `step`: an engine step's, whose executables fix each
    mode that is not DECODE, not its kind (`Protocol.step_modes`)."""
    dp, dt = inputs.dp, inputs.dtype
    batch_buckets, token_buckets = inputs.batch_buckets, inputs.token_buckets
    drafts = [False, True] if spec is not None else [False]
    if protocol.gathers_decode_ids:
        for b in batch_buckets:
            zeros = np.zeros(dp * b, dt)
            draft = zeros if spec is not None else None
            yield Batch(ForwardMode.DECODE, zeros, None, zeros, draft), b, b
    largest = batch_buckets[-1]
    _, decode_tokens = resolve_sizes(largest, largest, batch_buckets, token_buckets)
    traced = jnp.zeros((dp,) if dp > 1 else (), jnp.int32)
    # The (rows, tokens) pairs serving reaches: one per token bucket.
    pairs = dict.fromkeys(resolve_sizes(0, t, batch_buckets, token_buckets) for t in token_buckets)
    for b, t in pairs:
        rows, toks = np.zeros(dp * b, dt), np.zeros(dp * t, dt)
        for with_draft in drafts:
            for mode, with_slots in protocol.resolve_variants(spec, t, decode_tokens, traced_modes):
                # A non-spec decode row carries one id: b ids, padded to the t bucket.
                ids = rows if mode == "decode" and spec is None else toks
                kinds: list[Any] = [traced if mode == "traced" else FIXED_MODES[mode]]
                if mode == "extend":
                    kinds = (
                        list(protocol.step_modes(spec, with_slots))
                        if step
                        else [ForwardMode.MIXED if with_slots else ForwardMode.EXTEND]
                    )
                draft, slots = rows if with_draft else None, toks if with_slots else None
                for kind in kinds:
                    yield Batch(kind, rows, ids, rows, draft, slots), b, t
                if mode == "traced" and dp > 1:
                    # Ranks of different kinds, on the host: the same executable, modes fed.
                    per_rank = np.full(dp, ForwardMode.MIXED if with_slots else ForwardMode.EXTEND)
                    per_rank[0] = ForwardMode.DECODE
                    modes = per_rank.astype(np.int32)
                    yield Batch(modes, rows, rows, rows, draft, rows if with_slots else None), b, t


def step_calls(
    placement: Any, declared: Any, state: Any, args: tuple, traced_modes: bool, decided: Any
) -> list[Any]:
    """An engine step's warm-up calls: every resolve with zeros for the `declared` inputs
    (a batch that places no ids has T = B), as host arrays and, in one process, jax arrays
    (ids of one per row padded to the token bucket of the rows, as a step's sentinels give
    them); each layout remembered in the step's own `decided`, as its serving calls are."""
    inputs = placement.inputs
    dp, sharding = inputs.dp, inputs.layout.sharding
    calls = []
    for batch, b, t in empty_batches(
        inputs, placement.protocol, placement.spec, traced_modes=traced_modes, step=True
    ):
        per = {"row": b, "token": b if batch.input_ids is None else t}
        zeros = {d.name: np.zeros((dp * per[d.per], *d.shape), d.dtype) for d in declared}
        fed: list[tuple[Batch, Any, int | None, int | None]] = [(batch, zeros, b, t)]
        if inputs.layout.single_process:  # jax arrays as they are: their own sizes
            ids = batch.input_ids
            if ids is not None and len(ids) == dp * b:  # one id per row: a DECODE (rank)
                ids = np.zeros(dp * decode_ids(b, inputs.token_buckets), inputs.dtype)
            on_device = jax.tree_util.tree_map(
                lambda x: jax.device_put(x, sharding) if isinstance(x, np.ndarray) else x,
                (batch._replace(input_ids=ids), zeros),
            )
            fed.append((*on_device, None, None))
        for fed_batch, given, rows, tokens in fed:
            p = placement.resolve(
                fed_batch, rows, tokens, step=declared, inputs=given, decided=decided
            )
            calls.append((p.key, p.pack, (state, *p.args, *args), len(args)))
    return calls


def class_calls(
    placement: Any, state: Any, traced_modes: bool, partial: Sequence[Collection[str]]
) -> list[Any]:
    """The class's warm-up calls: per batch bucket publish, stash and finish (with
    confidence rows; stash and finish per partial stash), the sentinels of device slots
    and, spec, `seq_lens_at`; then every resolve (`empty_batches`)."""
    inputs, protocol, spec = placement.inputs, placement.protocol, placement.spec
    if not _names_per_stash(partial):
        raise FutureMapError(
            "partial_stashes must be a sequence of field-name collections (e.g. "
            f"[('bonus_tokens',)]; () for none), got {partial!r}"
        )
    if partial and spec is None:
        raise FutureMapError("partial_stashes: a map without spec stashes tokens only")
    dp, dt, tail = inputs.dp, inputs.dtype, placement.tail
    placed = []
    for b in inputs.batch_buckets:
        zeros = np.zeros(dp * b, dt)
        conf = None
        placed.append(tail("publish", zeros, zeros, None, b))
        if spec is not None and spec.confidence:
            conf = np.zeros((dp * b, spec.confidence), np.float32)
            placed.append(tail("publish", zeros, zeros, None, b, confidence=conf))
        for names in (None, *partial):  # every field, then each partial stash's
            draft = zeros if spec is None else _empty_draft(dp * b, spec, dt, names)
            placed += [tail("stash", zeros, None, draft, b), tail("finish", zeros, zeros, draft, b)]
            if conf is not None:
                placed.append(tail("finish", zeros, zeros, draft, b, confidence=conf))
        if protocol.invalidates:  # invalidate of device slots
            placed.append(placement.slots_op("sentinels", zeros, b))
        if spec is not None:  # resolve_seq_lens_cpu is a spec step's op
            placed.append(placement.slots_op("seq_lens_at", zeros, b))
    for batch, b, t in empty_batches(inputs, protocol, spec, traced_modes=traced_modes):
        placed.append(placement.resolve(batch, b, t))
    return [(p.key, None, (state, *p.args), 0) for p in placed]


def _names_per_stash(partial: Any) -> bool:
    """Whether `partial` is a sequence of collections of field names (no bare strings)."""
    if isinstance(partial, str | bytes) or not isinstance(partial, Sequence):
        return False
    return all(
        isinstance(names, Collection)
        and not isinstance(names, str | bytes)
        and all(isinstance(n, str) for n in names)
        for names in partial
    )


def _empty_draft(
    n: int, spec: SpecConfig, dt: np.dtype, names: Collection[str] | None = None
) -> Any:
    """A draft of zeros giving the fields `names` (None: every declared field); a name the
    spec does not declare is given too, for placement to refuse by name."""
    fields = {f.name: f for f in spec.fields()}
    given = fields if names is None else names
    out: dict[str, Any] = {}
    for name in given:
        f = fields.get(name)
        out[name] = np.zeros(n, dt) if f is None else np.zeros((n, *f.shape), element_dtype(f, dt))
    return draft_payload(out)
