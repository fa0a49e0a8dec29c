"""Interleaved timing: every series of a group is measured round-robin, in shuffled order.

Two implementations measured minutes apart on a shared machine see different loads; measured
one repetition after the other, they see the same. A series is an untimed `setup` and a timed
`run`; `run` must include the device sync (block_until_ready / torch sync) of what it produced.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np


def _nothing() -> None:
    return None


@dataclass
class Series:
    """One timed workload.

    Attributes:
      key: identifies the series in the results (any hashable, e.g. a tuple of labels).
      run: the timed callable; it blocks until its device work is done.
      setup: untimed, called before each `run` (e.g. a stash so that a debug resolve reads
        written slots); default does nothing.
      pair: key of a baseline series in the same group; the series' samples then become
        `run - baseline`, each paired with the baseline sample of the same repetition
        (marginal cost, e.g. a fused engine step minus the same step without the ops).
    """

    key: Hashable
    run: Callable[[], object]
    setup: Callable[[], object] = _nothing
    pair: Hashable | None = None


@dataclass
class Stats:
    """Summary of one series' samples, in microseconds."""

    median_us: float
    p10_us: float
    p90_us: float
    n: int
    samples_us: list[float] = field(default_factory=list, repr=False)

    @staticmethod
    def of(samples_s: Sequence[float]) -> Stats:
        us = np.asarray(samples_s, dtype=np.float64) * 1e6
        return Stats(
            median_us=float(np.median(us)),
            p10_us=float(np.percentile(us, 10)),
            p90_us=float(np.percentile(us, 90)),
            n=int(us.size),
            samples_us=us.tolist(),
        )


def measure_group(
    series: Sequence[Series],
    *,
    reps: int,
    warmup: int,
    budget_s: float | None = None,
    min_reps: int = 20,
    seed: int = 0,
    on_rep: Callable[[], object] | None = None,
) -> dict[Hashable, Stats]:
    """Time every series `reps` times, interleaved, after `warmup` untimed rounds.

    Each round runs every series once, in an order shuffled per round (a fixed seed keeps
    runs reproducible), so slow drifts and bursts of load spread over all series.

    Args:
      series: the workloads; keys must be unique.
      reps: timed rounds (at most).
      warmup: untimed rounds first (compilation, caches, allocator); at least 1.
      budget_s: if set, fewer timed rounds (but >= min_reps) when the last warm-up round
        says `reps` would take longer than this.
      min_reps: floor for the budgeted number of rounds.
      seed: shuffling seed.
      on_rep: called after each timed round (progress bars).

    Returns:
      Stats per key; paired series hold the per-round differences to their baseline.
    """
    keys = [s.key for s in series]
    if len(set(keys)) != len(keys):
        raise ValueError("series keys must be unique within a group")
    rng = random.Random(seed)
    order = list(series)
    samples: dict[Hashable, list[float]] = {s.key: [] for s in series}
    warmup = max(1, warmup)
    total = warmup + reps
    rnd = 0
    while rnd < total:
        rng.shuffle(order)
        r0 = time.perf_counter()
        for s in order:
            s.setup()
            t0 = time.perf_counter()
            s.run()
            dt = time.perf_counter() - t0
            if rnd >= warmup:
                samples[s.key].append(dt)
        if rnd == warmup - 1 and budget_s is not None:
            round_s = max(time.perf_counter() - r0, 1e-9)
            total = warmup + max(min(reps, min_reps), min(reps, int(budget_s / round_s)))
        if rnd >= warmup and on_rep is not None:
            on_rep()
        rnd += 1
    out: dict[Hashable, Stats] = {}
    for s in series:
        got = samples[s.key]
        if s.pair is not None:
            base = samples[s.pair]
            got = [a - b for a, b in zip(got, base, strict=True)]
        out[s.key] = Stats.of(got)
    return out
