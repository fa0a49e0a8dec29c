"""The overlap-scheduled serving demo (bench/serve) on a tiny model: token equality and JSON.

Engines share compiled steps (cached per config), so the module compiles each step variant
once: sync, overlap, overlap with debug.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import fm_jax
from bench.serve import cli
from bench.serve.config import TINY_REQUESTS, tiny_engine, tiny_model
from bench.serve.engine import Engine, ServeResult
from bench.serve.host_cost import HostCost
from bench.serve.requests import Request, make_requests
from bench.serve.scheduler import Scheduler
from bench.serve.sweep import diff_outputs

N_REQUESTS = 64


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    return make_requests(
        N_REQUESTS,
        vocab=tiny_model().vocab,
        prompt_len=TINY_REQUESTS.prompt_len,
        max_new=TINY_REQUESTS.max_new,
    )


@pytest.fixture(scope="module")
def reference(requests: list[Request]) -> ServeResult:
    return Engine(tiny_model(), tiny_engine()).run_sync(requests)


def test_reference_exercises_every_path(requests: list[Request], reference: ServeResult) -> None:
    """Pins a request set too easy to test anything: no chunking, no MIXED, no EOS, no reuse."""
    assert set(reference.outputs) == {r.rid for r in requests}
    assert {"MIXED", "DECODE"} <= set(reference.modes)
    eos = tiny_model().eos_id
    early = [r for r in requests if reference.outputs[r.rid][-1] == eos]
    assert 0 < len(early) < len(requests)  # some stop by EOS (read one step late in overlap)
    chunked = [r for r in requests if len(r.prompt) > tiny_engine().prefill_budget]
    assert chunked  # some prompts need more than one prefill chunk
    assert len(requests) > tiny_engine().max_running  # slots are reused


@pytest.mark.parametrize("debug", [False, True], ids=["debug-off", "debug-on"])
def test_overlap_tokens_equal_sync(
    requests: list[Request], reference: ServeResult, debug: bool
) -> None:
    """Pins a relay fault (sentinel resolved from a wrong or stale slot, a lost length, a slot
    reused too early) or a debug invariant tripping on a correct overlap schedule."""
    got = Engine(tiny_model(), tiny_engine(), debug=debug).run_overlap(requests)
    assert diff_outputs("overlap", reference, got) == []


def test_overlap_with_host_cost_tokens_equal_sync(
    requests: list[Request], reference: ServeResult
) -> None:
    """Pins a host-timing dependence: tokens must not change when the scheduler is slow."""
    got = Engine(tiny_model(), tiny_engine()).run_overlap(requests, HostCost(2e-4, "sleep"))
    assert diff_outputs("overlap", reference, got) == []


def _lose_relay(engine: Engine) -> None:
    """Sabotage: every step starts from fresh FutureMap buffers (the relay is lost)."""
    step, init = engine._overlap_step, engine._fm_init

    def broken(params: Any, cache: Any, _state: Any, inputs: Any) -> Any:
        return step(params, cache, init(), inputs)

    engine._overlap_step = broken


def test_lost_relay_changes_tokens(requests: list[Request], reference: ServeResult) -> None:
    """Pins a token check that cannot fail: overlap without the relay must differ."""
    engine = Engine(tiny_model(), tiny_engine())
    _lose_relay(engine)
    assert diff_outputs("overlap", reference, engine.run_overlap(requests)) != []


def test_lost_relay_trips_debug_consume_check(requests: list[Request]) -> None:
    """Pins debug mode missing a read of an unwritten slot (WRWR) inside the jitted step."""
    engine = Engine(tiny_model(), tiny_engine(), debug=True)
    _lose_relay(engine)
    with pytest.raises(fm_jax.InvariantViolation) as info:
        engine.run_overlap(requests)
    assert info.value.invariant == "consume (WRWR)"


def test_overlap_reads_tokens_only_after_dispatching_the_next_step(
    requests: list[Request],
) -> None:
    """Pins an overlap loop that syncs on step N's tokens before dispatching N+1 (no overlap)."""
    engine = Engine(tiny_model(), tiny_engine())
    step, dispatched, lag = engine._overlap_step, [0], []

    def counting(*args: Any) -> Any:
        dispatched[0] += 1
        return step(*args)

    class Recording(Scheduler):
        processed = 0

        def process(self, batch: Any, tokens: Any) -> None:
            self.processed += 1
            lag.append(dispatched[0] - self.processed)  # steps dispatched beyond this one
            super().process(batch, tokens)

    engine._overlap_step = counting
    engine._scheduler = lambda reqs, overlap, cost: Recording(
        reqs,
        tiny_engine(),
        overlap=overlap,
        host_cost=cost,
        max_seq_len=tiny_model().max_seq_len,
        eos_id=tiny_model().eos_id,
    )
    engine.run_overlap(requests)
    assert max(lag) == 1  # never more than one step in flight beyond the one being read
    # a step is read before the next dispatch only when nothing was schedulable
    assert sum(lag) >= 0.9 * len(lag)


def _scheduler(requests: list[Request], overlap: bool) -> Scheduler:
    m = tiny_model()
    return Scheduler(
        requests,
        tiny_engine(),
        overlap=overlap,
        host_cost=HostCost(),
        max_seq_len=m.max_seq_len,
        eos_id=m.eos_id,
    )


def test_scheduler_writes_sentinels_only_in_overlap() -> None:
    """Pins a decode row that carries a host value the overlap host cannot know, or a DECODE
    length that is not a sentinel; padding must carry slot 0."""
    reqs = [Request(i, (5, 6, 7), 4) for i in range(3)]
    for overlap in (False, True):
        sched = _scheduler(reqs, overlap)
        first = sched.build()
        assert first is not None and first.mode == fm_jax.ForwardMode.EXTEND
        sched.process(first, np.full(len(first.rows), 9, np.int32))
        second = sched.build()
        assert second is not None and second.mode == fm_jax.ForwardMode.DECODE
        inp = second.inputs
        slots = inp.req_pool_indices[:3]
        assert slots.tolist() == [1, 2, 3] and not inp.req_pool_indices[3:].any()
        if overlap:
            assert inp.input_ids[:3].tolist() == (-slots).tolist()
            assert inp.seq_lens[:3].tolist() == (-slots).tolist()
        else:
            assert inp.input_ids[:3].tolist() == [9, 9, 9]
            assert inp.seq_lens[:3].tolist() == [4, 4, 4]  # prompt 3 + the fed token
        assert not inp.token_slots[3:].any()  # padding tokens write only slot 0


def test_scheduler_refuses_request_longer_than_cache() -> None:
    """Pins a request silently overrunning its slot's KV positions."""
    m = tiny_model()
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        _scheduler([Request(0, tuple(range(2, m.max_seq_len)), 8)], overlap=True)


def test_engine_refuses_prompt_ids_outside_vocab() -> None:
    """Pins an out-of-vocab id silently clamped by the embedding gather into another token."""
    engine = Engine(tiny_model(), tiny_engine())
    with pytest.raises(ValueError, match="outside"):
        engine.run_sync([Request(0, (3, tiny_model().vocab), 2)])


def test_cli_quick_json_schema(tmp_path: Any) -> None:
    """Pins the `--json` schema that fm-serve-demo promises, and its exit status."""
    path = tmp_path / "serve.json"
    assert cli.main(["--quick", "--ratios", "0,1", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert isinstance(doc["device"], str) and doc["device"]
    assert doc["requests"] == N_REQUESTS
    assert doc["tokens_equal"] is True and doc["debug_tokens_equal"] is True
    assert [r["host_cost_ratio"] for r in doc["runs"]] == [0.0, 1.0]
    for run in doc["runs"]:
        for key in ("host_cost_ratio", "sync_tok_s", "overlap_tok_s", "speedup", "ideal_speedup"):
            assert isinstance(run[key], float) and run[key] >= 0, key
        assert run["ideal_speedup"] >= 1.0
        assert run["speedup"] == pytest.approx(run["overlap_tok_s"] / run["sync_tok_s"])
