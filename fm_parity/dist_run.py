"""Data-parallel ranks across processes: parity jobs under `jax.distributed` on loopback.

`launch` starts N worker processes on 127.0.0.1 (a free port), each with its own CPU
devices and gloo collectives; together they form one ('dp', 'tp') mesh and one sharded
fm_jax map, and each runs the one overlap driver (fm_parity.driver) over the DP ranks whose
devices it holds, saving its part of the trace. Every step the workers agree on the
per-rank padded sizes with one all-gather (the DP batch-size sync an engine does anyway);
that collective is where a dead peer shows: a worker whose sync fails or stalls prints
which peers stopped heartbeating (each worker's count of syncs, in a file in the out dir)
and exits non-zero at once instead of hanging.

`run_dist_jobs` merges each job's parts into one run and judges it like every other job
(fm_parity.suite.evaluate): against fm_torch over every rank, run here, byte for byte, and
against the reference loop.

Run a worker by hand: `python -m fm_parity.dist_run --process-id 0 --num-processes 2 --port P
--jobs JOBS.json --out-dir DIR` (JOBS.json: a list of fm_parity.suite.Job fields).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fm_parity.host_devices import with_host_devices
from fm_parity.mesh import merge_reports
from fm_parity.suite import Job, ScenarioResult, evaluate, failed, lanes_for
from fm_parity.trace import RunResult, merge
from fm_parity.twin import Sizes

EXIT_PEER_FAILED = 3
"""Worker exit status when a DP sync failed or timed out (a peer died or hung)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------- worker
class DpSync:
    """Agree each step's per-rank padded sizes across processes, with heartbeats and a watchdog.

    A `fm_parity.driver.Sync`. Each call publishes this process's heartbeat (its count of
    syncs, printed as 'step N') as a file in `heartbeat_dir`, then all-gathers (rows,
    tokens, running). If the all-gather raises (gloo sees a closed connection) or takes
    longer than `timeout_s`, the worker reads its peers' heartbeats, reports those that lag
    and exits with EXIT_PEER_FAILED, skipping JAX's shutdown barrier (which would wait for
    the dead peer). Assumes every process sees `heartbeat_dir` (one machine, as `launch`
    runs them) and that it holds no heartbeat of another run.
    """

    def __init__(
        self,
        process_id: int,
        num_processes: int,
        timeout_s: float,
        delay_s: float,
        heartbeat_dir: str | Path,
    ):
        self.pid, self.n = process_id, num_processes
        self.timeout_s, self.delay_s = timeout_s, delay_s
        self.heartbeat_dir = Path(heartbeat_dir)
        self.calls = 0

    def _beat(self, count: int) -> None:
        """Publish `count` as this process's heartbeat: written whole to a temp file, then
        renamed over the last one, so a reader sees the old count or the new, never a part."""
        path = _heartbeat_path(self.heartbeat_dir, self.pid)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(count))
        os.replace(tmp, path)

    def _lagging(self, count: int) -> str:
        """The peers whose heartbeat is below `count` (this process's), with their last one."""
        out = []
        for p in range(self.n):
            if p == self.pid:
                continue
            try:
                got = int(_heartbeat_path(self.heartbeat_dir, p).read_text())
            except FileNotFoundError:  # the peer never reached its first sync
                out.append(f"process {p} (no heartbeat)")
                continue
            if got < count:
                out.append(f"process {p} (last heartbeat at step {got})")
        return ", ".join(out) or "none lagging (a peer failed inside the collective)"

    def _fail(self, count: int, why: str) -> None:
        msg = (
            f"fm-parity dist: process {self.pid}: DP sync at step {count} {why}; "
            f"dead or hung peers: {self._lagging(count)}"
        )
        print(msg, file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILED)

    def __call__(self, step: int, sizes: Sizes, running: bool) -> tuple[Sizes, bool]:
        from jax.experimental import multihost_utils

        if self.delay_s:
            time.sleep(self.delay_s)
        self.calls += 1
        n = self.calls
        self._beat(n)
        timer = threading.Timer(
            self.timeout_s, self._fail, (n, f"timed out after {self.timeout_s:.0f} s")
        )
        timer.daemon = True
        timer.start()
        try:
            mine = np.array([sizes.rows, sizes.tokens, int(running)])
            got = np.asarray(multihost_utils.process_allgather(mine))
        except Exception as e:  # gloo: connection closed by a dead peer
            self._fail(n, f"failed ({type(e).__name__}: {str(e).splitlines()[0]})")
        finally:
            timer.cancel()
        print(f"step {n}", flush=True)
        m = got.reshape(-1, 3).max(axis=0)
        return Sizes(int(m[0]), int(m[1])), bool(m[2])


def _heartbeat_path(out_dir: Path, process: int) -> Path:
    return out_dir / f"process{process}.heartbeat"


def _part_path(out_dir: Path, job: int, process: int) -> Path:
    return out_dir / f"job{job}.process{process}.pkl"


def worker(args: argparse.Namespace) -> int:
    """One process of a distributed run: join, run every job over its ranks, save each part."""
    os.environ.update(with_host_devices(os.environ, args.devices))
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=int(max(args.timeout, 30)),
        # JAX's own detection stays behind the DP sync's watchdog, which names the peer.
        heartbeat_timeout_seconds=int(2 * args.timeout + 10),
        shutdown_timeout_seconds=int(max(args.timeout, 30)),
    )
    from fm_parity.driver import run_overlap
    from fm_parity.mutations import FlipByte
    from fm_parity.twin import Twin
    from fm_parity.twin_jax import JaxTwin

    jobs = [Job(**j) for j in json.loads(Path(args.jobs).read_text())]
    sync = DpSync(args.process_id, args.num_processes, args.timeout, args.step_delay, args.out_dir)
    for i, job in enumerate(jobs):
        lanes = lanes_for(job)
        twin = JaxTwin(
            lanes[0],
            job.dtype,
            job.debug,
            "cpu",
            dp=job.dp,
            tp=job.tp,
            protocol=job.protocol,
            spec_kernel=job.spec_kernel,
        )
        driven: Twin = twin if args.corrupt is None else FlipByte(twin, *args.corrupt)
        mine = {r: lanes[r] for r in twin.ranks}
        try:
            run = run_overlap(mine, driven, job.dtype, job.steps, sync=sync)
            report = twin.mesh_report()
        except Exception as e:  # kept as the job's error; the next job still runs
            print(f"job {i}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            run = RunResult(error=f"{type(e).__name__}: {e}")  # fails the job when judged
            report = {"recompiles": 0, "compiles_total": 0, "collectives": {}, "resharded": False}
        with open(_part_path(Path(args.out_dir), i, args.process_id), "wb") as f:
            pickle.dump((run, report), f)
        print(f"done job {i} ranks={list(twin.ranks)}", flush=True)
    jax.distributed.shutdown()
    return 0


# ------------------------------------------------------------------------------- launcher
@dataclass
class DistResult:
    """What the processes of one distributed run left behind.

    Attributes:
      returncodes, logs: each process's exit status and output.
      timed_out: some process outlived the run's bound and was killed.
      parts: per job, the (run, mesh health report) each process saved, in process order.
      seconds: the run's wall time.
    """

    returncodes: list[int | None]
    logs: list[str]
    timed_out: bool
    parts: list[list[tuple[RunResult, dict[str, Any]]]] = field(default_factory=list)
    seconds: float = 0.0

    def problem(self) -> str | None:
        """Why the run did not end cleanly (a timeout, a failed process), or None."""
        if self.timed_out:
            return "timed out: " + self._tails()
        if any(code != 0 for code in self.returncodes):
            return f"process exit statuses {self.returncodes}: " + self._tails()
        return None

    def _tails(self) -> str:
        return " | ".join(
            f"process {i}: {log.strip().splitlines()[-1] if log.strip() else '(no output)'}"
            for i, (code, log) in enumerate(zip(self.returncodes, self.logs, strict=True))
            if code != 0
        )


def launch(
    jobs: Sequence[Job],
    num_processes: int,
    *,
    devices: int = 1,
    workdir: str | Path,
    timeout_s: float | None = None,
    sync_timeout_s: float = 30.0,
    step_delay_s: float = 0.0,
    kill: tuple[int, int] | None = None,
    kill_signal: int = signal.SIGKILL,
    corrupt: tuple[int, int] | None = None,
) -> DistResult:
    """Run `jobs` on `num_processes` processes x `devices` CPU devices each.

    Args:
      jobs: the jobs, in order; each job's dp * tp must be num_processes * devices, and a
        process should hold whole TP groups (devices a multiple of tp).
      num_processes: processes to start; process 0 hosts the coordinator.
      devices: CPU devices per process.
      workdir: where the job list, the processes' heartbeats and their parts are written.
      timeout_s: wall-clock bound for the whole run (default 60 s + 30 s a job); processes
        still alive then are killed.
      sync_timeout_s: a worker's bound on one DP sync before it declares peers dead.
      step_delay_s: sleep per step (keeps a run alive long enough to kill a process).
      kill: (process_id, n): signal that process once it has printed 'step <n>'.
      kill_signal: SIGKILL (a dead peer) by default; SIGSTOP makes a hung one.
      corrupt: (rank, step): flip one byte of that DP rank's buffer after that step's
        stash (fm_parity.mutations.FlipByte), in whichever process holds the rank.

    Returns:
      DistResult; processes are always gone when it returns (killed if need be).
    """
    for job in jobs:
        if job.dp * job.tp != num_processes * devices:
            raise ValueError(
                f"{job.scenario}: dp={job.dp} x tp={job.tp} is not {num_processes} processes "
                f"x {devices} devices"
            )
    work = Path(workdir)
    for stale in work.glob("process*.heartbeat"):  # a heartbeat here is this run's
        stale.unlink()
    (work / "jobs.json").write_text(json.dumps([asdict(j) for j in jobs]))
    port = free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["JAX_PLATFORMS"] = "cpu"  # gloo over host devices, also on a GPU machine
    if any(j.dtype == "int64" for j in jobs):
        env["JAX_ENABLE_X64"] = "1"
    else:
        env.pop("JAX_ENABLE_X64", None)
    procs: list[subprocess.Popen[str]] = []
    logs: list[list[str]] = [[] for _ in range(num_processes)]
    killed = threading.Event()

    def pump(i: int, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            logs[i].append(line)
            if kill and i == kill[0] and line.strip() == f"step {kill[1]}" and not killed.is_set():
                killed.set()
                p.send_signal(kill_signal)

    t0 = time.monotonic()
    timed_out = False
    threads = []
    try:
        for i in range(num_processes):
            cmd = [
                sys.executable,
                "-m",
                "fm_parity.dist_run",
                f"--process-id={i}",
                f"--num-processes={num_processes}",
                f"--port={port}",
                f"--devices={devices}",
                f"--jobs={work / 'jobs.json'}",
                f"--out-dir={work}",
                f"--timeout={sync_timeout_s}",
                f"--step-delay={step_delay_s}",
            ]
            if corrupt is not None:
                cmd.append(f"--corrupt={corrupt[0]},{corrupt[1]}")
            p = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            procs.append(p)
            th = threading.Thread(target=pump, args=(i, p), daemon=True)
            th.start()
            threads.append(th)
        deadline = t0 + (60 + 30 * len(jobs) if timeout_s is None else timeout_s)
        while True:
            # Done when every process not deliberately killed or stopped has exited.
            waiting = [
                i
                for i, p in enumerate(procs)
                if p.poll() is None and not (killed.is_set() and kill and i == kill[0])
            ]
            if not waiting:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for th in threads:
            th.join(timeout=5)
    res = DistResult([p.returncode for p in procs], ["".join(lg) for lg in logs], timed_out)
    res.seconds = time.monotonic() - t0
    for i in range(len(jobs)):
        paths = [_part_path(work, i, p) for p in range(num_processes)]
        res.parts.append([_load(path) for path in paths if path.exists()])
    return res


def _load(path: Path) -> tuple[RunResult, dict[str, Any]]:
    with open(path, "rb") as f:
        got: tuple[RunResult, dict[str, Any]] = pickle.load(f)  # written by our own workers
    return got


def run_dist_jobs(
    jobs: Sequence[Job], workdir: str | Path, **launch_kw: Any
) -> list[ScenarioResult]:
    """Run jobs over several processes (one launch: `jobs[0]`'s processes, dp and tp) and
    judge each like any other job (`judge`)."""
    first = jobs[0]
    devices = first.dp * first.tp // first.processes
    return judge(jobs, launch(jobs, first.processes, devices=devices, workdir=workdir, **launch_kw))


def judge(jobs: Sequence[Job], res: DistResult) -> list[ScenarioResult]:
    """Each job's per-process parts merged into one fm_jax run, compared with fm_torch over
    every rank (run here) and checked against the reference loop; their mesh health
    reports merged. A job some process left no part for fails, naming why."""
    from fm_parity.driver import run_overlap
    from fm_parity.twin_torch import TorchTwin

    out = []
    for job, parts in zip(jobs, res.parts, strict=True):
        if len(parts) != job.processes:
            why = res.problem() or "a process left no result"
            out.append(failed(job, f"{len(parts)} of {job.processes} processes finished: {why}"))
            continue
        lanes = lanes_for(job)
        torch = TorchTwin(
            lanes[0],
            job.dtype,
            job.debug,
            job.device,
            ranks=tuple(lanes),
            protocol=job.protocol,
        )
        runs = {
            "jax": merge([run for run, _ in parts]),
            "torch": run_overlap(lanes, torch, job.dtype, job.steps),
        }
        out.append(evaluate(job, lanes, runs, merge_reports([rep for _, rep in parts])))
    return out


def _pair(text: str) -> tuple[int, int]:
    """argparse type: 'a,b' -> (a, b)."""
    a, b = text.split(",")
    return int(a), int(b)


def main(argv: list[str] | None = None) -> int:
    """Entry point of one worker process (see `launch`)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--corrupt", type=_pair, default=None, metavar="RANK,STEP")
    return worker(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
