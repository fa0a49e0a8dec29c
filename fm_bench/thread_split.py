"""What `fm_jax.compiler_options()` buys on CPU: one engine step with the FutureMap ops, jitted
with XLA's default options and with fm_jax's, side by side over pool sizes R.

The step is fm-bench's workload (B distinct random live slots) through the pure ops: resolve
(DECODE, traced mode), then publish and stash of values computed from what was resolved, then
invalidate; the state is donated. XLA:CPU's parallel task assigner splits a gather or scatter
over threads once its buffer passes 256 KB, so by default the cost steps up with R; with the
options it should stay flat. Every series is interleaved round by round (fm_bench.timing).

Run: `python -m fm_bench.thread_split [--batch 256] [--pools 4096,65536,262144,1048576]`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import jax

import fm_jax as fj
from fm_bench.impls.jax_common import device_data
from fm_bench.inplace import THREAD_SPLIT
from fm_bench.timing import Series, measure_group
from fm_bench.workload import Config, host_data


def engine_step(ops: fj.FutureMapOps) -> Any:
    """A minimal engine step around `ops`: resolve, publish and stash of values computed
    from what was resolved, invalidate. (state, batch) -> (state, next batch)."""

    def step(state: fj.FutureMapState, batch: fj.Batch) -> Any:
        state, res = ops.resolve(state, batch)
        idx = batch.req_pool_indices
        # Written values depend on what was read, as a model's outputs do.
        state = ops.publish(state, idx, res.seq_lens + 1)
        state = ops.stash(state, idx, res.input_ids + 1)
        return state, ops.invalidate(batch, idx)

    return step


def build(cfg: Config, name: str, options: dict[str, str]) -> tuple[Series, int]:
    """A timed step for `cfg` compiled with `options` (keyed `(name, pool)`), and its count
    of thread splits."""
    dd = device_data(cfg, host_data(cfg))
    ops = fj.future_map(cfg.pool)
    step = jax.jit(engine_step(ops), donate_argnums=(0,), compiler_options=options)
    idx = dd.idx
    state = ops.stash(ops.publish(ops.init(), idx, dd.lens), idx, dd.tokens)
    batch = fj.Batch(dd.decode_mode, idx, -idx, -idx)
    splits = (step.lower(state, batch).compile().as_text() or "").count(THREAD_SPLIT)
    box: dict[str, Any] = {"state": state, "batch": batch}

    def run() -> None:
        box["state"], box["batch"] = step(box["state"], box["batch"])
        jax.block_until_ready((box["state"], box["batch"].input_ids))

    return Series((name, cfg.pool), run), splits


def measure(batch: int, pools: Sequence[int], reps: int) -> list[dict[str, Any]]:
    """Per pool: median µs with default options and with fm_jax's, and their thread splits
    (off CPU fm_jax's options are XLA's defaults: both series then run the same options)."""
    options = fj.compiler_options(jax.devices()[0].platform)
    series, splits = [], {}
    for pool in pools:
        for name, opts in (("default", {}), ("fm_jax", options)):
            s, n = build(Config(batch, pool), name, opts)
            series.append(s)
            splits[s.key] = n
    stats = measure_group(series, reps=reps, warmup=10)
    return [
        {
            "pool": pool,
            "default_us": stats[("default", pool)].median_us,
            "fm_jax_us": stats[("fm_jax", pool)].median_us,
            "default_splits": splits[("default", pool)],
            "fm_jax_splits": splits[("fm_jax", pool)],
        }
        for pool in pools
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """Print a markdown table: per pool, median µs with each option set, ratio and splits."""
    p = argparse.ArgumentParser(prog="python -m fm_bench.thread_split", description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pools", default="4096,16384,65536,262144,1048576", help="pool sizes R")
    p.add_argument("--reps", type=int, default=300, help="interleaved timed rounds")
    args = p.parse_args(argv)
    pools = [int(x) for x in args.pools.split(",") if x]
    print(f"device: {jax.devices()[0].platform}, batch {args.batch}, {args.reps} rounds")
    print(f"fm_jax.compiler_options(): {fj.compiler_options()}")
    print("| R | default µs | fm_jax options µs | default / fm_jax | splits (default / fm_jax) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in measure(args.batch, pools, args.reps):
        print(
            f"| {r['pool']} | {r['default_us']:.1f} | {r['fm_jax_us']:.1f} | "
            f"{r['default_us'] / r['fm_jax_us']:.2f} | "
            f"{r['default_splits']} / {r['fm_jax_splits']} |"
        )


if __name__ == "__main__":
    main()
