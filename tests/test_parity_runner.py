"""fm_parity.runner: jobs run here or in worker processes, one at a time per worker, with the
same results in the order of the jobs whatever the number of workers."""

from __future__ import annotations

import pytest

from fm_parity import runner
from fm_parity.suite import Job


def _jobs() -> list[Job]:
    return [
        Job(name, dtype, debug, steps=6, protocol=protocol)
        for name, protocol in (("idle_steps", "sentinel"), ("spec_decode", "gather"))
        for dtype in ("int32", "int64")
        for debug in (False, True)
    ]


@pytest.mark.slow  # worker processes each import both frameworks
def test_a_pool_of_workers_gives_the_serial_results_in_job_order():
    """Three workers (int32 and int64 kinds, fed the costliest job first) report what the
    default run (int32 here, int64 in one worker) reports, job for job, in job order; the
    progress callback sees every job once."""
    jobs = _jobs()
    seen: list[Job] = []
    serial = runner.run_jobs(jobs)
    pooled = runner.run_jobs(jobs, lambda job, _: seen.append(job), workers=3)
    assert sorted(map(repr, seen)) == sorted(map(repr, jobs))
    key = [(r.name, r.protocol, r.dtype, r.debug) for r in serial]
    assert key == [(j.scenario, j.protocol, j.dtype, j.debug) for j in jobs]
    assert [(r.name, r.protocol, r.dtype, r.debug) for r in pooled] == key
    assert [r.to_wire() for r in pooled] == [r.to_wire() for r in serial]
    assert all(r.ok and r.ops_compared > 0 for r in pooled)


def test_a_worker_that_dies_fails_its_job_and_the_others_still_run(monkeypatch):
    """A worker process that dies mid-job (here: the int64 kind's JAX is pointed at a
    platform that does not exist, so the job raises and the worker exits) reports that job
    as failed with its exit status; the next job of its kind gets a fresh worker's turn and
    fails the same way; no job is lost and the int32 jobs pass."""
    real_env = runner.worker_env

    def env(device: str, *, x64: bool = True, mesh_devices: int = 0) -> dict[str, str]:
        out = real_env(device, x64=x64, mesh_devices=mesh_devices)
        if x64:
            out["JAX_PLATFORMS"] = "no_such_platform"
        return out

    monkeypatch.setattr(runner, "worker_env", env)
    jobs = _jobs()[:4]
    results = runner.run_jobs(jobs, workers=2)
    assert len(results) == len(jobs)
    for job, r in zip(jobs, results, strict=True):
        if job.dtype == "int64":
            assert not r.ok and "worker process exited" in " ".join(r.failures), r
        else:
            assert r.ok, r


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers must be >= 1"):
        runner.run_jobs(_jobs(), workers=0)
