"""Every catalogue scenario: fm_jax and fm_torch traces bit-identical, token streams equal
to the synchronous reference loop, in debug mode and out of it, under both relay protocols
(docs/CONTRACT.md, 'What parity compares', 'Two protocols')."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fm_parity import catalogue, payloads
from fm_parity import toy_model as tm
from fm_parity.scenario import Kind, Scheduler, SpecShape
from fm_parity.suite import Job, run_job
from fm_parity.twin import PROTOCOLS

SMALL = [n for n in catalogue.CATALOGUE if n != "long_run"]


def _assert_ok(r):
    assert r.divergences == 0, r.first_divergence
    assert r.oracle_ok, (r.oracle_failures, r.errors)
    assert r.ops_compared > 0


@pytest.mark.parametrize("debug", [False, True], ids=["debug-off", "debug-on"])
@pytest.mark.parametrize(
    ("protocol", "name"),
    [(p, n) for p in PROTOCOLS for n in SMALL if catalogue.runs_under(n, p)],
)
def test_scenario_parity_and_oracle(protocol, name, debug):
    """A FutureMap op that moves different bytes in the twins, or a relay that changes what a
    request generates, fails here, in either protocol (int32; int64 runs in
    test_parity_cli's x64 worker)."""
    r = run_job(Job(name, "int32", debug, protocol=protocol))
    _assert_ok(r)
    assert r.protocol == protocol


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_long_run_prefix_with_256_concurrent_requests(protocol):
    """The long scenario's first steps (256-row batches, MIXED with chunked prefill) agree;
    the full 1,000+ steps run in fm-parity's default run."""
    r = run_job(Job("long_run", "int32", False, steps=40, protocol=protocol))
    _assert_ok(r)
    assert r.steps == 40


def test_long_run_is_long_and_wide():
    """The long scenario must really run 1,000+ steps with 256 requests at once."""
    sched = Scheduler(catalogue.build("long_run"))
    widest = 0
    while sched.next_step() is not None:
        widest = max(widest, len(sched._running))
    assert sched.step > 1000 and widest == 256


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("chunked_prefill", {Kind.EXTEND, Kind.DECODE}),
        ("mixed_batches", {Kind.MIXED}),
        ("idle_steps", {Kind.IDLE}),
        ("prebuilt_bootstrap", {Kind.PREBUILT}),
        ("spec_mixed", {Kind.MIXED, Kind.DECODE}),
    ],
)
def test_scenarios_contain_the_batch_kinds_they_name(name, kinds):
    """A scenario that silently stopped producing its batch kind would test nothing."""
    sched = Scheduler(catalogue.build(name))
    seen = set()
    while (plan := sched.next_step()) is not None:
        seen.add(plan.kind)
    assert kinds <= seen


def test_spec_partial_stashes_bonus_only_and_partial_drafts_between_full_ones():
    """spec_partial would test nothing without its partial stashes: bonus-only DECODE
    stashes, ones without hidden states, full ones between, and the DSA indices in none
    (every resolve gathers them as None)."""
    scenario = catalogue.build("spec_partial")
    assert scenario.spec is not None
    sched = Scheduler(scenario)
    seen = set()
    while (plan := sched.next_step()) is not None:
        if plan.kind is not Kind.IDLE:
            seen.add(payloads.omitted(scenario.spec, plan.kind, plan.step))
    never = payloads.NEVER_STASHED
    assert seen == {
        never,
        ("topk_p", "topk_index", "hidden_states", "draft_probs", *never),
        ("hidden_states", "draft_probs", *never),
    }
    assert never == ("dsa_topk_indices",)
    assert [e.name for e in payloads.layout(scenario.spec).extras][-1] == never[0]


def test_burst_puts_100_prefill_batches_before_the_first_decode():
    """The burst scenario must keep request 0 waiting through 100 EXTEND batches."""
    sched = Scheduler(catalogue.build("prefill_burst"))
    extends_after_first = 0
    while (plan := sched.next_step()) is not None:
        if plan.kind is Kind.DECODE:
            break
        if plan.step > 1:
            extends_after_first += plan.kind is Kind.EXTEND
    assert extends_after_first == 100


def test_retire_reuse_hands_slots_over_at_once():
    """Slot reuse must be immediate: a retired request's slot goes to the next admission."""
    sched = Scheduler(catalogue.build("retire_reuse"))
    owners: dict[int, set[int]] = {}
    while (plan := sched.next_step()) is not None:
        for row in plan.rows:
            owners.setdefault(row.slot, set()).add(row.rid)
    assert max(len(v) for v in owners.values()) >= 5


def test_abort_reuse_hands_an_aborted_slot_over_while_its_last_step_is_in_flight():
    """An aborted request leaves after the step that made its last token; at the very next
    step a new request's prefill takes its slot (in overlap, that step is planned while the
    aborted one's last step still runs)."""
    sched = Scheduler(catalogue.build("abort_reuse"))
    last_row: dict[int, tuple[int, int]] = {}  # rid -> (step, slot) of its last row
    handed_over = 0
    while (plan := sched.next_step()) is not None:
        for rid in sched.aborted:
            step, slot = last_row.pop(rid)
            handed_over += any(
                r.slot == slot and r.phase == "prefill" and step == plan.step - 1 for r in plan.rows
            )
        sched.aborted.clear()
        for row in plan.rows:
            last_row[row.rid] = (plan.step, row.slot)
    assert handed_over >= 5, handed_over


def test_retract_resume_recomputes_each_prefix_from_the_requests_own_tokens(monkeypatch):
    """A retracted request resumes with a prompt that ends with the tokens it produced
    (`own_from`), at least one step after it left; served with other tokens there (a host
    that forgot the token in flight when it retracted), its stream leaves the oracle's."""
    sched = Scheduler(catalogue.build("retract_resume"))
    left: dict[int, int] = {}
    resumed = 0
    while (plan := sched.next_step()) is not None:
        for rid in sched.retracted:
            left.setdefault(rid, plan.step)
        for row in plan.rows:
            if row.own_from and row.start == 0:
                assert plan.step > left[row.rid]
                resumed += 1
    assert resumed == len(sched.retracted) >= 4
    _assert_ok(run_job(Job("retract_resume", "int32", False, protocol="gather")))

    from fm_parity import driver

    def forgets_the_last(streams, rank):
        return lambda rid: streams.get((rank, rid), [])[:-1] + [0]

    monkeypatch.setattr(driver, "_produced", forgets_the_last)
    r = run_job(Job("retract_resume", "int32", False, protocol="gather"))
    assert r.divergences == 0 and not r.oracle_ok


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"abort_after": 6}, "abort_after=6"),
        ({"retract_after": 0, "abort_after": 1, "prebuilt": True}, "abort_after=1"),
        ({"retract_after": 2, "abort_after": 1}, "both aborted and retracted"),
    ],
)
def test_a_request_that_cannot_leave_mid_stream_is_refused_by_name(change, words):
    """Aborts and retractions name the request and the setting that cannot be served."""
    import dataclasses

    from fm_parity.scenario import Request, Scenario

    base = catalogue.build("abort_reuse")
    req = dataclasses.replace(Request(0, 3, 6), **change)
    with pytest.raises(ValueError, match=words):
        Scenario("bad", "", (req,), base.pool_size, base.policy, batch_buckets=(4,))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    size=st.integers(1, 2),
    debug=st.booleans(),
    spec=st.booleans(),
    protocol=st.sampled_from(PROTOCOLS),
)
def test_random_mix_parity_and_oracle(seed, size, debug, spec, protocol):
    """Random schedules (arrivals, chunking, MIXED, PREBUILT, idle, reuse) keep both twins
    identical and on the reference's tokens, in either protocol."""
    name = "random_spec_mix" if spec else "random_mix"
    r = run_job(Job(name, "int32", debug, seed=seed, size=size, protocol=protocol))
    _assert_ok(r)


def test_toy_model_backends_agree_bit_for_bit():
    """numpy, JAX and torch toy models must give identical bytes, or parity would flag the
    model instead of the FutureMap."""
    import torch

    from fm_parity import toy_model_jax as mj
    from fm_parity import toy_model_torch as mt

    rng = np.random.default_rng(0)
    bonus = rng.integers(0, 2**33, 64).astype(np.int64)
    pos = rng.integers(1, 5000, 64).astype(np.int64)
    slots = rng.integers(0, 300, 64).astype(np.int64)
    # SGLang's EAGLE payload: the standard fields and two of the engine's own.
    spec = payloads.layout(SpecShape(4, 8, payload="sglang_eagle"))
    ref = tm.make_draft(tm.NUMPY, bonus, pos, slots, spec, tm.WIDE_OFFSET)
    got_t = tm.make_draft(
        mt.TORCH,
        torch.from_numpy(bonus),
        torch.from_numpy(pos),
        torch.from_numpy(slots),
        spec,
        tm.WIDE_OFFSET,
    )
    for k in ("topk_p", "topk_index"):
        assert getattr(ref, k).tobytes() == getattr(got_t, k).numpy().tobytes()
    for k, v in ref.extras.items():
        assert v.tobytes() == got_t.extras[k].numpy().tobytes(), k
    assert ref.hidden.view(np.int16).tobytes() == got_t.hidden.view(torch.int16).numpy().tobytes()
    b32, p32, s32 = (x.astype(np.int32) % 40000 for x in (bonus, pos, slots))
    ref32 = tm.make_draft(tm.NUMPY, b32, p32, s32, spec, 0)
    got_j = mj.JAX
    d = tm.make_draft(
        got_j, jax.numpy.asarray(b32), jax.numpy.asarray(p32), jax.numpy.asarray(s32), spec, 0
    )
    assert ref32.topk_p.tobytes() == np.asarray(d.topk_p).tobytes()
    assert ref32.hidden.tobytes() == np.asarray(d.hidden).tobytes()
    for k, v in ref32.extras.items():
        assert v.tobytes() == np.asarray(d.extras[k]).tobytes(), k
    acc, lens, _ = tm.forward_spec_decode(ref, pos, slots, tm.NUMPY, spec, tm.WIDE_OFFSET)
    assert acc.min() >= 1 and acc.max() <= spec.topk + 1 and len(set(acc.tolist())) > 1
    # The verify hashes the engine's own fields: one float bit flipped changes its accepts.
    probs = ref.extras["draft_probs"].copy()
    probs.view(np.uint32)[:, 0] ^= 1
    flipped = ref._replace(extras={**ref.extras, "draft_probs": probs})
    acc2, _, _ = tm.forward_spec_decode(flipped, pos, slots, tm.NUMPY, spec, tm.WIDE_OFFSET)
    assert (acc2 != acc).any()


def test_toy_model_ngram_draft_relays_its_accepted_tokens_and_length():
    """An n-gram draft (SGLang's payload: no bonus token relayed) holds the accepted tokens
    with the bonus token last and 0 after, and its accept length; the verify takes its last
    token from them, identically in the three backends."""
    import torch

    from fm_parity import toy_model_jax as mj
    from fm_parity import toy_model_torch as mt

    spec = payloads.layout(SpecShape(3, 0, payload="ngram"))
    rng = np.random.default_rng(2)
    bonus, pos, slots = (rng.integers(1, 30000, 64).astype(np.int32) for _ in range(3))
    first = tm.make_draft(tm.NUMPY, bonus, pos, slots, spec, 0)
    assert (first.extras["accept_lens"] == 1).all()
    assert (first.extras["accept_tokens"][:, 0] == bonus).all()
    assert (first.extras["accept_tokens"][:, 1:] == 0).all()
    gathered = first._replace(bonus=None, topk_p=None, topk_index=None)  # as relayed
    acc, _, nd = tm.forward_spec_decode(gathered, pos, slots, tm.NUMPY, spec, 0)
    toks, n = nd.extras["accept_tokens"], nd.extras["accept_lens"]
    assert (n == acc).all() and len(set(acc.tolist())) > 1
    assert (toks[np.arange(64), n - 1] == nd.bonus).all()
    assert all((toks[i, n[i] :] == 0).all() for i in range(64))
    got_t = tm.forward_spec_decode(
        tm.Draft(
            None, None, None, None, None, {k: torch.from_numpy(v) for k, v in first.extras.items()}
        ),
        torch.from_numpy(pos),
        torch.from_numpy(slots),
        mt.TORCH,
        spec,
        0,
    )
    got_j = tm.forward_spec_decode(
        tm.Draft(
            None, None, None, None, None, {k: jax.numpy.asarray(v) for k, v in first.extras.items()}
        ),
        jax.numpy.asarray(pos),
        jax.numpy.asarray(slots),
        mj.JAX,
        spec,
        0,
    )
    for got in (got_t, got_j):
        assert np.asarray(got[0]).tobytes() == acc.tobytes()
        for k, v in nd.extras.items():
            assert np.asarray(got[2].extras[k]).tobytes() == v.tobytes(), k


def test_toy_model_drafts_carry_nan_signed_zero_and_inf_bit_patterns():
    """The float payloads must include the patterns a value comparison gets wrong."""
    rng = np.random.default_rng(1)
    n = 4096
    d = tm.make_draft(
        tm.NUMPY,
        rng.integers(0, 30000, n),
        rng.integers(1, 999, n),
        rng.integers(1, 9, n),
        tm.Layout(4, 8),
        0,
    )
    p_bits = set(d.topk_p.view(np.uint32).reshape(-1).tolist())
    h_bits = set(d.hidden.view(np.uint16).reshape(-1).tolist())
    assert {0x7FC01234, 0x80000000, 0x7F800000, 0xFF800000, 0x7F800001} <= p_bits
    assert {0x7FC1, 0x8000, 0x7F80, 0x7F81} <= h_bits


def test_reference_loop_shares_only_the_scenario_and_the_toy_model_with_the_driver():
    """The oracle must not reuse the driver's batch layout or stream bookkeeping: a bug
    there would then be in both and cancel out. Nothing in parity reaches into fm_jax's
    private modules either (the public API is what an engine gets)."""
    import ast
    from pathlib import Path

    import fm_parity

    root = Path(fm_parity.__file__).parent

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        out = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        out |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        return out

    ref = {m for m in imports(root / "reference.py") if m.startswith("fm_parity")}
    assert ref <= {"fm_parity", "fm_parity.scenario", "fm_parity.toy_model"}, ref
    for path in root.glob("*.py"):
        # below the package's face: fm_jax.ops, fm_jax.host, fm_jax.map and their modules
        assert not any(m.startswith("fm_jax.") for m in imports(path)), path.name


def test_a_gather_only_scenario_is_refused_under_the_sentinel_protocol():
    """A spec MIXED scenario runs under the gather protocol only (the sentinel protocol
    has no spec MIXED batch): asked for under sentinel, the job says so."""
    assert catalogue.runs_under("spec_mixed", "gather")
    assert not catalogue.runs_under("spec_mixed", "sentinel")
    with pytest.raises(ValueError, match="does not run under the sentinel protocol"):
        run_job(Job("spec_mixed", "int32", False, protocol="sentinel"))


def test_spec_confidence_reads_rows_of_a_slots_previous_request(monkeypatch):
    """The confidence scenario must read nothing at first (fewer than two publishes), then
    rows whose generation is their slot's current one beside rows a reused slot's previous
    request published (an older generation): what the generation snapshot is for."""
    from fm_parity import confidence
    from fm_parity.reference import run_reference

    reads = []
    real = confidence.digest

    def spy(read, current):
        reads.append((read, current.copy()))
        return real(read, current)

    monkeypatch.setattr(confidence, "digest", spy)
    run_reference(catalogue.build("spec_confidence"), "int32")
    assert any(read is None for read, _ in reads)
    fresh = [
        g == c for read, now in reads if read is not None for g, c in zip(read[1], now, strict=True)
    ]
    assert any(fresh) and not all(fresh)
