"""Debug-mode overhead of fm_jax's `FutureMap` class: debug on vs off, side by side.

Runs fm-bench's own class workload (fm_bench.impls.fm_jax_class) with debug on and off, every
series interleaved round by round (fm_bench.timing), and prints medians and the on/off ratio
per op and for the whole step (resolve + publish + stash + invalidate, docs/CONTRACT.md order).
The headline figure: step ratio <= 1.5x, and flat in R.

Run: `python -m fm_bench.debug_overhead [--reps N] [--pools 4096,1048576] [--batch 256]`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax

from fm_bench.impls import fm_jax_class
from fm_bench.timing import Series, measure_group
from fm_bench.workload import Config, host_data

OPS = ("step", "resolve_decode", "publish", "stash")
"""The ops compared; `step` is the figure, the others say where its cost goes."""


def measure(batch: int, pool: int, reps: int, ops: Sequence[str]) -> dict[tuple[str, bool], float]:
    """Median µs of each op with debug off and on, all series interleaved.

    Returns:
      {(op, debug): median_us}.
    """
    cfg = Config(batch=batch, pool=pool)
    data = host_data(cfg)
    series = []
    for debug in (False, True):
        table = fm_jax_class.build(cfg, data, debug, ops)
        for op in ops:
            series.append(Series((op, debug), table[op].run, table[op].setup))
    stats = measure_group(series, reps=reps, warmup=20)
    return {key: st.median_us for key, st in stats.items()}  # type: ignore[misc]


def main(argv: Sequence[str] | None = None) -> None:
    """Print a markdown table: per pool and op, median µs debug off / on and the ratio."""
    p = argparse.ArgumentParser(prog="python -m fm_bench.debug_overhead", description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pools", default="4096,1048576", help="comma-separated pool sizes R")
    p.add_argument("--reps", type=int, default=300, help="interleaved timed rounds")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    args = p.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    print(f"device: {jax.devices()[0].platform}, batch {args.batch}, {args.reps} rounds")
    print("| R | op | debug off µs | debug on µs | on/off |")
    print("|---|---|---|---|---|")
    for pool in (int(x) for x in args.pools.split(",")):
        med = measure(args.batch, pool, args.reps, ops)
        for op in ops:
            off, on = med[(op, False)], med[(op, True)]
            print(f"| {pool} | {op} | {off:.1f} | {on:.1f} | {on / off:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
