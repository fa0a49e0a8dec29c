"""The 'sync' check (docs/CONTRACT.md, 'Two protocols'): in the gather protocol an engine
that never asks for the host lengths moves nothing from the device to the host, so parity
runs every fm_jax resolve, publish and stash inside a device-to-host detector
(fm_parity.transfers), and a resolve that still reads its lengths back is caught."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fm_parity.driver import run_overlap
from fm_parity.suite import Job, check_mutation, evaluate, lanes_for, make_twins, run_job
from fm_parity.transfers import DeviceToHostTransfer, no_device_to_host

READS = {
    "device_get": jax.device_get,
    "tolist": lambda x: x.tolist(),
    "int": lambda x: int(x[0]),
}


@pytest.mark.parametrize("read", list(READS))
def test_the_detector_raises_or_records_every_read(read):
    """Pins: a read path the detector misses, a recording detector that changes the value
    read, and a patch left behind after the block. (`np.asarray` and `x.item()` of a CPU
    array read through the buffer protocol, which no patch reaches: see fm_parity.transfers.)"""
    x = jnp.arange(3, dtype=jnp.int32) + 1
    with pytest.raises(DeviceToHostTransfer, match="device-to-host transfer"), no_device_to_host():
        READS[read](x + 0)
    seen: list[str] = []
    with no_device_to_host(seen.append):
        got = READS[read](x + 0)
        y = x * 2  # device work is not a transfer
    assert seen and all("device-to-host transfer" in s for s in seen)
    assert np.asarray(got).tolist() == (1 if read == "int" else [1, 2, 3])
    seen.clear()
    assert np.asarray(y).tolist() == [2, 4, 6] and not seen  # unpatched after the block


@pytest.mark.parametrize("name", ["mixed_batches", "spec_decode", "spec_verified"])
@pytest.mark.parametrize("debug", [False, True])
def test_an_unmutated_gather_run_passes_the_sync_check(name, debug):
    """Pins: a gather-protocol fm_jax op (resolve, publish, stash, debug on or off) that
    moves something to the host, and the twin's own reads of outputs for the trace being
    counted against the map."""
    job = Job(name, "int32", debug, protocol="gather")
    lanes = lanes_for(job)
    runs = {t.name: run_overlap(lanes, t, job.dtype, job.steps) for t in make_twins(lanes, job)}
    assert all(r.syncs == [] for r in runs.values()), {n: r.syncs for n, r in runs.items()}
    r = evaluate(job, lanes, runs)
    assert r.ok and "sync" not in r.detectors, (r.failures, r.first_divergence)


def test_a_resolve_that_syncs_is_caught_by_sync_and_the_run_goes_on():
    """Pins: a host-length skip that still syncs (host_copy_syncs) passing unseen, caught
    by another detector than 'sync' (it changes no value), or ending the run."""
    r = run_job(Job("steady_decode", "int32", False, protocol="gather"), "host_copy_syncs")
    assert r.detectors == ["sync"] and not r.ok
    assert r.divergences == 0 and r.oracle_ok and not r.errors and r.steps > 1
    assert len(r.failures) == 1 and r.failures[0].startswith("sync: jax: step 1: resolve: ")
    m = check_mutation("host_copy_syncs", [Job("steady_decode", "int32", False)])
    assert m.protocol == "gather" and m.caught_by == "sync", m
    assert m.to_json() == {"name": "host_copy_syncs", "protocol": "gather", "caught_by": "sync"}


def test_the_sentinel_protocol_is_not_watched():
    """The check is the gather protocol's: a sentinel run, whose map is not held to zero
    transfers, records none even with a resolve that reads back."""
    r = run_job(Job("steady_decode", "int32", False, steps=4), "host_copy_syncs")
    assert r.ok and "sync" not in r.detectors, r.failures
