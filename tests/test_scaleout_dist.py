"""Data-parallel ranks across processes: jax.distributed on 127.0.0.1 with gloo.

Each test starts its worker processes itself (`parity.dist_run.launch`), bounds the run's
wall time and always kills what is left. The reference is the single-process run: one
unsharded map per DP rank (`parity.mesh_run.run_unsharded`), which the 8-device tests
(test_scaleout_mesh.py) show equal to the single-process sharded run byte for byte.
"""

from __future__ import annotations

import signal

import pytest

from parity.dist_run import EXIT_PEER_FAILED, launch
from parity.mesh_run import compare, run_unsharded
from parity.mesh_scenario import data_parallel_scenario

STEPS = 8


def _assert_union_matches(res, dp: int) -> None:
    assert not res.timed_out, res.logs
    assert res.returncodes == [0] * len(res.returncodes), "\n".join(res.logs)
    union = res.union()
    assert {d for _, d in union} == set(range(dp))  # every rank came from some process
    ref = run_unsharded(data_parallel_scenario(dp, steps=STEPS))
    diffs = compare(ref, union)
    assert not diffs, diffs[:5]


def test_two_processes_union_of_traces_equals_single_process_run(tmp_path):
    """Pins: a process feeding (or reading back) another process's ranks, two processes
    padding to different per-rank sizes, or a rank's pool differing from the single-process
    run by any byte (2 processes x 2 devices: DP=4, each process owns 2 ranks)."""
    res = launch(2, devices=2, tp=1, steps=STEPS, workdir=tmp_path, timeout_s=120)
    _assert_union_matches(res, dp=4)
    assert "done ranks=[0, 1]" in res.logs[0] and "done ranks=[2, 3]" in res.logs[1]


@pytest.mark.slow
def test_four_processes_with_tensor_parallel_groups(tmp_path):
    """Pins: the same with TP inside each process (4 processes x 2 devices, TP=2, DP=4: one
    rank per process, its pool replicated on both of the process's devices)."""
    res = launch(4, devices=2, tp=2, steps=STEPS, workdir=tmp_path, timeout_s=150)
    _assert_union_matches(res, dp=4)
    for i in range(4):
        assert f"done ranks=[{i}]" in res.logs[i]


def test_dead_peer_makes_the_survivor_exit_with_a_clear_error(tmp_path):
    """Pins: a survivor hanging forever (or exiting 0) when a peer process is SIGKILLed
    mid-run; it must exit EXIT_PEER_FAILED within the bound, naming the dead process."""
    res = launch(
        2,
        steps=40,
        step_delay_s=0.2,
        kill=(1, 3),
        workdir=tmp_path,
        timeout_s=60,
        sync_timeout_s=20,
    )
    assert not res.timed_out, res.logs
    assert res.returncodes[1] == -signal.SIGKILL
    assert res.returncodes[0] == EXIT_PEER_FAILED, res.logs[0]
    assert "process 1 (last heartbeat at step 3)" in res.logs[0], res.logs[0]
    assert "failed" in res.logs[0]
    assert res.seconds < 60


def test_hung_peer_trips_the_sync_watchdog(tmp_path):
    """Pins: a survivor blocking forever in the DP all-gather when a peer is alive but stuck
    (SIGSTOP: no closed connection to notice); the watchdog must end it, naming the peer."""
    res = launch(
        2,
        steps=40,
        step_delay_s=0.2,
        kill=(1, 3),
        kill_signal=signal.SIGSTOP,
        workdir=tmp_path,
        timeout_s=60,
        sync_timeout_s=4,
    )
    assert not res.timed_out, res.logs
    assert res.returncodes[0] == EXIT_PEER_FAILED, res.logs[0]
    assert "timed out after 4 s" in res.logs[0], res.logs[0]
    assert "process 1 (last heartbeat at step 3)" in res.logs[0], res.logs[0]
