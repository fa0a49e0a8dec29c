"""XLA compiler options for executables that run FutureMap ops.

XLA:CPU's parallel task assigner splits an elementwise-like instruction over up to
sqrt(cores) threads once the bytes it may touch pass 256 KB. For a gather or scatter that
is the whole pool buffer, although the op moves only batch-sized rows: from R ~ 64K slots
(int32) on, every FutureMap gather and scatter becomes a hand-off to a pool thread and
back, which costs more than the op (measured ~20-40 us per op here, a step's cost then
growing with R instead of B). The ops are O(B) work: they run best on the calling thread.
"""

from __future__ import annotations

import os
import re

import jax
from jax.experimental.compilation_cache import compilation_cache

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
