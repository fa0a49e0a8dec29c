"""What the class's lock costs a caller: one op through the public (locked) method beside the
same method without the lock, interleaved, and a bare uncontended `RLock` round trip.

A `FutureMap`'s ops take turns on one re-entrant lock per map, so several threads may call
one map (each op donates the state the next one reads). One thread never waits on it; what
it pays is the acquire, the release and one more Python frame. The series: `publish` (jax
arrays, B rows) locked and unlocked (`FutureMap.publish.__wrapped__`, the same body), the
unlocked one the baseline of the other, so the lock's cost is read as their paired
difference; host time (`host_us`, one step in flight) is the figure an overlap engine pays.

Run: `python -m fm_bench.lock_cost [--batch 256] [--pool 4096] [--reps 2000]`.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import fm_jax as fj
from fm_bench.impls.jax_common import device_data
from fm_bench.timing import Series, measure_group, wait_jax
from fm_bench.workload import Config, host_data


def bare_lock_ns(rounds: int = 7, calls: int = 200_000) -> list[float]:
    """Per round, ns per uncontended `with RLock(): pass` (minus an empty loop's ns)."""
    lock = threading.RLock()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            pass
        t1 = time.perf_counter_ns()
        for _ in range(calls):
            with lock:
                pass
        t2 = time.perf_counter_ns()
        out.append(((t2 - t1) - (t1 - t0)) / calls)
    return out


def measure(batch: int, pool: int, reps: int) -> dict[str, Any]:
    """Median µs of a locked and an unlocked publish (waited and host) and of their paired
    difference, and the bare lock's ns per round trip."""
    cfg = Config(batch, pool)
    dd = device_data(cfg, host_data(cfg))
    fm = fj.FutureMap(pool, batch_buckets=[batch], token_buckets=[batch])
    fm.warm_up()
    unlocked = fj.FutureMap.publish.__wrapped__  # type: ignore[attr-defined]

    def locked_run() -> None:
        fm.publish(dd.idx, dd.lens)
        wait_jax(fm.state)

    def unlocked_run() -> None:
        unlocked(fm, dd.idx, dd.lens)
        wait_jax(fm.state)

    series = [
        Series("unlocked", unlocked_run),
        Series("locked", locked_run),
        Series("locked - unlocked", locked_run, pair="unlocked"),
    ]
    stats = measure_group(series, reps=reps, warmup=20, pipe_rounds=7, pipe_steps=200)
    ns = bare_lock_ns()
    return {
        "device": jax.devices()[0].platform,
        "batch": batch,
        "pool": pool,
        "series": {
            str(k): {"median_us": s.median_us, "host_us": s.host_us} for k, s in stats.items()
        },
        "bare_lock_ns": {"median": float(np.median(ns)), "min": min(ns), "max": max(ns)},
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Print the figures as a markdown table."""
    p = argparse.ArgumentParser(prog="python -m fm_bench.lock_cost", description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pool", type=int, default=4096)
    p.add_argument("--reps", type=int, default=2000, help="interleaved timed rounds")
    args = p.parse_args(argv)
    r = measure(args.batch, args.pool, args.reps)
    print(f"device: {r['device']}, B = {r['batch']}, R = {r['pool']}, {args.reps} rounds")
    print("| series | waited median µs | host µs |")
    print("| --- | ---: | ---: |")
    for k, s in r["series"].items():
        host = "-" if s["host_us"] is None else f"{s['host_us']:.2f}"
        print(f"| {k} | {s['median_us']:.2f} | {host} |")
    b = r["bare_lock_ns"]
    print(f"\nbare RLock round trip: {b['median']:.0f} ns (range {b['min']:.0f}-{b['max']:.0f})")


if __name__ == "__main__":
    main()
