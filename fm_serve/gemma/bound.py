"""The machine's bound on a decode step of Gemma 3: its weights read once at the measured
memory bandwidth, or its FLOPs at the measured matmul rate, whichever takes longer.

`fm-serve-bench --bound` sets each batch size's tokens/s beside `B / bound step`, so the
loop's own overhead shows (host work, the dispatch, and what the model's layout adds: with
`--row-tile` t every matmul runs on tiles of t rows, each tile reading the weights again,
so a step of T tokens reads them about T / t times).

- Weight read: one jitted pass summing every parameter (each byte read once), the median
  of 5; the bandwidth is the parameters' bytes over that time.
- Matmul rate: a 1024 x 1024 by 1024 x 1024 product in the model's dtype, the median of 5.
- A decode step's FLOPs: 2 per matmul weight per token (the blocks' projections and the
  tied output layer, the embedding read once as it); attention over the cache (under 2% at
  128 positions) and the norms are left out.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _median_s(fn: Any, *args: Any, repeats: int = 5) -> float:
    """The median wall time of `fn(*args)` waited for, after one untimed call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_weights(params: Any) -> int:
    """Weights a decode token multiplies: the blocks' projections (stacked over layers,
    3-D) and the embedding as the tied output layer."""
    blocks = sum(int(x.size) for x in jax.tree_util.tree_leaves(params.blocks) if x.ndim == 3)
    return blocks + int(params.embed.size)


def machine_rates(params: Any) -> dict[str, float]:
    """The measured weight-read time, memory bandwidth and matmul rate, and the model's
    bytes and matmul weights."""
    leaves = jax.tree_util.tree_leaves(params)
    nbytes = sum(int(x.nbytes) for x in leaves)
    read = jax.jit(lambda ps: sum(jnp.sum(x, dtype=jnp.float32) for x in ps))
    read_s = _median_s(read, leaves)
    dtype = params.embed.dtype
    a = jnp.asarray(np.random.default_rng(0).standard_normal((1024, 1024)), dtype)
    mm_s = _median_s(jax.jit(jnp.dot), a, a)
    return {
        "weight_bytes": float(nbytes),
        "weight_read_ms": 1e3 * read_s,
        "bandwidth_gb_s": nbytes / read_s / 1e9,
        "matmul_gflop_s": 2 * 1024**3 / mm_s / 1e9,
        "matmul_weights": float(matmul_weights(params)),
    }


def decode_bound(rates: dict[str, float], batch: int) -> dict[str, Any]:
    """A decode step of `batch` rows at the machine's bound: its time (ms) and tokens/s,
    and which roof sets it ('memory' or 'compute')."""
    read_ms = rates["weight_read_ms"]
    compute_ms = 1e3 * 2 * rates["matmul_weights"] * batch / (rates["matmul_gflop_s"] * 1e9)
    step_ms = max(read_ms, compute_ms)
    return {
        "step_ms": step_ms,
        "tok_s": 1e3 * batch / step_ms,
        "compute_ms": compute_ms,
        "roof": "memory" if read_ms >= compute_ms else "compute",
    }
