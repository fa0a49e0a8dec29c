"""Runs a list of Jobs: here when this process's JAX can, else in an x64 worker process.

int64 jobs need JAX's x64 mode, a process-wide setting fixed before JAX starts. Unless
this process already has it, they run in `python -m parity.worker` started with
JAX_ENABLE_X64=1, concurrently with the local jobs; its results stream back as JSON lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict

from parity.suite import Job, ScenarioResult, run_job

Progress = Callable[[Job, ScenarioResult], None]


def needs_worker(job: Job) -> bool:
    """Whether `job` cannot run in this process (int64 without x64 mode)."""
    import jax

    return job.dtype == "int64" and not jax.config.read("jax_enable_x64")


def worker_env(device: str) -> dict[str, str]:
    """The environment of the x64 worker."""
    env = dict(os.environ, JAX_ENABLE_X64="1")
    if device == "cuda":  # two JAX processes share the GPU: no 75% preallocation each
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def _failed(job: Job, why: str) -> ScenarioResult:
    """A result for a job the worker never reported (it died): counted as failing."""
    return ScenarioResult(
        job.scenario,
        job.dtype,
        job.debug,
        0,
        0,
        1,
        False,
        first_divergence=f"worker process: {why}",
    )


def run_jobs(jobs: Sequence[Job], progress: Progress | None = None) -> list[ScenarioResult]:
    """Run every job; results in the order of `jobs`."""
    results: list[ScenarioResult | None] = [None] * len(jobs)
    remote = [i for i, j in enumerate(jobs) if needs_worker(j)]
    lock = threading.Lock()

    def done(i: int, r: ScenarioResult) -> None:
        with lock:
            results[i] = r
            if progress is not None:
                progress(jobs[i], r)

    thread = None
    if remote:
        proc = subprocess.Popen(
            [sys.executable, "-m", "parity.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=worker_env(jobs[remote[0]].device),
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps([asdict(jobs[i]) for i in remote]))
        proc.stdin.close()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                msg = json.loads(line)
                done(remote[msg["index"]], ScenarioResult(**msg["result"]))
            code = proc.wait()
            for i in remote:
                if results[i] is None:
                    done(i, _failed(jobs[i], f"exited with status {code}"))

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
    for i, job in enumerate(jobs):
        if i not in remote:
            done(i, run_job(job))
    if thread is not None:
        thread.join()
    return [r for r in results if r is not None]
