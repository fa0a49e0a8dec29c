"""Speculative decoding (n-gram drafter through the spec relay) on the toy model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fm_jax
from fm_serve.config import EngineConfig, tiny_model
from fm_serve.engine import Engine, ServeResult
from fm_serve.model import toy
from fm_serve.requests import Request
from fm_serve.spec import Ngram, make_spec_step, propose

K = 3
CFG = EngineConfig(max_running=3, prefill_budget=8, batch_buckets=(4,), token_buckets=(12,))


@pytest.fixture(scope="module")
def model() -> tuple[object, object]:
    return toy(tiny_model())


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    """Repetitive prompts (lookup has something to find), one longer than a prefill chunk."""
    return [
        Request(0, (5, 6, 7, 8, 5, 6, 7, 8, 5, 6), 12),
        Request(1, (9, 10, 9, 10, 9), 10),
        Request(2, (20, 21, 22, 23, 24, 25, 26, 27, 20, 21, 22), 9),
        Request(3, (30, 31, 32, 30, 31), 6),
    ]


@pytest.fixture(scope="module")
def non_spec(model: tuple[object, object], requests: list[Request]) -> ServeResult:
    m, params = model
    return Engine(m, params, CFG).run_sync(requests)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def spec_engine(model: tuple[object, object]) -> Engine:
    m, params = model
    return Engine(m, params, CFG, debug=True, speculative=Ngram(K))  # type: ignore[arg-type]


def test_drafter_proposes_what_followed_the_last_occurrence() -> None:
    """The drafts are the tokens after the latest earlier match of the longest suffix,
    extended periodically past the sequence's end (a drafter that read a stale length or
    the first match would propose others)."""
    hist = np.zeros((3, 16), np.int32)
    hist[1, :8] = [1, 2, 3, 9, 1, 2, 3, 4]  # no suffix seen before: repeat the last
    hist[2, :7] = [7, 1, 2, 3, 1, 2, 3]  # suffix (1, 2, 3) last seen at 1: then 1, 2, 3, 1
    lens = jnp.array([8, 7], jnp.int32)
    drafts = jax.jit(propose, static_argnums=3)  # one compile, not one per eager op
    got = drafts(jnp.asarray(hist), jnp.array([1, 2]), lens, Ngram(4, 3))
    assert np.asarray(got).tolist() == [[4, 4, 4, 4], [1, 2, 3, 1]]
    hist[1, :8] = [5, 6, 5, 6, 8, 5, 6, 5]  # (5, 6, 5) seen at 0: then 6, 8, 5, 6
    got = drafts(jnp.asarray(hist[1:]), jnp.array([0]), jnp.array([8]), Ngram(4, 3))
    assert np.asarray(got).tolist() == [[6, 8, 5, 6]]


def test_spec_overlap_and_sync_equal_the_non_spec_loop(
    spec_engine: Engine, non_spec: ServeResult, requests: list[Request]
) -> None:
    """Greedy speculative output is the non-spec loop's token for token, in both loops,
    with drafts accepted (a wrong accepted prefix, bonus token or relayed length would
    change the tokens); debug's consume checks pass (fm.check() at the end of overlap)."""
    for run in (spec_engine.run_overlap, spec_engine.run_sync):
        res = run(requests)
        assert res.outputs == non_spec.outputs
        assert res.drafts_accepted > 0
        assert res.drafts_proposed % K == 0
        assert res.modes.get("MIXED", 0) > 0  # prefill chunks beside verify rows
        decode_rows = res.drafts_proposed // K
        assert res.tokens_per_verify(K) == pytest.approx(1 + res.drafts_accepted / decode_rows)


def test_spec_under_a_kv_budget_retracts_and_serves_the_same_tokens(
    model: tuple[object, object],
    spec_engine: Engine,
    non_spec: ServeResult,
    requests: list[Request],
) -> None:
    """A KV budget that a few running requests pass: requests are retracted (their slot
    freed with a verify in flight, its tokens still taken) and resumed by prefilling
    prompt + outputs in a fresh slot, history and relay rebuilt by that prefill; the
    tokens equal the non-spec loop's. A resume before the in-flight verify was read (its
    accepted tokens missing from the recomputed prefix) or a stale history would change
    them; debug overlap checks the relay's consume order."""
    try:
        spec_engine.engine_cfg = CFG._replace(kv_budget=30)
        for run in (spec_engine.run_sync, spec_engine.run_overlap):
            res = run(requests)
            assert res.outputs == non_spec.outputs
            assert res.retractions > 0
            assert res.prefill_tokens > sum(len(r.prompt) for r in requests)
            assert res.drafts_accepted > 0
    finally:
        spec_engine.engine_cfg = CFG
    with pytest.raises(ValueError, match=r"request 0: prompt 10 \+ max_new 12 \+ K 3 exceeds"):
        m, params = model
        tight = CFG._replace(kv_budget=24)
        Engine(m, params, tight, speculative=Ngram(K)).run_sync(requests)  # type: ignore[arg-type]


def test_bad_input_is_named_before_anything_is_served(model: tuple[object, object]) -> None:
    m, params = model
    for k in (0, 17, True):
        with pytest.raises(ValueError, match=r"draft tokens \(K\)"):
            Ngram(k).check()  # type: ignore[arg-type]
    plain = fm_jax.FutureMap(CFG.pool_size, protocol="gather")
    with pytest.raises(ValueError, match="without a SpecConfig"):
        make_spec_step(m, plain, Ngram(K))  # type: ignore[arg-type]
    other = fm_jax.FutureMap(CFG.pool_size, protocol="gather", spec=Ngram(2).spec_config())
    with pytest.raises(ValueError, match=r"'draft_tokens' field of shape \(3,\)"):
        make_spec_step(m, other, Ngram(K))  # type: ignore[arg-type]
    engine = Engine(m, params, CFG, speculative=Ngram(K))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request 4: speculative decoding serves greedy"):
        engine.run_overlap([Request(4, (5, 6), 3, temperature=0.5)])
    small = CFG._replace(prefill_budget=4, token_buckets=(8,))
    with pytest.raises(ValueError, match=r"max_running x \(K \+ 1\) = 12"):
        Engine(m, params, small, speculative=Ngram(K)).run_sync([Request(0, (5,), 2)])  # type: ignore[arg-type]


def test_cli_refuses_k_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    from fm_serve.gemma.cli import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--speculative", "ngram", "--draft-tokens", "0"])
    assert exit_info.value.code == 2
    assert "draft tokens (K) must be an integer in [1, 16], got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--speculative", "ngram", "--temperature", "0.7"])
    assert "serves greedy requests" in capsys.readouterr().err


def test_cli_takes_spec_with_a_grammar_and_a_kv_budget() -> None:
    """`--speculative ngram` serves beside a grammar and under a KV budget (both once
    refused with it); the sampling settings it cannot verify stay refused."""
    from fm_serve.gemma.cli import parse_args
    from fm_serve.grammar import llguidance_available

    args = parse_args(["--speculative", "ngram", "--kv-budget", "200"])
    assert args.ngram == Ngram(4) and args.kv_budget == 200
    if llguidance_available():
        args = parse_args(["--speculative", "ngram", "--draft-tokens", "2", "--regex", "(a|b)"])
        assert args.ngram == Ngram(2) and args.grammar.source == "(a|b)"
    with pytest.raises(SystemExit):
        parse_args(["--speculative", "ngram", "--logprobs", "2"])
