"""Runs a list of Jobs: here when this process's JAX can, else in worker processes.

int64 jobs need JAX's x64 mode, a process-wide setting fixed before JAX starts. Unless
this process already has it, they run in `python -m parity.worker` started with
JAX_ENABLE_X64=1. Mesh jobs (dp * tp > 1) need that many devices; on CPU that is
XLA_FLAGS=--xla_force_host_platform_device_count=N, also fixed before JAX starts, so they
run in a worker started with it. Workers run concurrently with the local jobs; their
results stream back as JSON lines. Jobs over several processes go to `parity.dist_run`,
one launch per kind of worker they need.
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

from parity.dist_run import run_dist_jobs
from parity.suite import Job, ScenarioResult, failed, run_job

Progress = Callable[[Job, ScenarioResult], None]

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


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
        flag = f"{HOST_DEVICES_FLAG}={mesh_devices}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    return env


def run_jobs(jobs: Sequence[Job], progress: Progress | None = None) -> list[ScenarioResult]:
    """Run every job; results in the order of `jobs`."""
    results: list[ScenarioResult | None] = [None] * len(jobs)
    groups: dict[tuple[bool, int], list[int]] = {}
    dist: dict[tuple[Any, ...], list[int]] = {}
    for i, job in enumerate(jobs):
        if job.processes > 1:
            dist.setdefault(dist_key(job), []).append(i)
        elif (key := worker_key(job)) is not None:
            groups.setdefault(key, []).append(i)
    lock = threading.Lock()

    def done(i: int, r: ScenarioResult) -> None:
        with lock:
            results[i] = r
            if progress is not None:
                progress(jobs[i], r)

    def start(key: tuple[bool, int], remote: list[int]) -> threading.Thread:
        x64, devices = key
        proc = subprocess.Popen(
            [sys.executable, "-m", "parity.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=worker_env(jobs[remote[0]].device, x64=x64, mesh_devices=devices),
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
                    done(i, failed(jobs[i], f"worker process exited with status {code}"))

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return thread

    threads = [start(key, remote) for key, remote in groups.items()]
    for i, job in enumerate(jobs):
        if job.processes == 1 and worker_key(job) is None:
            done(i, run_job(job))
    for remote in dist.values():
        with tempfile.TemporaryDirectory(prefix="fm-parity-dist-") as workdir:
            for i, r in zip(remote, run_dist_jobs([jobs[i] for i in remote], workdir), strict=True):
                done(i, r)
    for thread in threads:
        thread.join()
    return [r for r in results if r is not None]


def dist_key(job: Job) -> tuple[Any, ...]:
    """Jobs with the same key share one launch of worker processes."""
    return (job.processes, job.dp, job.tp, job.dtype == "int64", job.device)
