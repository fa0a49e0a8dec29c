"""The protocol comparison: each FutureMap implementation under the sentinel and the gather
protocol (docs/CONTRACT.md, 'Two protocols'), measured side by side.

One interleaved group per pool holds both protocols' series of every implementation (plain
and spec maps), so a gather/sentinel ratio compares medians taken in the same rounds. The
group is measured `runs` times: each run gives a median per series and a ratio per
(implementation, op, map); the rows give the median over runs and its range.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from fm_bench import run
from fm_bench.plan import PROTOCOL_OPS, Protocols
from fm_bench.timing import Series, Stats

_PAIR_KEYS = ("impl", "op", "batch", "pool", "spec", "dtype", "debug", "hidden", "hidden_dtype")
"""What a sentinel row and its gather row share (everything but the protocol)."""


def series(p: Protocols, pool: int) -> list[Series]:
    """Every series of one pool's group: each implementation, op and map, both protocols."""
    variants = [(impl, False) for impl in p.impls]
    out: list[Series] = []
    for cfg in p.configs(pool):
        ops = [op for op in PROTOCOL_OPS if op in cfg.ops()]
        out += run.build_series(cfg, variants, ops)
    return out


def summarize(per_run: Sequence[dict[Hashable, Stats]]) -> list[dict[str, Any]]:
    """Result rows over the runs of one group: the JSON row schema, with `median_us` the
    median of the runs' medians, p10/p90 over every sample, and each run's median."""
    pooled: dict[Hashable, Stats] = {}
    for key in per_run[0]:
        samples = [x for stats in per_run for x in stats[key].samples_us]
        pooled[key] = Stats.of([x * 1e-6 for x in samples])
    rows = []
    for key, st in pooled.items():
        if not isinstance(key, run.Key) or key.impl.endswith("/baseline"):
            continue
        r = run.row(key, st, pooled)
        medians = [stats[key].median_us for stats in per_run]
        r["median_us"] = round(statistics.median(medians), 2)
        r["run_medians_us"] = [round(m, 2) for m in medians]
        for f in ("host_us", "pipe_us"):  # each run's pipelined figure; their median
            got = [getattr(stats[key], f) for stats in per_run]
            if None not in got:
                r[f] = round(statistics.median(got), 2)
                r["run_" + f] = [round(x, 2) for x in got]
        rows.append(r)
    return rows


def _ratio(sentinel: Sequence[float], gather: Sequence[float], prefix: str) -> dict[str, Any]:
    """Both protocols' medians over runs with their ranges, and the median (range) of the
    per-run ratios gather / sentinel; keys prefixed (`host_`: the host-time figures)."""
    # A fused marginal cost can be <= 0 (indistinguishable from nothing): no ratio then.
    ratios = [b / a for a, b in zip(sentinel, gather, strict=True) if a > 0]
    return {
        f"{prefix}sentinel_us": round(statistics.median(sentinel), 2),
        f"{prefix}gather_us": round(statistics.median(gather), 2),
        f"{prefix}sentinel_range_us": [min(sentinel), max(sentinel)],
        f"{prefix}gather_range_us": [min(gather), max(gather)],
        f"{prefix}ratio": round(statistics.median(ratios), 3) if ratios else None,
        f"{prefix}ratio_range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
    }


def compare(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Gather vs sentinel per (implementation, op, map): the ratio of each run's medians,
    its median over runs and range, on waited and (`host_*`) on host time; rows measured
    in one protocol only are left out."""
    by: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(tuple(r.get(k) for k in _PAIR_KEYS), {})[r["protocol"]] = r
    out = []
    for pair in by.values():
        s, g = pair.get("sentinel"), pair.get("gather")
        if s is None or g is None:
            continue
        c: dict[str, Any] = {k: s[k] for k in _PAIR_KEYS if k in s}
        c.update(_ratio(s["run_medians_us"], g["run_medians_us"], ""))
        if "run_host_us" in s and "run_host_us" in g:
            c.update(_ratio(s["run_host_us"], g["run_host_us"], "host_"))
        c["runs"] = len(s["run_medians_us"])
        out.append(c)
    return out


def measure(
    p: Protocols,
    *,
    warmup: int,
    min_reps: int,
    on_group: Callable[[str], object] = lambda _: None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Measure every pool's group `p.runs` times.

    Args:
      p: the comparison's sizes and repetitions.
      warmup: untimed rounds before each run.
      min_reps: the fewest timed rounds a budgeted run keeps.
      on_group: called with a label before each run (progress).

    Returns:
      (result rows, one per series with its runs' medians; gather vs sentinel comparisons).
    """
    rows: list[dict[str, Any]] = []
    for pool in p.pools:
        built = series(p, pool)  # built (and compiled) once; every run measures the same
        per_run = []
        for i in range(p.runs):
            on_group(f"protocols B={p.batch} R={pool} run {i + 1}/{p.runs}")
            per_run.append(
                run.measure(
                    built,
                    reps=p.reps,
                    warmup=warmup,
                    budget_s=p.budget_s,
                    min_reps=min(min_reps, p.reps),
                    seed=i,  # each run its own orders: the range over runs includes theirs
                )
            )
        rows += summarize(per_run)
        del built, per_run
        gc.collect()
    return rows, compare(rows)
