"""Parity over spec decode with verified ids (docs/CONTRACT.md, 'Relay fields'): the toy
model makes and hashes them, both twins relay them, the driver records them with the other
draft fields and buffers, the oracle computes the same, and a stash that loses some is
caught under both protocols."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from fm_parity import catalogue
from fm_parity import toy_model as tm
from fm_parity import toy_model_jax as mj
from fm_parity import toy_model_torch as mt
from fm_parity.driver import run_overlap
from fm_parity.mutations import MUTATIONS
from fm_parity.suite import Job, evaluate, lanes_for, make_twins, run_job
from fm_parity.twin import PROTOCOLS

SPEC = tm.Layout(4, 0)


def _gathered(n: int, seed: int, offset: int = 0) -> tuple[tm.Draft, np.ndarray, np.ndarray]:
    """A gathered draft of `n` rows with verified ids, its lengths and slots (numpy)."""
    rng = np.random.default_rng(seed)
    bonus = rng.integers(0, tm.VOCAB, n) + offset
    pos = rng.integers(1, 5000, n).astype(np.int64)
    slots = rng.integers(1, 300, n).astype(np.int64)
    vid = rng.integers(0, tm.VOCAB, n) + offset
    return tm.make_draft(tm.NUMPY, bonus, pos, slots, SPEC, offset, vid), pos + 1, slots


def test_the_verify_hashes_the_gathered_verified_id():
    """Pins: a verify that ignores the verified id (a stale one would go unseen by the
    oracle), and a verify without verified ids that changed (the scenarios without them
    must keep their streams)."""
    d, lens, slots = _gathered(256, 0)
    acc, new_lens, nd = tm.forward_spec_decode(d, lens, slots, tm.NUMPY, SPEC, 0, verified=True)
    off = d._replace(verified=d.verified + 1)
    acc2, _, nd2 = tm.forward_spec_decode(off, lens, slots, tm.NUMPY, SPEC, 0, verified=True)
    assert (nd.bonus != nd2.bonus).mean() > 0.99 and (acc != acc2).any()
    plain = tm.forward_spec_decode(d._replace(verified=None), lens, slots, tm.NUMPY, SPEC, 0)
    ignored = tm.forward_spec_decode(d, lens, slots, tm.NUMPY, SPEC, 0)
    for a, b in zip(plain[:2], ignored[:2], strict=True):
        assert a.tobytes() == b.tobytes()
    assert plain[2].verified is None and ignored[2].verified is None
    with pytest.raises(ValueError, match="verified ids"):
        tm.forward_spec_decode(d._replace(verified=None), lens, slots, tm.NUMPY, SPEC, 0, True)


def test_a_verified_id_is_the_last_token_before_the_bonus():
    """Pins the definition: a prefill's last prompt token, a verify's last accepted draft
    token (topk_index[:, accept - 2]) or, accepting none, the gathered bonus token; a token
    like the others (the int64 offset kept, so >= 0)."""
    off = tm.WIDE_OFFSET
    d, lens, slots = _gathered(512, 1, off)
    acc, _, nd = tm.forward_spec_decode(d, lens, slots, tm.NUMPY, SPEC, off, verified=True)
    cols = np.concatenate([d.bonus[:, None], d.topk_index], axis=1)
    assert nd.verified.tolist() == cols[np.arange(512), acc - 1].tolist()
    assert set(acc.tolist()) == set(range(1, SPEC[0] + 2))  # every branch taken
    assert nd.verified.min() >= off
    ids = np.array([5, 6, 7, 8, 9]) + off
    lens2 = np.array([2, 3])
    _, _, first = tm.forward_spec_extend(
        ids, lens2, np.array([1, 2]), np.array([1, 4]), tm.NUMPY, SPEC, off, verified=True
    )
    assert first.verified.tolist() == [6 + off, 9 + off]
    tok, boot = tm.bootstrap(3, 4, 1, SPEC, off, np.dtype("int64"), verified=True)
    assert boot is not None and boot.verified.tolist() == tm.prompt_tokens(3, 3, 4, off)


def test_toy_model_backends_agree_on_verified_ids():
    """numpy, JAX and torch must give the same accept lengths, bonus tokens and verified ids
    with verified ids on, or parity would flag the model instead of the FutureMap."""
    d, lens, slots = _gathered(128, 2)  # values fit int32: JAX runs without x64 here
    lens, slots = lens.astype(np.int32), slots.astype(np.int32)
    d32 = tm.Draft._make(
        None if x is None else x.astype(np.int32) if x.dtype.kind == "i" else x for x in d
    )
    want = tm.forward_spec_decode(d32, lens, slots, tm.NUMPY, SPEC, 0, verified=True)
    as_jax = tm.Draft._make(None if x is None else jnp.asarray(x) for x in d32)
    as_torch = tm.Draft._make(None if x is None else torch.from_numpy(x) for x in d32)
    got_j = mj.forward_spec_decode(
        as_jax, jnp.asarray(lens), jnp.asarray(slots), SPEC, 0, verified=True
    )
    got_t = mt.forward_spec_decode(
        as_torch, torch.from_numpy(lens), torch.from_numpy(slots), SPEC, 0, verified=True
    )
    for i in (0, 1):
        assert want[i].tolist() == np.asarray(got_j[i]).tolist() == got_t[i].tolist()
    for k in ("bonus", "verified", "topk_index"):
        w = getattr(want[2], k).tolist()
        assert w == np.asarray(getattr(got_j[2], k)).tolist() == getattr(got_t[2], k).tolist()


def test_spec_verified_is_small_and_has_what_it_tests():
    """The scenario runs a spec prefill, a PREBUILT bootstrap and DECODE batches, and hands
    a retired request's slot to another (a stale verified id from the previous occupant
    would then be read)."""
    scn = catalogue.build("spec_verified")
    assert scn.spec is not None and scn.spec.verified_id
    assert any(r.prebuilt for r in scn.requests) and len(scn.requests) > scn.pool_size - 1
    assert len(scn.requests) <= 8 and max(scn.batch_buckets) <= 4


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_both_twins_relay_and_record_the_verified_ids(protocol):
    """Pins: verified ids missing from a twin's map or trace (the gathered ids at resolve,
    the next draft's at forward, the buffer from a rank's first draft stash on), and the
    run leaving the oracle, under either protocol, debug on."""
    job = Job("spec_verified", "int32", True, protocol=protocol)
    lanes = lanes_for(job)
    runs = {t.name: run_overlap(lanes, t, "int32") for t in make_twins(lanes, job)}
    r = evaluate(job, lanes, runs)
    assert r.ok, (r.first_divergence, r.oracle_failures, r.errors)
    for name, run in runs.items():
        seen = {(rec.op, k) for rec in run.records for k in rec.fields if "verified" in k}
        want = {("resolve", "draft.verified_id"), ("forward", "draft.verified_id")}
        want |= {(op, "verified_id") for op in ("resolve", "publish", "stash")}
        assert want <= seen, (name, seen)
        stashes = [rec for rec in run.records if rec.op == "stash"]
        first = next(i for i, rec in enumerate(stashes) if "topk_p" in rec.fields)
        assert all("verified_id" in rec.fields for rec in stashes[first:])
        key = "draft.verified_id"
        gathered = [rec.fields[key].value for rec in run.records if key in rec.fields]
        vids = np.concatenate([np.asarray(v) for v in gathered])
        assert len(vids) and vids.min() >= 0
    # Every request ran (the oracle holds), PREBUILT ones among them, and DECODE batches
    # gathered verified ids (above).
    assert any(r.prebuilt for r in lanes[0].requests) and len(runs["jax"].streams) == 6


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_stash_losing_verified_ids_is_caught_under_both_protocols(protocol):
    """Pins: skip_verified_id_stash (a stash leaving some rows' verified ids as they were)
    slipping through in either protocol: in fm_jax alone parity sees the buffer differ;
    in both twins alike the oracle sees the stale id change the verify's tokens."""
    assert "skip_verified_id_stash" in MUTATIONS
    job = Job("spec_verified", "int32", False, protocol=protocol)
    alone = run_job(job, "skip_verified_id_stash")
    assert alone.protocol == protocol and {"parity", "oracle"} <= set(alone.detectors)
    assert "verified_id" in (alone.first_divergence or "")
    both = run_job(job, "skip_verified_id_stash", mutate=("jax", "torch"))
    assert both.detectors == ["oracle"], both


def test_the_mesh_hlo_check_lowers_a_stash_with_verified_ids():
    """Pins: the mesh health check lowering a spec stash without the declared verified ids
    (refused as missing, so every mesh row of spec_verified failed). The one-device
    layout lowers the same executables."""
    from fm_parity.mesh import hlo_collectives
    from fm_parity.twin_jax import JaxTwin

    for protocol in PROTOCOLS:
        twin = JaxTwin(catalogue.build("spec_verified"), "int32", False, "cpu", protocol=protocol)
        got = hlo_collectives(twin.fm, 4, 16)
        assert got["stash"] == 0 and set(got) >= {"publish", "stash", "resolve"}
