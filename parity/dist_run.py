"""Data-parallel ranks across processes: the DP scenario under `jax.distributed` on loopback.

`launch` starts N worker processes on 127.0.0.1 (a free port), each with its own CPU
devices and gloo collectives; together they form one ('dp', 'tp') mesh and each feeds
only the DP ranks whose devices it holds. Every step the workers agree on the per-rank
padded sizes with one all-gather (the DP batch-size sync an engine does anyway); that
collective is where a dead peer shows: a worker whose sync fails or stalls prints which
peers stopped heartbeating and exits non-zero at once instead of hanging.

Run a worker by hand: `python -m parity.dist_run --process-id 0 --num-processes 2 --port P`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

EXIT_PEER_FAILED = 3
"""Worker exit status when a DP sync failed or timed out (a peer died or hung)."""

_HEARTBEAT_KEY = "fm_parity/heartbeat/"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------------- worker
class PeerFailure(RuntimeError):
    """A cross-process DP sync failed or timed out."""


class DpSync:
    """Agree per-rank padded sizes across processes, with heartbeats and a watchdog.

    Each call publishes this process's heartbeat (its step) in the coordination service's
    key-value store, then all-gathers (rows, tokens). If the all-gather raises (gloo sees a
    closed connection) or takes longer than `timeout_s`, the worker reports the peers whose
    heartbeat lags and exits with EXIT_PEER_FAILED, skipping JAX's shutdown barrier (which
    would wait for the dead peer).
    """

    def __init__(self, process_id: int, num_processes: int, timeout_s: float, delay_s: float):
        from jax._src import distributed

        self.pid, self.n, self.timeout_s, self.delay_s = (
            process_id,
            num_processes,
            timeout_s,
            delay_s,
        )
        self.client = distributed.global_state.client

    def _lagging(self, step: int) -> str:
        out = []
        for p in range(self.n):
            if p == self.pid:
                continue
            try:
                got = self.client.key_value_try_get(f"{_HEARTBEAT_KEY}{p}")
            except Exception:  # the coordinator itself (process 0) may be the dead one
                return "coordinator (process 0) unreachable"
            if int(got) < step:
                out.append(f"process {p} (last heartbeat at step {got})")
        return ", ".join(out) or "none lagging (a peer failed inside the collective)"

    def _fail(self, step: int, why: str) -> None:
        msg = (
            f"fm-parity dist: process {self.pid}: DP sync at step {step} {why}; "
            f"dead or hung peers: {self._lagging(step)}"
        )
        print(msg, file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILED)

    def __call__(self, step: int, rows: int, tokens: int) -> tuple[int, int]:
        from jax.experimental import multihost_utils

        from fm_jax import pad_to_bucket

        if self.delay_s:
            time.sleep(self.delay_s)
        self.client.key_value_set(f"{_HEARTBEAT_KEY}{self.pid}", str(step), allow_overwrite=True)
        timer = threading.Timer(
            self.timeout_s, self._fail, (step, f"timed out after {self.timeout_s:.0f} s")
        )
        timer.daemon = True
        timer.start()
        try:
            got = np.asarray(multihost_utils.process_allgather(np.array([rows, tokens])))
        except Exception as e:  # gloo: connection closed by a dead peer
            self._fail(step, f"failed ({type(e).__name__}: {str(e).splitlines()[0]})")
        finally:
            timer.cancel()
        print(f"step {step}", flush=True)
        m = got.reshape(-1, 2).max(axis=0)
        # The map's default buckets: powers of two (rows up to 1024, tokens up to 8192).
        return (
            pad_to_bucket(np.zeros(max(int(m[0]), 1))).shape[0],
            pad_to_bucket(np.zeros(max(int(m[1]), 1))).shape[0],
        )


def worker(args: argparse.Namespace) -> int:
    """One process of a distributed run: join, replay its ranks, save their trace."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
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
    from parity.mesh_run import make_mesh, run_sharded
    from parity.mesh_scenario import data_parallel_scenario

    n_dev = len(jax.devices())
    dp = n_dev // args.tp
    scn = data_parallel_scenario(dp, pool_size=args.pool_size, steps=args.steps, seed=args.seed)
    sync = DpSync(args.process_id, args.num_processes, args.timeout, args.step_delay)
    run = run_sharded(scn, make_mesh(dp, args.tp, jax.devices()), tp_axis="tp", sizes=sync)
    flat = {
        f"{s}|{d}|{name}": arr
        for (s, d), arrays in run.trace.items()
        for name, arr in arrays.items()
    }
    np.savez(args.out, **flat)  # type: ignore[arg-type]
    print(f"done ranks={sorted({d for _, d in run.trace})}", flush=True)
    jax.distributed.shutdown()
    return 0


def load_trace(path: str | Path) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """Read a worker's saved trace back into the `parity.mesh_run.Trace` form."""
    out: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    with np.load(path) as z:
        for key in z.files:
            s, d, name = key.split("|")
            out.setdefault((int(s), int(d)), {})[name] = z[key]
    return out


# ------------------------------------------------------------------------------- launcher
@dataclass
class DistResult:
    """What the processes of one distributed run left behind."""

    returncodes: list[int | None]
    logs: list[str]
    timed_out: bool  # some process outlived `timeout_s` and was killed
    traces: list[dict[tuple[int, int], dict[str, np.ndarray]]] = field(default_factory=list)
    seconds: float = 0.0

    def union(self) -> dict[tuple[int, int], dict[str, np.ndarray]]:
        """All processes' traces together; a (step, rank) seen twice must agree."""
        out: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        for t in self.traces:
            for k, v in t.items():
                if k in out and any(out[k][n].tobytes() != v[n].tobytes() for n in v):
                    raise AssertionError(f"processes disagree on step {k[0]} rank {k[1]}")
                out[k] = v
        return out


def launch(
    num_processes: int,
    *,
    devices: int = 1,
    tp: int = 1,
    steps: int = 8,
    pool_size: int = 8,
    seed: int = 0,
    workdir: str | Path,
    timeout_s: float = 120.0,
    sync_timeout_s: float = 30.0,
    step_delay_s: float = 0.0,
    kill: tuple[int, int] | None = None,
    kill_signal: int = signal.SIGKILL,
) -> DistResult:
    """Run the DP scenario on `num_processes` processes x `devices` CPU devices each.

    Args:
      num_processes: processes to start; process 0 hosts the coordinator.
      devices: CPU devices per process; the mesh is (processes*devices/tp, tp).
      tp: TP size (a process's devices should hold whole TP groups).
      steps, pool_size, seed: the scenario (`data_parallel_scenario`).
      workdir: where traces are written.
      timeout_s: wall-clock bound for the whole run; processes still alive then are killed.
      sync_timeout_s: a worker's bound on one DP sync before it declares peers dead.
      step_delay_s: sleep per step (keeps a run alive long enough to kill a process).
      kill: (process_id, step): signal that process once it has printed 'step <step>'.
      kill_signal: SIGKILL (a dead peer) by default; SIGSTOP makes a hung one.

    Returns:
      DistResult; processes are always gone when it returns (killed if need be). A
      process still running at `timeout_s` is killed and `timed_out` set.
    """
    port = free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONUNBUFFERED"] = "1"
    procs: list[subprocess.Popen[str]] = []
    logs: list[list[str]] = [[] for _ in range(num_processes)]
    killed = threading.Event()
    outs = [Path(workdir) / f"trace_{i}.npz" for i in range(num_processes)]

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
                "parity.dist_run",
                f"--process-id={i}",
                f"--num-processes={num_processes}",
                f"--port={port}",
                f"--devices={devices}",
                f"--tp={tp}",
                f"--steps={steps}",
                f"--pool-size={pool_size}",
                f"--seed={seed}",
                f"--timeout={sync_timeout_s}",
                f"--step-delay={step_delay_s}",
                f"--out={outs[i]}",
            ]
            p = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            procs.append(p)
            th = threading.Thread(target=pump, args=(i, p), daemon=True)
            th.start()
            threads.append(th)
        deadline = t0 + timeout_s
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
    res.traces = [load_trace(o) for o in outs if o.exists()]
    return res


def main(argv: list[str] | None = None) -> int:
    """Entry point of one worker process (see `launch`)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pool-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--out", required=True)
    return worker(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())


__all__: list[Any] = ["DistResult", "launch", "load_trace", "free_port", "main"]
