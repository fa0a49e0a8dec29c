"""Interleaved timing: every series of a group is measured round-robin, in shuffled order.

Two implementations measured minutes apart on a shared machine see different loads; measured
one repetition after the other, they see the same. A series is an untimed `setup` and a timed
`run`; `run` ends by waiting for what it produced, through `wait_jax` / `wait_torch`.

Three figures per series:
- waited (`median_us`, p10, p90): each run timed with its wait, one at a time: what a
  synchronous loop pays per step (on a GPU host mostly launch-and-wait latency);
- `host_us`: the run's own time with its wait deferred, each step enqueued while the step
  before it may still run (enqueue N + 1, then wait for N), as an overlap engine runs: what
  the scheduler thread pays; with a deeper queue the device's back-pressure would fold
  device time into it;
- `pipe_us`: that loop's wall time per step (setup included).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

_T = TypeVar("_T")
_deferred: list[Callable[[], object]] | None = None
"""Inside `deferring()`: the waits the runs asked for, to do later; else None (wait now)."""


def wait_jax(x: _T) -> _T:
    """Wait for the jax arrays in `x` (any pytree) and return it; inside `deferring()` the
    wait is recorded for later instead."""
    import jax

    if _deferred is not None:

        def later() -> None:
            # A buffer the next step took donated is gone: that step's own wait covers it.
            live = [
                a for a in jax.tree.leaves(x) if not (hasattr(a, "is_deleted") and a.is_deleted())
            ]
            jax.block_until_ready(live)

        _deferred.append(later)
        return x
    return jax.block_until_ready(x)  # type: ignore[no-any-return]


def wait_torch(device: Any) -> None:
    """Wait for the work queued on torch `device` (a CUDA device's stream; nothing to wait
    for on the CPU, where torch runs eagerly); inside `deferring()`, an event recorded now
    and waited for later."""
    if device.type != "cuda":
        return
    import torch

    if _deferred is not None:
        event = torch.cuda.Event()
        event.record()
        _deferred.append(event.synchronize)
        return
    torch.cuda.synchronize(device)


@contextmanager
def deferring() -> Iterator[list[Callable[[], object]]]:
    """The waits asked for inside the block, recorded (not done) in the list yielded."""
    global _deferred
    outer, _deferred = _deferred, []
    try:
        yield _deferred
    finally:
        _deferred = outer


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
    """Summary of one series' samples, in microseconds (host and pipe: medians over the
    pipelined rounds; None when none ran)."""

    median_us: float
    p10_us: float
    p90_us: float
    n: int
    samples_us: list[float] = field(default_factory=list, repr=False)
    host_us: float | None = None
    pipe_us: float | None = None

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


def _pipelined(s: Series, steps: int) -> tuple[float, float]:
    """(host, pipe) seconds per step of `steps` runs of `s`, each enqueued before the
    previous one's wait (one step in flight)."""
    host = 0.0
    before: list[Callable[[], object]] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        s.setup()
        with deferring() as waits:
            a = time.perf_counter()
            s.run()
            host += time.perf_counter() - a
        for w in before:
            w()
        before = waits
    for w in before:
        w()
    return host / steps, (time.perf_counter() - t0) / steps


def measure_group(
    series: Sequence[Series],
    *,
    reps: int,
    warmup: int,
    budget_s: float | None = None,
    min_reps: int = 20,
    seed: int = 0,
    on_rep: Callable[[], object] | None = None,
    pipe_rounds: int = 5,
    pipe_steps: int = 20,
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
      pipe_rounds, pipe_steps: after the waited rounds, `pipe_rounds` interleaved rounds of
        `pipe_steps` pipelined steps per series (`host_us`, `pipe_us`); 0 rounds: none.

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
    piped: dict[Hashable, list[tuple[float, float]]] = {s.key: [] for s in series}
    for _ in range(pipe_rounds):
        rng.shuffle(order)
        for s in order:
            piped[s.key].append(_pipelined(s, pipe_steps))
    out: dict[Hashable, Stats] = {}
    for s in series:
        got, pipe = samples[s.key], piped[s.key]
        if s.pair is not None:
            base, base_pipe = samples[s.pair], piped[s.pair]
            got = [a - b for a, b in zip(got, base, strict=True)]
            pipe = [(a - c, b - d) for (a, b), (c, d) in zip(pipe, base_pipe, strict=True)]
        st = Stats.of(got)
        if pipe:
            st.host_us = 1e6 * float(np.median([h for h, _ in pipe]))
            st.pipe_us = 1e6 * float(np.median([p for _, p in pipe]))
        out[s.key] = st
    return out
