"""eSurge on fm_jax's relay against eSurge as shipped: greedy outputs token for token."""

from __future__ import annotations

import types

import fm_easydel
import pytest
from fm_easydel import _compat, harness

# Seven requests through four rows: later ones join as earlier ones finish (rows move, slots
# are reused); the 30- and 40-token prompts are prefilled in chunks of at most 16 tokens.
PROMPTS = [
    [1, 2, 3],
    list(range(30)),
    [5, 9],
    [7, 7, 8, 1, 4],
    list(range(10, 50)),
    [3],
    [11, 13, 17, 19, 23, 29],
]


def run(ed, eng, prompts, **params):
    sp = ed.SamplingParams(temperature=0.0, **params)
    outs = eng.generate([harness.prompt(p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def fresh(eng):
    relay = eng._fm_relay
    return relay.timeline, relay.step, relay.allocations, relay.row_moves


def test_greedy_outputs_equal_with_joins_moves_and_slot_reuse(ed, engines):
    shipped, relay_eng = engines
    relay = relay_eng._fm_relay
    alloc0, moves0 = relay.allocations, relay.row_moves
    want = run(ed, shipped, PROMPTS, max_tokens=12)
    got = run(ed, relay_eng, PROMPTS, max_tokens=12)
    assert got == want
    assert all(len(t) == 12 for t in got)
    assert relay.allocations - alloc0 == len(PROMPTS)  # one slot per request
    assert len(set(relay.slot_history[-len(PROMPTS) :])) < len(PROMPTS)  # slots reused
    assert relay.row_moves > moves0  # requests changed rows between steps
    assert relay.gathered > 0


def test_stop_token_seen_a_step_late_is_discarded(ed, engines):
    shipped, relay_eng = engines
    base = run(ed, shipped, PROMPTS[:4], max_tokens=12)
    stop = base[1][3]  # the fourth token of one request: it stops there, the others may too
    want = run(ed, shipped, PROMPTS[:4], max_tokens=12, stop_token_ids=[stop])
    got = run(ed, relay_eng, PROMPTS[:4], max_tokens=12, stop_token_ids=[stop])
    assert got == want
    assert len(want[1]) < 12  # it did stop early
    assert all(stop not in t[:-1] for t in got)


def test_penalties_rebuilt_with_a_token_in_flight(ed, engines):
    shipped, relay_eng = engines
    relay = relay_eng._fm_relay
    before = relay.penalty_corrections
    params = dict(max_tokens=10, repetition_penalty=1.5, presence_penalty=0.5)
    want = run(ed, shipped, PROMPTS, **params)
    got = run(ed, relay_eng, PROMPTS, **params)
    assert got == want
    assert relay.penalty_corrections > before  # a rebuild met tokens in flight


def test_step_dispatched_before_previous_tokens_reach_host(ed, engines):
    _, relay_eng = engines
    relay = relay_eng._fm_relay
    first = relay.step
    run(ed, relay_eng, PROMPTS[:4], max_tokens=16)
    tl = relay.timeline
    steps = [n for n in range(first, relay.step - 1) if n in tl.drained]
    decode = [n for n in steps if tl.decode_rows.get(n + 1, 0) > 0]
    assert len(decode) >= 10
    overlapped = set(tl.overlapped_steps())
    # every step whose successor decodes on its tokens had that successor dispatched first
    assert all(n in overlapped for n in decode), [
        (n, tl.dispatched[n + 1] - tl.drained[n]) for n in decode if n not in overlapped
    ]


def test_refusals_name_what_is_unsupported(monkeypatch):
    monkeypatch.setattr(
        _compat, "_installed", lambda name: "0.2.9" if name == "easydel" else "0.0.80.3"
    )
    with pytest.raises(_compat.UnsupportedEasyDeL, match="easydel 0.2.9"):
        _compat.check_versions()
    monkeypatch.setattr(
        _compat, "_installed", lambda name: "0.3.0" if name == "easydel" else "0.0.79"
    )
    with pytest.raises(_compat.UnsupportedEasyDeL, match="ejkernel 0.0.79"):
        _compat.check_versions()
    monkeypatch.undo()

    def fake(dp=1, window=4, spec=0, async_scheduling=True):
        runner = types.SimpleNamespace(
            metadata=types.SimpleNamespace(data_parallel_size=dp),
            async_scheduling=async_scheduling,
            num_reqs_max_model_len=window,
        )
        return types.SimpleNamespace(
            _scheduler_running=False,
            runner=runner,
            scheduler=types.SimpleNamespace(num_spec_tokens=spec),
            max_num_seqs=4,
        )

    with pytest.raises(fm_easydel.RelayError, match="data-parallel rows.*data_parallel_size=2"):
        fm_easydel.attach(fake(dp=2))
    with pytest.raises(fm_easydel.RelayError, match="several windows.*max_num_seqs=4"):
        fm_easydel.attach(fake(window=2))
    with pytest.raises(fm_easydel.RelayError, match="speculative decoding"):
        fm_easydel.attach(fake(spec=2))
    with pytest.raises(fm_easydel.RelayError, match="async_scheduling=True"):
        fm_easydel.attach(fake(async_scheduling=False))
    fm_easydel.attach(fake())  # the same engine with nothing unsupported is accepted


def test_harness_reaps_worker_processes(spec):
    before = harness._children()
    with harness.engine(spec, relay=True) as eng:
        started = harness._children() - before
        assert started, "eSurge started no worker processes (tokenizer, detokenizer)"
        assert eng._fm_relay is not None
    assert not (harness._children() & started)
