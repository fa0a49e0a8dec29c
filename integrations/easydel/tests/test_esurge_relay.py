"""eSurge on fm_jax's relay against eSurge as shipped: greedy outputs token for token.

Every workload runs once on eSurge as shipped (one engine, terminated before the relay's is
built), then on one relay engine shared by the module: two engine builds in all."""

from __future__ import annotations

import itertools
import types

import fm_easydel
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fm_easydel import _compat, harness, patches

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
GREEDY = dict(max_tokens=12)
PENALTIES = dict(max_tokens=10, repetition_penalty=1.5, presence_penalty=0.5)


_ids = itertools.count()


def run(ed, eng, prompts, **params):
    """Token ids per prompt, in prompt order (`generate` returns outputs in the order the
    requests finished)."""
    sp = ed.SamplingParams(temperature=0.0, **params)
    rids = [f"t{next(_ids)}" for _ in prompts]
    outs = eng.generate([harness.prompt(p) for p in prompts], sp, request_id=rids, use_tqdm=False)
    by_id = {o.request_id: list(o.outputs[0].token_ids) for o in outs}
    assert sorted(by_id) == sorted(rids)
    return [by_id[r] for r in rids]


@pytest.fixture(scope="module")
def shipped(ed, spec):
    """The workloads on eSurge as shipped (the synchronous loop). Its engine is gone before
    the relay's is built: its loop spins on an empty schedule and would take the CPU."""
    before = harness._children()
    with harness.engine(spec, relay=False) as eng:
        started = harness._children() - before
        greedy = run(ed, eng, PROMPTS, **GREEDY)
        stop = greedy[1][3]  # the fourth token of one request: it stops there
        stopped = run(ed, eng, PROMPTS[:4], **GREEDY, stop_token_ids=[stop])
        penalties = run(ed, eng, PROMPTS, **PENALTIES)
    return types.SimpleNamespace(
        greedy=greedy,
        stop=stop,
        stopped=stopped,
        penalties=penalties,
        started=started,
        left=harness._children() & started,
    )


@pytest.fixture(scope="module")
def relay_eng(spec, shipped):
    with harness.engine(spec, relay=True) as eng:
        yield eng


def test_greedy_outputs_equal_with_joins_moves_and_slot_reuse(ed, shipped, relay_eng):
    relay = relay_eng._fm_relay
    alloc0, moves0 = relay.allocations, relay.row_moves
    got = run(ed, relay_eng, PROMPTS, **GREEDY)
    assert got == shipped.greedy
    assert all(len(t) == 12 for t in got)
    assert relay.allocations - alloc0 == len(PROMPTS)  # one slot per request
    assert len(set(relay.slot_history[-len(PROMPTS) :])) < len(PROMPTS)  # slots reused
    assert relay.row_moves > moves0  # requests changed rows between steps
    assert relay.gathered > 0


def test_stop_token_seen_a_step_late_is_discarded(ed, shipped, relay_eng):
    stop = shipped.stop
    got = run(ed, relay_eng, PROMPTS[:4], **GREEDY, stop_token_ids=[stop])
    assert got == shipped.stopped
    assert len(got[1]) <= 4 < len(shipped.greedy[1])  # it stopped at its fourth token or before
    assert all(stop not in t[:-1] for t in got)


def test_penalties_rebuilt_with_a_token_in_flight(ed, shipped, relay_eng):
    relay = relay_eng._fm_relay
    before = relay.penalty_corrections
    got = run(ed, relay_eng, PROMPTS, **PENALTIES)
    assert got == shipped.penalties
    assert got != [t[:10] for t in shipped.greedy]  # the penalties changed what was sampled
    assert relay.penalty_corrections > before  # a rebuild met tokens in flight


def test_step_dispatched_before_previous_tokens_reach_host(ed, relay_eng):
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
            executor_manager=types.SimpleNamespace(),
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


def test_drain_fails_the_engine_on_a_row_the_device_did_not_sample():
    from fm_easydel import loop
    from fm_easydel.relay import Timeline

    output = types.SimpleNamespace(req_ids=["a", "b"], sampled_token_ids=[[5], [-1]])
    runner = types.SimpleNamespace(
        _fm_relay=types.SimpleNamespace(timeline=Timeline()),
        wait_for_execution=lambda handle: output,
    )
    with pytest.raises(fm_easydel.RelayError, match=r"step 3: .*'b', \[-1\]"):
        loop._drain(types.SimpleNamespace(runner=runner), 3, None, None)


def test_harness_reaps_worker_processes(shipped, relay_eng):
    # the shipped engine's workers (tokenizer, detokenizer) were reaped when it was closed
    assert shipped.started, "eSurge started no worker processes (tokenizer, detokenizer)"
    assert not shipped.left, f"worker processes left running: {sorted(shipped.left)}"


def test_device_put_during_a_relay_dispatch_keeps_the_values_it_was_given():
    """The quirk behind the copy: on the CPU backend a transfer from a numpy buffer may wait
    behind the computation in flight, so refilling the buffer after `device_put` returns
    can change what the device gets. Inside a relay dispatch the buffer is copied first."""
    patches.install()
    big = jnp.ones((700, 700), jnp.float32)
    busy = jax.jit(lambda a: (a @ a @ a).sum())
    use = jax.jit(lambda y, r: y + 0 * r.astype(jnp.int32))
    patches._DISPATCH.active = True
    try:
        for _ in range(8):
            r = busy(big)
            host = np.full(64, 7, np.int32)
            dev = jax.device_put(host)
            host[:] = -1  # eSurge refills its staging buffers for the next step
            assert (np.asarray(use(dev, r)) == 7).all()
    finally:
        patches._DISPATCH.active = False
