"""Executables: the registry (key -> executable, the only place that compiles), its
warm-up and serving guard, and the XLA options they are compiled with.

A registry serves one family of executables (a map's entry points, or one engine step's):
`executable(key, pack)` is the jitted function of the key's family (jit compiles it on a
new shape), or, after `warm_up(guard=True)`, the executable warm-up compiled for exactly
that key and packing layout; a call that would compile is then refused by name before
anything runs. Warm-up compiles the calls placement made of empty batches at every bucket
(so the keys serving reaches are the keys warmed, by construction) on a thread pool: XLA's
compile releases the GIL, tracing and lowering do not.

Compiler options (`compiler_options`). XLA:CPU's parallel task assigner splits an
elementwise-like instruction over up to sqrt(cores) threads once the bytes it may touch
pass 256 KB. For a gather or scatter that is the whole pool buffer, although the op moves
only batch-sized rows: from R ~ 64K slots (int32) on, every FutureMap gather and scatter
becomes a hand-off to a pool thread and back, which costs more than the op (~20-40 us per
op on the 2-core CI VM, a step's cost then growing with R instead of B). The ops are O(B)
work: on CPU they run on the calling thread.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import jax
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

from fm_jax.host.decisions import Key
from fm_jax.host.pack import PackSpec
from fm_jax.ops.errors import FutureMapError

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compile or a cache load
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # a load from the persistent cache


@dataclass(frozen=True)
class WarmUpReport:
    """What a warm-up compiled.

    Attributes:
      executables: executables made ready (by name: `by_op`).
      compiled: XLA compiles seen during warm-up.
      from_cache: executables loaded from JAX's persistent compilation cache instead.
      seconds: wall time of the warm-up.
      by_op: executables per name (as in `FutureMap.executables()`).
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
                f"serving guard: {self.key.describe()} was warmed for other arguments and "
                f"would compile again: {e}"
            ) from None


Call = tuple[Key, PackSpec | None, tuple[Any, ...], int]
"""A call to warm: its key, packing layout, full arguments (state first) and how many of
them are the caller's own (an engine step's)."""


class Registry:
    """Executables by key, for one family.

    Args:
      build: (key, pack, nargs) -> the jitted function serving the key's family (its op,
        mode and checks) fed as `pack` lays out (None: placed arrays), taking `nargs`
        arguments of the caller's own after those (an engine step's); once per family.
      refusal: key -> the serving guard's message for a key warm-up did not compile.
    """

    def __init__(
        self, build: Callable[[Key, PackSpec | None, int], Any], refusal: Callable[[Key], str]
    ) -> None:
        self._build = build
        self._refusal = refusal
        self._jitted: dict[tuple[Any, ...], Any] = {}
        self._serving: dict[tuple[Key, PackSpec | None], Guarded] | None = None

    @property
    def guarded(self) -> bool:
        """Serving runs only warmed executables."""
        return self._serving is not None

    def jitted(self, key: Key, pack: PackSpec | None = None, nargs: int = 0) -> Any:
        """The jitted function of `key`'s family (built on first use)."""
        family = (key.op, key.mode, key.checked, key.confidence, nargs, pack)
        fn = self._jitted.get(family)
        if fn is None:
            fn = self._jitted[family] = self._build(key, pack, nargs)
        return fn

    def executable(self, key: Key, pack: PackSpec | None, nargs: int = 0) -> Any:
        """What serves `key` fed as `pack` lays out: the jitted function, or under the
        serving guard the warmed executable (FutureMapError if there is none; one
        warmed for another number of arguments refuses them when called)."""
        if self._serving is None:
            return self.jitted(key, pack, nargs)
        exe = self._serving.get((key, pack))
        if exe is None:
            raise FutureMapError(self._refusal(key))
        return exe

    def warm_up(self, calls: Sequence[Call], *, guard: bool, threads: int | None) -> WarmUpReport:
        """Compile `calls` (nothing runs, nothing is donated); with `guard`, serve only
        them afterwards. Returns what was compiled."""
        t0 = time.perf_counter()
        # One executable per key and packing layout (calls that place alike compile once).
        unique: dict[tuple[Key, PackSpec | None], Call] = {}
        for call in calls:
            unique.setdefault((call[0], call[1]), call)
        calls = list(unique.values())
        lowered = [self.jitted(k, pack, n).trace(*args).lower() for k, pack, args, n in calls]
        workers = threads or min(8, os.cpu_count() or 1)
        with counting_compiles() as counter, ThreadPoolExecutor(max_workers=workers) as pool:
            compiled = list(pool.map(lambda lo: lo.compile(), lowered))
        by_op: dict[str, int] = {}
        for key, _, _, _ in calls:
            by_op[key.name] = by_op.get(key.name, 0) + 1
        self._serving = None
        if guard:
            self._serving = {
                (key, pack): Guarded(c, key)
                for (key, pack, _, _), c in zip(calls, compiled, strict=True)
            }
        return WarmUpReport(
            executables=len(calls),
            compiled=counter.executables - counter.cache_hits,
            from_cache=counter.cache_hits,
            seconds=time.perf_counter() - t0,
            by_op=by_op,
        )


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


CPU_PARALLEL_TASK_PASS = "cpu-parallel-task-assigner"
"""The XLA:CPU pass that splits instructions over threads (by bytes, not by work)."""

_FLAG = "xla_disable_hlo_passes"


def _passes_disabled_by_env() -> list[str]:
    """Passes already disabled through XLA_FLAGS (kept: compiler options replace the list)."""
    got = re.findall(rf"--{_FLAG}=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return [p for v in got for p in v.split(",") if p]


def compiler_options(platform: str | None = None) -> dict[str, str]:
    """XLA options for jitting a step that runs FutureMap ops on `platform`.

    On CPU: the parallel task assigner disabled (see the module docstring), and any passes
    XLA_FLAGS already disables kept disabled. Elsewhere: no options. Engines that inline
    the pure ops pass these to their own jit: `jax.jit(step, compiler_options=...)`; note
    that on CPU this also keeps the step's other elementwise ops on one thread.

    Args:
      platform: "cpu", "gpu", "tpu", ...; default JAX's default backend.
    """
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return {}
    passes = list(dict.fromkeys([*_passes_disabled_by_env(), CPU_PARALLEL_TASK_PASS]))
    return {_FLAG: ",".join(passes)}


def use_persistent_cache(path: str | os.PathLike[str], *, min_compile_seconds: float = 0.0) -> None:
    """Turn on JAX's persistent compilation cache in directory `path`, for this process.

    A process started later with the same call loads the executables it finds there
    instead of compiling them (`FutureMap.warm_up` reports how many). JAX's own default
    writes only compiles that took at least a second, which no FutureMap executable does
    (each takes ~20-80 ms on CPU), so this writes every compile at or over
    `min_compile_seconds` (0: all, the setting sglang-jax serves with). Process-wide: it
    applies to the engine's other compiles too. Call it before the first compile.

    Args:
      path: the cache directory (created if missing); trusted: whoever can write it can
        change what this process runs.
      min_compile_seconds: compiles faster than this are not written.
    """
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.fspath(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    # JAX decides once per process whether the cache is used: decide again with it on.
    compilation_cache.reset_cache()
