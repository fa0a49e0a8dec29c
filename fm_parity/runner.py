"""Runs a list of Jobs: here when this process's JAX can, else in worker processes.

int64 jobs need JAX's x64 mode, a process-wide setting fixed before JAX starts. Unless
this process already has it, they run in `python -m fm_parity.worker` started with
JAX_ENABLE_X64=1. Mesh jobs (dp * tp > 1) need that many devices; on CPU that is
XLA_FLAGS=--xla_force_host_platform_device_count=N, also fixed before JAX starts, so they
run in a worker started with it. Workers run concurrently with the local jobs, or, asked
for several, run every job side by side; each is fed one job at a time and answers with a
JSON line. Jobs over several processes go to `fm_parity.dist_run`, one launch per kind of
worker they need.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from fm_parity.dist_run import run_dist_jobs
from fm_parity.host_devices import with_host_devices
from fm_parity.suite import Job, ScenarioResult, failed, run_job

Progress = Callable[[Job, ScenarioResult], None]


def worker_key(job: Job) -> tuple[bool, int] | None:
    """None if `job` runs here, else the worker it needs: (x64 mode, mesh devices or 0).

    Jobs over several processes are not run by these workers (see `run_jobs`)."""
    import jax

    x64 = job.dtype == "int64"
    if job.mesh:
        return (x64, job.dp * job.tp)
    if x64 and not jax.config.read("jax_enable_x64"):
        return (True, 0)
    return None


def worker_env(device: str, *, x64: bool = True, mesh_devices: int = 0) -> dict[str, str]:
    """The environment of a worker: x64 mode on if asked; on CPU, JAX pinned to the CPU
    platform (a GPU machine's default backend is its GPU) and `mesh_devices` host devices
    (appended to any XLA_FLAGS: the last occurrence of a flag wins)."""
    env = dict(os.environ)
    if x64:
        env["JAX_ENABLE_X64"] = "1"
    if device == "cuda":  # JAX processes share the GPUs: no 75% preallocation each
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        return env
    env["JAX_PLATFORMS"] = "cpu"
    if mesh_devices:
        env = with_host_devices(env, mesh_devices)
    return env


def run_jobs(
    jobs: Sequence[Job], progress: Progress | None = None, workers: int = 1
) -> list[ScenarioResult]:
    """Run every job; results in the order of `jobs`.

    `workers` = 1: jobs this process's JAX can run run here, one after another, and each
    other kind of job (`worker_key`) runs in one worker process of its kind, concurrently
    with them. `workers` > 1: every job of one process runs in a worker, up to `workers`
    of them at once (each kind gets a share, at least one); a worker takes its next job
    when it finishes one, the costliest first (`cost`), so the longest runs do not end
    the run alone. Jobs over several processes run last, one launch per `dist_key`.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    results: list[ScenarioResult | None] = [None] * len(jobs)
    queues: dict[tuple[bool, int], list[int]] = {}
    local: list[int] = []
    dist: dict[tuple[Any, ...], list[int]] = {}
    for i, job in enumerate(jobs):
        if job.processes > 1:
            dist.setdefault(dist_key(job), []).append(i)
        elif (key := worker_key(job)) is not None:
            queues.setdefault(key, []).append(i)
        elif workers > 1:
            queues.setdefault((job.dtype == "int64", 0), []).append(i)
        else:
            local.append(i)
    lock = threading.Lock()

    def done(i: int, r: ScenarioResult) -> None:
        with lock:
            results[i] = r
            if progress is not None:
                progress(jobs[i], r)

    def take(queue: list[int]) -> int | None:
        with lock:
            return queue.pop(0) if queue else None

    def serve(key: tuple[bool, int], queue: list[int]) -> None:
        """Worker processes of kind `key`, fed jobs from `queue` one at a time; a worker
        that dies fails the job it held, and a fresh one takes the next."""
        x64, devices = key
        proc: subprocess.Popen[str] | None = None
        while (i := take(queue)) is not None:
            if proc is None:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "fm_parity.worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=worker_env(jobs[i].device, x64=x64, mesh_devices=devices),
                )
            assert proc.stdin is not None and proc.stdout is not None
            line = ""
            try:
                proc.stdin.write(json.dumps({"index": i, "job": asdict(jobs[i])}) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except BrokenPipeError:
                pass
            if line:
                done(i, ScenarioResult(**json.loads(line)["result"]))
                continue
            code = proc.wait()
            done(i, failed(jobs[i], f"worker process exited with status {code}"))
            proc = None
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait()

    for queue in queues.values():
        queue.sort(key=lambda i: -cost(jobs[i]))
    total = sum(len(q) for q in queues.values())
    threads = []
    for key, queue in queues.items():
        share = 1 if workers == 1 else max(1, round(workers * len(queue) / total))
        for _ in range(min(share, len(queue))):
            threads.append(threading.Thread(target=serve, args=(key, queue), daemon=True))
    for thread in threads:
        thread.start()
    for i in local:
        done(i, run_job(jobs[i]))
    for remote in dist.values():
        with tempfile.TemporaryDirectory(prefix="fm-parity-dist-") as workdir:
            for i, r in zip(remote, run_dist_jobs([jobs[i] for i in remote], workdir), strict=True):
                done(i, r)
    for thread in threads:
        thread.join()
    return [r for r in results if r is not None]


def cost(job: Job) -> int:
    """A job's rough cost, to start the longest first: the tokens its requests prefill and
    generate (what its steps scale with), times its DP ranks."""
    from fm_parity.catalogue import build

    scenario = build(job.scenario, size=job.size, seed=job.seed)
    return job.dp * sum(r.prompt_len + r.output_len for r in scenario.requests)


def dist_key(job: Job) -> tuple[Any, ...]:
    """Jobs with the same key share one launch of worker processes."""
    return (job.processes, job.dp, job.tp, job.dtype == "int64", job.device)
