"""Host time per step and time between dispatches: eSurge as shipped (its synchronous
loop) against eSurge on fm_jax's relay with the reordered loop, on the tiny model.

    .venv-easydel/bin/python -m fm_easydel.bench --out integrations/easydel/results/cpu.md

A step's dispatch is the call of its compiled backbone (`ExecutionManager.execute_model`);
its wait is the time the scheduler thread spends blocked on its tokens
(`_AsyncExecutionHandle.get_output`). Time between dispatches is the interval between two
backbone calls; host time per step is that interval less the wait inside it. The shipped
engine runs exactly as shipped (no numpy copy at `device_put`, unlike the tests' reference).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from . import harness
from ._compat import import_easydel


class Probe:
    """Timestamps of backbone calls and durations of token waits, for any eSurge."""

    def __init__(self) -> None:
        from easydel.inference.esurge.runners import model_runner
        from easydel.inference.esurge.runners.execution_manager import ExecutionManager

        self.dispatch: list[float] = []
        self.waits: list[tuple[float, float]] = []
        self._em = ExecutionManager
        self._handle = model_runner._AsyncExecutionHandle
        self._orig_exec = ExecutionManager.execute_model
        self._orig_get = self._handle.get_output
        probe = self

        def execute_model(em, *a, **k):
            probe.dispatch.append(time.perf_counter())
            return probe._orig_exec(em, *a, **k)

        def get_output(h):
            t0 = time.perf_counter()
            try:
                return probe._orig_get(h)
            finally:
                probe.waits.append((t0, time.perf_counter()))

        ExecutionManager.execute_model = execute_model
        self._handle.get_output = get_output

    def close(self) -> None:
        self._em.execute_model = self._orig_exec
        self._handle.get_output = self._orig_get

    def reset(self) -> None:
        self.dispatch.clear()
        self.waits.clear()

    def figures(self) -> tuple[np.ndarray, np.ndarray]:
        d = np.array(self.dispatch)
        gaps = np.diff(d)
        host = []
        for a, b in zip(d[:-1], d[1:], strict=True):
            waited = sum(max(0.0, min(e, b) - max(s, a)) for s, e in self.waits)
            host.append((b - a) - waited)
        return gaps * 1e3, np.array(host) * 1e3


def workload(ed, eng, batch: int, tokens: int) -> None:
    sp = ed.SamplingParams(temperature=0.0, max_tokens=tokens)
    prompts = [harness.prompt([i, i + 1, i + 2]) for i in range(batch)]
    eng.generate(prompts, sp, use_tqdm=False)


def stats(x: np.ndarray) -> str:
    return f"{np.median(x):.2f} ({np.percentile(x, 10):.2f}-{np.percentile(x, 90):.2f})"


def across_runs(per_run: list[np.ndarray]) -> str:
    """The median of each run's median, and the lowest and highest run median."""
    meds = np.array([np.median(x) for x in per_run])
    return f"{np.median(meds):.2f} [{meds.min():.2f}-{meds.max():.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ed = import_easydel()
    directory = tempfile.mkdtemp()
    harness.save_tokenizer(directory)
    spec = harness.EngineSpec(tokenizer_dir=directory)
    rows = []
    load = [os.getloadavg()[0]]
    for relay in (False, True):
        with harness.engine(spec, relay=relay, copy_inputs=False) as eng:
            workload(ed, eng, args.batch, 4)  # warm
            probe = Probe()
            try:
                gaps, hosts = [], []
                for _ in range(args.runs):
                    probe.reset()
                    workload(ed, eng, args.batch, args.tokens)
                    g, h = probe.figures()
                    gaps.append(g)
                    hosts.append(h)
            finally:
                probe.close()
            g, h = np.concatenate(gaps), np.concatenate(hosts)
            name = "fm_jax relay, reordered loop" if relay else "shipped (sync loop)"
            load.append(os.getloadavg()[0])
            rows.append((name, len(g), stats(g), across_runs(gaps), stats(h), across_runs(hosts)))
            print(rows[-1], flush=True)
    lines = [
        "# eSurge on CPU: shipped vs fm_jax's relay",
        "",
        f"Tiny random Llama (2 layers, hidden 64, vocab 64), {args.batch} requests x "
        f"{args.tokens} greedy tokens, {args.runs} runs; ms. Pooled: every step of every run, "
        "median (p10-p90). Per run: the median of the run medians [lowest-highest run]. "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with "
        f"other work (1-minute load average at start / after shipped / after relay: "
        f"{' / '.join(f'{x:.1f}' for x in load)}), "
        f"`python -m fm_easydel.bench --batch {args.batch} --tokens {args.tokens} "
        f"--runs {args.runs}`.",
        "",
        "| loop | steps | between dispatches, pooled | per run | host per step, pooled | per run |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
