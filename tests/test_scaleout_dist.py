"""Data-parallel ranks across processes: jax.distributed on 127.0.0.1 with gloo.

Each test starts its worker processes itself (`fm_parity.dist_run`), bounds the run's wall
time and always kills what is left. A run over processes is judged like every parity
job (fm_parity.suite.evaluate): the union of the workers' traces, each DP rank from the
process that holds it, against fm_torch's map for each rank, byte for byte, and every
rank's streams against the reference loop (docs/CONTRACT.md, 'What parity compares').
"""

from __future__ import annotations

import signal

import pytest

from fm_parity.dist_run import EXIT_PEER_FAILED, DpSync, judge, launch, run_dist_jobs
from fm_parity.scenario import Kind, Scheduler
from fm_parity.suite import Job, lanes_for

STEPS = 8


def _job(processes: int, dp: int, tp: int, scenario: str = "dp_overlap", steps: int = STEPS):
    return Job(scenario, "int32", False, steps=steps, dp=dp, tp=tp, processes=processes)


def test_two_processes_union_of_traces_matches_torch_on_every_rank(tmp_path):
    """Pins: a process feeding (or reading back) another process's ranks, two processes
    padding to different per-rank sizes, or a rank's pool differing from fm_torch's map for
    that rank by any byte (2 processes x 2 devices: DP=4, each process owns 2 ranks)."""
    job = _job(2, 4, 1)
    res = launch([job], 2, devices=2, workdir=tmp_path, timeout_s=120)
    assert res.problem() is None, res.logs
    assert "done job 0 ranks=[0, 1]" in res.logs[0] and "done job 0 ranks=[2, 3]" in res.logs[1]
    [r] = judge([job], res)
    assert r.ok, (r.first_divergence, r.oracle_failures, r.failures, r.errors)
    assert r.processes == 2 and (r.dp, r.tp) == (4, 1) and r.steps == STEPS
    assert r.ops_compared > 4 * STEPS and r.extra["recompiles"] == 0


@pytest.mark.slow
def test_four_processes_with_tensor_parallel_groups(tmp_path):
    """Pins: the same with TP inside each process (4 processes x 2 devices, TP=2, DP=4: one
    rank per process, its pool replicated on both of the process's devices)."""
    job = _job(4, 4, 2)
    res = launch([job], 4, devices=2, workdir=tmp_path, timeout_s=150)
    assert res.problem() is None, res.logs
    for i in range(4):
        assert f"done job 0 ranks=[{i}]" in res.logs[i]
    [r] = judge([job], res)
    assert r.ok, (r.first_divergence, r.oracle_failures, r.failures, r.errors)


def test_one_flipped_byte_in_one_workers_rank_is_reported_where_it_is(tmp_path):
    """Pins: the shared comparer missing a one-byte difference that one worker process's
    rank holds, or reporting it without its rank, step, op, field and slot."""
    rank = 3  # held by process 1
    sched = Scheduler(lanes_for(_job(2, 4, 1))[rank])
    while (plan := sched.next_step()) is not None:
        if plan.step >= 3 and plan.kind is not Kind.IDLE:
            break
    assert plan is not None
    [r] = run_dist_jobs([_job(2, 4, 1)], tmp_path, timeout_s=120, corrupt=(rank, plan.step))
    assert not r.ok and r.divergences >= 1
    where = (
        f"rank {rank}, step {plan.step}, op stash, field output_tokens, slot {plan.rows[0].slot}"
    )
    assert r.first_divergence is not None and where in r.first_divergence, r.first_divergence


def test_heartbeats_name_the_lagging_peers(tmp_path):
    """Pins: a peer's heartbeat file misread, or a peer at this process's step, past it or
    without a heartbeat named wrongly (the files each worker writes in the out dir)."""
    syncs = [DpSync(p, 4, 30.0, 0.0, tmp_path) for p in range(4)]
    syncs[1]._beat(3)
    syncs[2]._beat(4)
    syncs[0]._beat(4)
    syncs[0]._beat(5)
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "process0.heartbeat",
        "process1.heartbeat",
        "process2.heartbeat",
    ]
    assert syncs[0]._lagging(5) == (
        "process 1 (last heartbeat at step 3), process 2 (last heartbeat at step 4), "
        "process 3 (no heartbeat)"
    )
    assert syncs[2]._lagging(4) == "process 1 (last heartbeat at step 3), process 3 (no heartbeat)"
    syncs[3]._beat(3)
    assert syncs[3]._lagging(3) == "none lagging (a peer failed inside the collective)"


def test_dead_peer_makes_the_survivor_exit_with_a_clear_error(tmp_path):
    """Pins: a survivor hanging forever (or exiting 0) when a peer process is SIGKILLed
    mid-run; it must exit EXIT_PEER_FAILED within the bound, naming the dead process."""
    res = launch(
        [_job(2, 2, 1, "steady_decode", 40)],
        2,
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
    assert res.parts == [[]]  # neither process finished the job


def test_hung_peer_trips_the_sync_watchdog(tmp_path):
    """Pins: a survivor blocking forever in the DP all-gather when a peer is alive but stuck
    (SIGSTOP: no closed connection to notice); the watchdog must end it, naming the peer."""
    res = launch(
        [_job(2, 2, 1, "steady_decode", 40)],
        2,
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


def test_debug_mode_over_two_processes_checks_each_processs_ranks(tmp_path):
    """Pins: a debug map spanning processes failing its check() because it fetched its
    pending errors as global arrays (no process can read another's ranks): each process
    now reads its own ranks' errors, and the run is judged like any other."""
    job = Job("dp_overlap", "int32", True, steps=STEPS, dp=4, tp=1, processes=2)
    [r] = run_dist_jobs([job], tmp_path, timeout_s=150)
    assert r.ok, (r.first_divergence, r.oracle_failures, r.failures, r.errors)
    assert r.debug and r.processes == 2
