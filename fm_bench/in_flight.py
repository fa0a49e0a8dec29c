"""Why one jitted step call costs more host time with a step in flight (XLA:CPU).

Findings (fm_bench/results/in_flight_cpu.md: a 2-core VM, JAX 0.10.2, B = 256, R = 4096,
7 runs of 300 steps; medians over runs in µs, default async dispatch unless said; load
"none": 0.68 of the 2 CPUs idle on average, "busy": one pinned busy loop added, 0.05 idle):

The step in flight is not what costs; starting a step on an idle device is. XLA:CPU hands
every computation of 1000 flops or more (the trivial step has 4864, the FutureMap engine
step 5888) to a worker thread of its async work runner (its output is ready on return in
1-3% of calls from 20 µs of host work on; the 38-flop step's, run inline, in 100%), and a
worker left without work must be woken once a few µs have passed: the waited call costs
9.7-9.9 µs when it comes 0-5 µs after the wait and 24.6-26.5 µs from 20 µs on (none; 10 µs
is the edge: 11.6), all of it the caller's own CPU time. On the loaded machine the caller
then also loses its core: 46 µs, of which 13.6 µs its CPU, with an involuntary context
switch in 100% of calls and the step's output ready when the call returns (busy
`waited_trivial`; 13.3-13.8 µs within 5 µs of the wait), as when the woken worker runs the
step on the caller's core. In the engine-step loop the "in flight" step is always done
before the next call (`prev running` 0.00-0.01: the step's own host work before its call
takes ~70 µs), so waited and in-flight loops pay the same wake: the executable call costs
43.4 µs waited and 43.6 in flight (none), 68.0 and 67.8 (busy: 31.5 µs CPU + 36.8 off it,
preempted in 99% of calls). In flight / waited: 1.00 in both; busy / none: 1.56. The
issue's 13 µs is a call made right after the wait (`waited_trivial_nogap`: 9.7 none, 13.7
busy); its 30-100 µs, a call that wakes the worker (the busy means reach 67 µs, p90 73).

A call queued behind a step that is really running costs less: with the heavy forward (8
[128, 128] matmuls, 0.37 ms inline) `inflight_heavy` costs 22.7 µs (none) / 16.7 (busy),
the previous step running at 100% / 70% of calls, against 36.1 / 20.1 waited (0.63x /
0.83x). The hypotheses: the previous step's XLA:CPU thread competing for the two cores:
no, that step has finished; the thread that takes the caller's core is the worker the call
itself wakes. A donated state still in use: no (`_nodonate` 22.8 / 16.9, 1.00x / 1.01x;
in no row did a call wait on a lock or futex: `blocked` 0.00). An input not ready: no
(`_independent` 22.4 / 16.4, 0.99x / 0.98x; the CPU client orders a call after the
device's last enqueued computation anyway (xla/pjrt/cpu/cpu_client.cc), and with the step
in flight on another device, `_other_device` 26.4 / 18.3, 1.16x / 1.10x). Inline
execution: only under 1000 flops (`waited_cheap` 8.9 µs, output ready on return in 100% of
calls; queued behind a heavy step it goes to a worker: ready 0% / 13%). The forward's size
decides whether the previous step is still running at the next call, and so whether that
call must wake a worker.

`jax_cpu_enable_async_dispatch=False` (JAX 0.10.2's one switch; XLA has no flag for the
1000-flop threshold) runs every step inline on the caller: 9.9-10.4 µs for the trivial
step at any gap and load, 27.6 µs for the engine step's call in both loads (0.63x / 0.41x
the async figures), but the heavy forward's 373 µs moves into the call: an overlap engine
with a real model would lose the overlap. A perf profile of a call loop (outside this
probe) agrees: with 50 µs of host work before each call the caller's samples in
pthread_cond_signal (the worker's wake) are three times those with none, with the
kernel's schedule() under it.

What is measured: the host time of one jitted call (`time.perf_counter()` around just the
call) and the calling thread's CPU time over the same call (`time.thread_time()`); their
difference is the time the thread was off its core during the call. A step takes a
small int32 state (donated unless the row says not) and a fresh packed uint32 numpy
buffer, gathers rows of the state, runs a forward, and scatters the tokens back. Rows, side
by side in one group (each run shuffles them, and the load states, with its own seed):

- `waited_*`: the previous step waited for (`block_until_ready`), then `--gap-us` of host
  work (a spin standing for the engine's checks and packing), then the call;
  `waited_trivial_nogap`: the call right after the wait, no host work between.
- `inflight_*`: the previous step still in flight (enqueue N + 1, then wait for N, then
  the host work, then enqueue N + 2): `trivial` forward (elementwise ops on B rows, tens of
  µs), `heavy` forward (a chain of [D, D] matmuls, ~0.3-2 ms); `_nodonate`: the state not
  donated; `_independent`: inputs that do not depend on the step in flight (a fixed,
  ready state, not donated), on the same device; `_other_device`: the in-flight step on a second CPU
  device, the call's inputs ready (no data and no stream dependence: only threads
  competing for cores).
- `waited_cheap` / `inflight_cheap`: a step XLA's cost analysis puts under 1000 flops (the
  CPU client's threshold for running a computation inline on the caller when its inputs
  are ready); `inflight_cheap`: with a heavy step enqueued just before it on the device.
- `fm_jax_step_waited` / `fm_jax_step_inflight`: the executable call inside
  `FutureMap.engine_step` (fm_bench/engine_step.py's step fed numpy, B rows, pool R); its
  own host work (checks, padding, packing) is the gap, no spin is added.

Every row runs in a child process with two virtual CPU devices, once with JAX's default
async dispatch and once with `jax_cpu_enable_async_dispatch=False` (the only switch JAX
0.10.2 has over it: `make_cpu_client(asynchronous=...)`, read when the backend starts; XLA
has no flag for the inline threshold), and every run under each load state: `none` (the
machine as it is) and `busy` (one busy-loop Python process pinned to one core).

    python -m fm_bench.in_flight [--runs 7] [--steps 300] [--out fm_bench/results]
    python -m fm_bench.in_flight --render fm_bench/results/in_flight_cpu.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fm_bench.child import child_report
from fm_bench.report import write_result
from fm_parity.host_devices import with_host_devices

ROWS: dict[str, str] = {
    "waited_trivial_nogap": "trivial forward, previous step waited for, call right after",
    "waited_trivial": "trivial forward, previous step waited for, then the host gap",
    "waited_heavy": "heavy forward, previous step waited for, then the host gap",
    "inflight_trivial": "trivial forward, previous step in flight",
    "inflight_heavy": "heavy forward, previous step in flight (state donated, dependent)",
    "inflight_heavy_nodonate": "as inflight_heavy, state not donated",
    "inflight_heavy_independent": "as inflight_heavy, inputs ready (no data dependence)",
    "inflight_heavy_other_device": "heavy step in flight on another CPU device, inputs ready",
    "waited_cheap": "a step under 1000 flops, previous step waited for",
    "inflight_cheap": "a step under 1000 flops, a heavy step enqueued before it",
    "fm_jax_step_waited": "FutureMap.engine_step's executable call, previous step waited for",
    "fm_jax_step_inflight": "FutureMap.engine_step's executable call, previous step in flight",
}
"""Every row's name and what it measures (the gap sweep's rows are added per run, see
`row_names`)."""


def sweep_row(gap_us: float) -> str:
    """The name of the gap sweep's row for `gap_us` of host work between wait and call."""
    return f"waited_trivial_gap_{gap_us:g}us"


def row_names(sweep: Sequence[float]) -> dict[str, str]:
    """Every row of a run with gap sweep `sweep` (µs), and what it measures."""
    out = dict(ROWS)
    for g in sweep:
        out[sweep_row(g)] = f"as waited_trivial, {g:g} µs of host work between wait and call"
    return out


DISPATCHES = ("async", "sync")
"""JAX's CPU dispatch in the child: default (async) or `jax_cpu_enable_async_dispatch=False`."""

LOADS = ("none", "busy")
"""Background load during a run: none added, or one pinned busy-loop process."""

FIGURES = (
    "host_us",
    "mean_us",
    "p90_us",
    "cpu_us",
    "off_cpu_us",
    "ready",
    "blocked",
    "preempted",
    "prev_running",
    "since_wait_us",
    "latency_us",
)
"""Per row and run: median, mean and p90 of the call's wall time; median thread CPU time of
the call and of wall - CPU; the shares of calls whose output was ready when the call
returned, in which the calling thread gave up its core (a voluntary context switch: it
waited on a lock, a futex or a condition), and in which it was preempted (an involuntary
one); the share of calls made while the previous step was still running (in flight in
fact, not only in name); the median time from the last wait's return to the call; (waited
rows) the median time from the call to its output ready."""

CHEAP_FLOPS = 1000
"""The CPU client runs a computation inline when its flop count is under this (and its
inputs are ready); XLA's `PjRtCpuLoadedExecutable` (xla/pjrt/cpu/cpu_client.cc)."""


# ----------------------------------------------------------------------------- the child
class _Timer:
    """Wall and thread-CPU time of the timed calls, and whether each output was ready.

    `cpu` is net of `bias`: the thread CPU time the clock reads around an empty call add
    (the CPU clock is read outside the wall clock, so it also counts the wall clock's
    reads)."""

    bias = 0.0

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.ready: list[bool] = []
        self.done: list[float] = []
        self.voluntary: list[int] = []
        self.involuntary: list[int] = []
        self.prev_running: list[bool] = []
        self.since_wait: list[float] = []

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        c0 = time.thread_time()
        t0 = time.perf_counter()
        out = fn(*args)
        t1 = time.perf_counter()
        c1 = time.thread_time()
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        self.wall.append(t1 - t0)
        self.cpu.append(c1 - c0 - self.bias)
        self.voluntary.append(r1.ru_nvcsw - r0.ru_nvcsw)
        self.involuntary.append(r1.ru_nivcsw - r0.ru_nivcsw)
        self.done.append(t0)
        self.ready.append(all(x.is_ready() for x in jax.tree_util.tree_leaves(out)))
        return out


def _clock_bias(n: int = 2000) -> float:
    """Median thread CPU time minus wall time of an empty timed call."""
    t = _Timer()
    for _ in range(n):
        t(lambda: None)
    return float(np.median(np.array(t.cpu) - np.array(t.wall)))


def _spin_until(t: float) -> None:
    """Busy-wait (the thread keeps its core) until perf_counter() reaches `t`."""
    while time.perf_counter() < t:
        pass


def _loop(
    step: Callable[[_Timer, int], Any],
    timer: _Timer,
    steps: int,
    gap_s: float,
    waited: bool,
) -> list[float]:
    """Run `steps` steps: `step(timer, i)` enqueues step i (timing its call) and returns what
    to wait on. Waited: wait for step i - 1, the gap, then step i. In flight: step i, wait
    for step i - 1, the gap. Records in `timer`, per step after the first, whether step
    i - 1 was still running when step i was called and the time from the last wait's return
    to the timed call. Returns each waited step's call-to-ready time (none in flight)."""
    latency: list[float] = []
    prev: Any = None
    mark = time.perf_counter()
    for i in range(steps):
        if waited and prev is not None:
            jax.block_until_ready(prev)
            mark = time.perf_counter()
            latency.append(mark - timer.done[-1])
        _spin_until(mark + gap_s)
        running = prev is not None and not all(
            x.is_ready() for x in jax.tree_util.tree_leaves(prev)
        )
        cur = step(timer, i)
        if i:
            timer.prev_running.append(running)
            timer.since_wait.append(timer.done[-1] - mark)
        if not waited and prev is not None:
            jax.block_until_ready(prev)
            mark = time.perf_counter()
        prev = cur
    jax.block_until_ready(prev)
    if waited:
        latency.append(time.perf_counter() - timer.done[-1])
    return latency


def _steps(a: argparse.Namespace) -> tuple[dict[str, Callable[[int], Any]], dict[str, float]]:
    """The rows' measurements by name (each runs `n` steps and returns its figures, or None
    where the row cannot run here), and the executables' flop counts."""
    import fm_jax as fj
    from fm_bench import engine_step as es

    options = fj.compiler_options()
    devs = jax.devices()
    B, R, D, chain = a.rows, a.pool, a.dim, a.chain
    rng = np.random.default_rng(0)
    w_host = (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
    base = np.concatenate([rng.permutation(R)[:B].astype(np.uint32), np.arange(B, dtype=np.uint32)])

    def body(chain: int, rows: int, pool: int) -> Callable[..., Any]:
        def f(state: Any, packed: Any, w: Any) -> Any:
            idx = (packed[:rows] % pool).astype(jnp.int32)
            tok = state[idx] * 31 + packed[rows:].astype(jnp.int32)
            if chain:
                n = min(rows, D)
                h = (tok[:n].astype(jnp.float32) * 1e-3)[:, None] * w[:n]
                for _ in range(chain):
                    h = jnp.tanh(h @ w)
                tok = tok + (h[0, 0] > 2).astype(jnp.int32)  # tanh <= 1: adds 0
            return state.at[idx].set(tok % 32000), tok

        return f

    def jit(chain: int, donate: bool, rows: int = B, pool: int = R) -> Any:
        return jax.jit(
            body(chain, rows, pool),
            donate_argnums=(0,) if donate else (),
            compiler_options=options,
        )

    cheap_rows, cheap_pool = 2, 8
    fns = {
        "trivial": jit(0, True),
        "heavy": jit(chain, True),
        "heavy_nodonate": jit(chain, False),
        "cheap": jit(0, True, cheap_rows, cheap_pool),
    }
    cheap_base = base[:cheap_rows] % cheap_pool
    cheap_packed = np.concatenate([cheap_base, np.arange(cheap_rows, dtype=np.uint32)])
    w = {d: jax.device_put(w_host, d) for d in devs[:2]}

    def fresh(n: int, which: np.ndarray = base) -> list[np.ndarray]:
        """A distinct host buffer per step, as an engine packs one, built before the steps
        so that no host work stands between a wait and the call but the gap."""
        out = [which.copy() for _ in range(n)]
        for i, x in enumerate(out):
            x[len(which) // 2 :] += np.uint32(i)
        return out

    flops = {}
    for name, fn in fns.items():
        n = cheap_rows if name == "cheap" else B
        pool = cheap_pool if name == "cheap" else R
        ca = fn.lower(jnp.zeros(pool, jnp.int32), base[: 2 * n], w[devs[0]]).compile()
        cost = ca.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        flops[name] = float(cost.get("flops", -1.0))

    def chained(kind: str, waited: bool, gap_s: float) -> Callable[[int], dict[str, Any]]:
        """A row whose state is fed from each step to the next (donated unless `kind` is
        heavy_nodonate)."""
        fn = fns[kind]
        src, pool = (cheap_packed, cheap_pool) if kind == "cheap" else (base, R)

        def measure(n: int) -> dict[str, Any]:
            box = {"state": jnp.zeros(pool, jnp.int32)}
            timer, ins = _Timer(), fresh(n, src)

            def step(t: _Timer, i: int) -> Any:
                box["state"], tok = t(fn, box["state"], ins[i], w[devs[0]])
                return tok

            return _figures(timer, _loop(step, timer, n, gap_s, waited))

        return measure

    def independent(n: int) -> dict[str, Any]:
        state = jnp.zeros(R, jnp.int32)
        timer, ins = _Timer(), fresh(n)

        def step(t: _Timer, i: int) -> Any:
            return t(fns["heavy_nodonate"], state, ins[i], w[devs[0]])[1]

        return _figures(timer, _loop(step, timer, n, a.gap_us * 1e-6, False))

    def other_device(n: int) -> dict[str, Any] | None:
        if len(devs) < 2:
            return None
        # The step on device i % 2: the one in flight is always on the other device.
        states = [jax.device_put(jnp.zeros(R, jnp.int32), d) for d in devs[:2]]
        timer, ins = _Timer(), fresh(n)

        def step(t: _Timer, i: int) -> Any:
            d = devs[i % 2]
            return t(fns["heavy_nodonate"], states[i % 2], ins[i], w[d])[1]

        return _figures(timer, _loop(step, timer, n, a.gap_us * 1e-6, False))

    def cheap_after_heavy(n: int) -> dict[str, Any]:
        state, cheap_state = jnp.zeros(R, jnp.int32), jnp.zeros(cheap_pool, jnp.int32)
        timer, untimed = _Timer(), _Timer()
        ins, cheap_ins = fresh(n), fresh(n, cheap_packed)

        def step(t: _Timer, i: int) -> Any:
            untimed(fns["heavy_nodonate"], state, ins[i], w[devs[0]])
            _spin_until(time.perf_counter() + a.gap_us * 1e-6)
            nonlocal cheap_state
            cheap_state, tok = t(fns["cheap"], cheap_state, cheap_ins[i], w[devs[0]])
            return tok

        _loop(step, timer, n, 0.0, True)
        return _figures(timer, [])  # its latency would include the heavy step

    engine_cost: dict[str, float] = {}
    engine = _engine_step(a, es, engine_cost)
    gap = a.gap_us * 1e-6
    rows: dict[str, Callable[[int], Any]] = {
        "waited_trivial_nogap": chained("trivial", True, 0.0),
        "waited_trivial": chained("trivial", True, gap),
        "waited_heavy": chained("heavy", True, gap),
        "inflight_trivial": chained("trivial", False, gap),
        "inflight_heavy": chained("heavy", False, gap),
        "inflight_heavy_nodonate": chained("heavy_nodonate", False, gap),
        "inflight_heavy_independent": independent,
        "inflight_heavy_other_device": other_device,
        "waited_cheap": chained("cheap", True, gap),
        "inflight_cheap": cheap_after_heavy,
        "fm_jax_step_waited": lambda n: engine(n, True),
        "fm_jax_step_inflight": lambda n: engine(n, False),
    }
    for g in a.sweep:
        rows[sweep_row(g)] = chained("trivial", True, g * 1e-6)
    engine(1, True)
    flops["fm_jax_step"] = engine_cost["flops"]
    return rows, flops


def _engine_step(
    a: argparse.Namespace, es: Any, cost: dict[str, float]
) -> Callable[[int, bool], dict[str, Any]]:
    """fm_bench.engine_step's `fm_jax_step` (fed numpy), its executable call timed; the
    executable's flops go to `cost["flops"]` at its first call."""
    import fm_jax as fj

    B, R = a.rows, a.pool
    rng = np.random.default_rng(0)
    slots = rng.permutation(np.arange(1, R, dtype=np.int32))[:B]
    host = {k: np.arange(B, dtype=np.int32) for k in "abc"}
    fm = fj.FutureMap(R, batch_buckets=[B], token_buckets=[B], needs_cpu_seq_lens=False)

    def forward(res: fj.Resolved, b: fj.Batch, inputs: Any) -> fj.StepOutput:
        tokens = es._tokens(res.input_ids, inputs)
        return fj.StepOutput(res.seq_lens + 1, tokens, tokens)

    step = fm.engine_step(forward, inputs=es.INPUTS)
    fm.finish(fj.Batch(es.DECODE, slots, slots, slots), slots, slots, slots)
    batch = fj.Batch(es.DECODE, slots, -slots, -slots)
    registry = step._registry  # the step's executables, by key (fm_jax internals)
    exe_of = registry.executable
    box: dict[str, _Timer] = {}

    def timed_exe(*key: Any) -> Callable[..., Any]:
        exe = exe_of(*key)

        def call(*args: Any) -> Any:
            if "flops" not in cost:  # the first call, while warming (lowering runs nothing)
                c = exe.lower(*args).compile().cost_analysis()
                cost["flops"] = float((c[0] if isinstance(c, list | tuple) else c)["flops"])
            return box["timer"](exe, *args)

        return call

    setattr(registry, "executable", timed_exe)  # noqa: B010 (an instance attribute over the method)

    def measure(n: int, waited: bool) -> dict[str, Any]:
        timer = box["timer"] = _Timer()

        def one(t: _Timer, i: int) -> Any:
            return step(batch, inputs=host).out

        return _figures(timer, _loop(one, timer, n, 0.0, waited))

    return measure


def _figures(timer: _Timer, latency: list[float]) -> dict[str, Any]:
    """One row's figures over its steps (µs, or a share; None where the row has none)."""
    wall = np.array(timer.wall) * 1e6
    cpu = np.array(timer.cpu) * 1e6
    out = {
        "host_us": np.median(wall),
        "mean_us": wall.mean(),
        "p90_us": np.percentile(wall, 90),
        "cpu_us": np.median(cpu),
        "off_cpu_us": np.median(wall - cpu),
        "ready": np.mean(timer.ready),
        "blocked": np.mean(np.array(timer.voluntary) > 0),
        "preempted": np.mean(np.array(timer.involuntary) > 0),
        "prev_running": np.mean(timer.prev_running) if timer.prev_running else None,
        "since_wait_us": np.median(timer.since_wait) * 1e6 if timer.since_wait else None,
        "latency_us": np.median(latency) * 1e6 if latency else None,
    }
    return {k: None if v is None else round(float(v), 3) for k, v in out.items()}


def _busy(cpu: int) -> subprocess.Popen[bytes]:
    """A busy-loop Python process pinned to `cpu` (the caller ends it)."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(p.pid, {cpu})
    return p


def _cpu_times() -> tuple[float, float] | None:
    """The machine's (idle, total) CPU time so far, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields[:8])  # idle + iowait; user .. steal


def _idle_cpus(before: tuple[float, float] | None) -> float | None:
    """How many of the machine's CPUs were idle on average since `before`."""
    after = _cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return round((after[0] - before[0]) / (after[1] - before[1]) * (n or 1), 3)


def _child(a: argparse.Namespace) -> dict[str, Any]:
    """Every run of every row under every load, in this process (`a.child` dispatch)."""
    jax.config.update("jax_cpu_enable_async_dispatch", a.child == "async")
    _Timer.bias = _clock_bias()
    rows, flops = _steps(a)
    for name, fn in rows.items():  # compile and warm
        fn(max(3, min(20, a.steps)))
        assert name in row_names(a.sweep)
    cpus = sorted(os.sched_getaffinity(0))
    per: dict[str, dict[str, list[dict[str, Any] | None]]] = {
        ld: {n: [] for n in rows} for ld in a.loads
    }
    loadavg = []
    idle: dict[str, list[float | None]] = {ld: [] for ld in a.loads}
    for r in range(a.runs):
        rnd = random.Random(1000 * r + (a.child == "sync"))
        loads = list(a.loads)
        rnd.shuffle(loads)
        for ld in loads:
            busy = _busy(cpus[-1]) if ld == "busy" else None
            try:
                if busy is not None:
                    time.sleep(0.2)  # the busy process is running before the first step
                loadavg.append(os.getloadavg()[0])
                order = list(rows)
                rnd.shuffle(order)
                before = _cpu_times()
                for name in order:
                    per[ld][name].append(rows[name](a.steps))
                idle[ld].append(_idle_cpus(before))
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    d = jax.devices()[0]
    return {
        "dispatch": a.child,
        "device": f"{d.platform} ({d.device_kind}), {len(jax.devices())} CPU devices",
        "flops": flops,
        "clock_bias_us": round(_Timer.bias * 1e6, 3),
        "threads": len(os.listdir("/proc/self/task")),
        "loadavg_1min": [round(x, 2) for x in loadavg],
        "idle_cpus": idle,
        "per_run": per,
    }


# ---------------------------------------------------------------------------- the parent
def _summary(per_run: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Per figure: the median over runs and the range over runs."""
    runs = [x for x in per_run if x is not None]
    if not runs:
        return None
    out: dict[str, Any] = {"runs": len(runs)}
    for f in FIGURES:
        vals = [x[f] for x in runs if x[f] is not None]
        if vals:
            out[f] = round(statistics.median(vals), 3)
            out[f + "_range"] = [round(min(vals), 3), round(max(vals), 3)]
    return out


def run(a: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Both dispatch children; rows per (dispatch, load) summarised over runs."""
    t0 = time.perf_counter()
    env = with_host_devices(dict(os.environ, JAX_PLATFORMS="cpu"), 2)
    children = {}
    for dispatch in a.dispatch:
        cmd = ["-m", "fm_bench.in_flight", "--child", dispatch, *_child_args(a)]
        log(f"child: dispatch {dispatch}")
        children[dispatch] = child_report(cmd, env, timeout=900, marker="IN_FLIGHT")
    rows = []
    for dispatch, doc in children.items():
        for ld, by_row in doc["per_run"].items():
            for name in row_names(a.sweep):
                s = _summary(by_row[name])
                rows.append({"dispatch": dispatch, "load": ld, "row": name, **(s or {})})
    first = next(iter(children.values()))
    return {
        "device": first["device"],
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "jax": jax.__version__,
        "args": {k: v for k, v in vars(a).items() if k not in ("out", "tag", "child")},
        "flops": first["flops"],
        "threads": {k: v["threads"] for k, v in children.items()},
        "clock_bias_us": {k: v["clock_bias_us"] for k, v in children.items()},
        "loadavg_1min": {k: v["loadavg_1min"] for k, v in children.items()},
        "idle_cpus": {k: v["idle_cpus"] for k, v in children.items()},
        "wall_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
        "per_run": {k: v["per_run"] for k, v in children.items()},
    }


def _child_args(a: argparse.Namespace) -> list[str]:
    """The child's command line for the sizes and loads of `a`."""
    out = []
    for k in ("rows", "pool", "dim", "chain", "steps", "runs", "gap_us"):
        out += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    return out + ["--loads", ",".join(a.loads), "--sweep", ",".join(f"{g:g}" for g in a.sweep)]


def _cell(r: dict[str, Any], f: str, digits: int = 1) -> str:
    """'median (min–max)' of figure `f` over runs, or a dash."""
    if f not in r:
        return "–"
    lo, hi = r[f + "_range"]
    return f"{r[f]:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def _idle_line(idle: list[float | None]) -> str:
    """The sentence under a table: how many CPUs were idle while its rows ran."""
    vals = [x for x in idle if x is not None]
    if not vals:
        return "Idle CPUs while these rows ran: not measured."
    return (
        f"Idle CPUs while these rows ran (of the machine's, this process included): median "
        f"{statistics.median(vals):.2f}, per run {', '.join(f'{x:.2f}' for x in vals)}."
    )


def markdown(res: dict[str, Any]) -> str:
    """The results as a markdown page: the findings, then a table per (dispatch, load)."""
    a = res["args"]
    lines = [
        "# in_flight: one jitted call's host time with a step in flight (XLA:CPU)",
        "",
        FINDINGS,
        "",
        f"- device: {res['device']}; os.cpu_count() = {res['cpu_count']}, "
        f"{res['affinity']} CPUs in this process's affinity; JAX {res['jax']}",
        f"- B = {a['rows']} rows, pool R = {a['pool']}, heavy forward: {a['chain']} matmuls "
        f"[{a['dim']}, {a['dim']}]; host gap {a['gap_us']} µs; {a['steps']} steps per row "
        f"and run, {a['runs']} runs (rows and loads shuffled per run)",
        "- flops per executable (XLA cost analysis; under "
        f"{CHEAP_FLOPS} the client may run it inline): "
        + ", ".join(f"{k} {v:.0f}" for k, v in res["flops"].items()),
        f"- 1-min load average at each (run, load): {res['loadavg_1min']}",
        f"- threads in the child process: {res['threads']}; clock bias subtracted from cpu "
        f"(µs): {res['clock_bias_us']}; wall time {res['wall_s']:.0f} s",
        "",
        "Cells: median over runs of each run's figure (range over runs). host: median wall "
        "time of the call; mean: its mean (what engine_step's host_us averages); cpu: the "
        "calling thread's CPU time in the call; off-CPU: median of wall - cpu per call; "
        "ready: share of calls whose output was ready when the call returned; blocked / "
        "preempted: share of calls in which the calling thread made a voluntary (waited on "
        "a lock or futex) / involuntary (preempted) context switch; prev running: share of "
        "calls made while the previous step was still running; since wait: time from the "
        "last wait's return to the call; latency (waited rows): call to output ready.",
        "",
    ]
    for dispatch in a["dispatch"]:
        for ld in a["loads"]:
            sub = [r for r in res["rows"] if r["dispatch"] == dispatch and r["load"] == ld]
            title = (
                "default async dispatch"
                if dispatch == "async"
                else ("jax_cpu_enable_async_dispatch=False")
            )
            lines += [
                f"## {title}, background load: {ld}",
                "",
                _idle_line(res["idle_cpus"][dispatch][ld]),
                "",
                "| row | host µs | mean µs | p90 µs | cpu µs | off-CPU µs | ready | blocked "
                "| preempted | prev running | since wait µs | latency µs |",
                "| --- |" + " ---: |" * 11,
            ]
            for r in sub:
                if "host_us" not in r:
                    lines.append(f"| {r['row']} |" + " – |" * 11)
                    continue
                lines.append(
                    f"| {r['row']} | {_cell(r, 'host_us')} | {_cell(r, 'mean_us')} | "
                    f"{_cell(r, 'p90_us')} | {_cell(r, 'cpu_us')} | {_cell(r, 'off_cpu_us')} | "
                    f"{_cell(r, 'ready', 2)} | {_cell(r, 'blocked', 2)} | "
                    f"{_cell(r, 'preempted', 2)} | {_cell(r, 'prev_running', 2)} | "
                    f"{_cell(r, 'since_wait_us')} | {_cell(r, 'latency_us')} |"
                )
            lines.append("")
    names = row_names(a["sweep"])
    lines += ["Rows:", ""] + [f"- `{k}`: {v}" for k, v in names.items()]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    """The command line of the probe and of its children."""
    p = argparse.ArgumentParser(prog="fm_bench.in_flight", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256, help="B: rows per step")
    p.add_argument("--pool", type=int, default=4096, help="R: the state's rows")
    p.add_argument("--dim", type=int, default=128, help="D of the heavy forward's matmuls")
    p.add_argument("--chain", type=int, default=8, help="matmuls in the heavy forward")
    p.add_argument("--steps", type=int, default=300, help="steps per row and run")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--gap-us", type=float, default=30.0, help="host work between steps")
    p.add_argument("--loads", default="none,busy", help="comma-separated: none, busy")
    p.add_argument(
        "--sweep", default="0,2,5,10,20,50,100", help="host gaps (µs) of the waited gap sweep"
    )
    p.add_argument("--dispatch", default="async,sync", help="comma-separated: async, sync")
    p.add_argument("--out", type=Path, default=None, help="write in_flight_<tag>.{md,json}")
    p.add_argument("--tag", default="cpu", help="file tag")
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="measure nothing: rewrite the markdown of a result file written by --out",
    )
    p.add_argument("--child", choices=DISPATCHES, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fm_bench.in_flight`: run both children, print markdown, write files."""
    a = _parser().parse_args(argv)
    a.loads = [x for x in str(a.loads).split(",") if x]
    a.sweep = [float(x) for x in str(a.sweep).split(",") if x]
    if a.child is not None:
        print("IN_FLIGHT", json.dumps(_child(a)))
        return 0
    a.dispatch = [x for x in str(a.dispatch).split(",") if x]
    bad = [x for x in a.loads if x not in LOADS] + [x for x in a.dispatch if x not in DISPATCHES]
    if bad:
        raise SystemExit(f"unknown load or dispatch: {bad}")
    res = json.loads(a.render.read_text()) if a.render else run(a, log=print)
    text = markdown(res)
    print(text)
    if a.out is not None:
        write_result(a.out, "in_flight", text, res, a.tag)
    return 0


FINDINGS = (__doc__ or "").split("\n\n", 1)[-1].split("What is measured:")[0].strip()
"""The module docstring's findings: the markdown page's header."""


if __name__ == "__main__":
    raise SystemExit(main())
