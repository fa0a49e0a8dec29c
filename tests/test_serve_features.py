"""The serving loop's sampling features, abort and preemption on the tiny toy model.

The small feature matrix (`matrix.run_feature_matrix`): every setting x preemption off/on
x sync/overlap, tokens equal to the setting's synchronous run and logprobs within rel 1e-3
/ abs 1e-6, each setting checked to change what is served. One engine computing every
feature serves all of them (two compiled steps), so the module stays quick.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from fm_serve.engine import Engine
from fm_serve.matrix import SETTINGS, run_feature_matrix, setting_requests, toy_served
from fm_serve.sampling import Features, Sampling
from fm_serve.sweep import diff_outputs

EVERY = Features(penalties=True, bad_words=(2, 2), logprobs=2, filtered=True)


@pytest.fixture(scope="module")
def served() -> Any:
    return toy_served(8)


@pytest.fixture(scope="module")
def engine(served: Any) -> Engine:
    return Engine(
        served.model,
        served.params,
        served.engine,
        protocol="gather",
        features=EVERY,
        decode=served.decode,
    )


def test_small_feature_matrix_overlap_equals_sync(served: Any) -> None:
    """Pins overlap reading stale penalty counts or recent tokens (step N's token missing
    at step N+1), logprobs paired with the wrong step, a stop string or abort read late
    keeping an extra token, or a resumed request recomputed wrong: every cell equal to its
    setting's synchronous reference, every setting and preemption changing what is served."""
    cells = run_feature_matrix(served, modes=("sync", "overlap"), features=EVERY)
    assert len(cells) == len(SETTINGS) * 2 * 2
    bad = [c for c in cells if not (c["tokens_equal"] and c["logprobs_equal"])]
    assert bad == []
    vacuous = [(c["setting"], c["notes"]) for c in cells if not c["non_vacuous"]]
    assert vacuous == []
    assert all(c["retractions"] > 0 for c in cells if c["preemption"])


def test_a_reused_slot_reads_no_stale_counts(served: Any, engine: Engine) -> None:
    """Pins a slot's penalty counts or seen tokens surviving into its next request: 8
    requests on 3 slots (each reused) serve what each request served alone does."""
    reqs = [
        replace(r, sampling=Sampling(presence_penalty=-1.0, repetition_penalty=1.5))
        for r in served.requests
    ]
    together = engine.run_sync(reqs)
    for r in reqs:
        alone = engine.run_sync([r])
        assert alone.outputs[r.rid] == together.outputs[r.rid], r.rid


def test_penalties_read_the_previous_step_s_token(served: Any, engine: Engine) -> None:
    """Pins the non-vacuity of the penalty test: a frequency penalty of 2 makes a greedy
    request never repeat a token its output already holds, in either loop."""
    reqs = [replace(r, sampling=Sampling(frequency_penalty=2.0)) for r in served.requests]
    for run in (engine.run_sync, engine.run_overlap):
        got = run(reqs)
        for rid, out in got.outputs.items():
            # repeats are possible only where every other logit is 2 or more lower
            assert len(set(out)) >= len(out) - 1, (rid, out)


def test_bad_input_is_refused_by_name_and_the_rest_served(served: Any, engine: Engine) -> None:
    """Pins a setting out of range served silently, and an abort of an unknown or finished
    request stopping the run (or accepted without a word)."""
    r0 = served.requests[0]
    for kw, name in [
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"top_p": 0.0}, "top_p"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logprobs": 30}, "logprobs"),
        ({"bad_words": ((),)}, "bad word"),
        ({"bad_words": ((10**6,),)}, "bad word"),
        ({"stop": ("",)}, "stop string"),
    ]:
        with pytest.raises(ValueError, match=name):
            engine.run_sync([replace(r0, sampling=Sampling(**kw))])
    with pytest.raises(ValueError, match="temperature"):
        engine.run_sync([replace(r0, temperature=float("nan"))])
    plain = Engine(served.model, served.params, served.engine, protocol="gather")
    with pytest.raises(ValueError, match="penalties"):
        plain.run_sync([replace(r0, sampling=Sampling(presence_penalty=1.0))])

    errors: list[str] = []
    reference = engine.run_overlap(served.requests)

    def on_token(st: Any, tok: int) -> None:
        for rid in (999, served.requests[-1].rid if st.req.rid == 0 else None):
            if rid is None:
                continue
            try:
                engine.abort(rid)
            except KeyError as err:
                errors.append(str(err))

    got = engine.run_overlap(served.requests, on_token=on_token)
    assert any("no request 999" in e for e in errors)
    assert any("already finished" in e for e in errors) or got.aborted
    kept = [r.rid for r in served.requests if r.rid not in got.aborted]
    assert kept and all(got.outputs[rid] == reference.outputs[rid] for rid in kept)


def test_abort_streams_no_token_after_it(served: Any, engine: Engine) -> None:
    """Pins a token streamed (or kept) after an abort although the overlap loop has the
    request's next step in flight: exactly the tokens before the abort, in both loops."""
    streamed: dict[int, list[int]] = {}

    def on_token(st: Any, tok: int) -> None:
        streamed.setdefault(st.req.rid, []).append(tok)
        if st.req.rid == 1 and len(st.output) == 2:
            engine.abort(1)

    full = engine.run_sync(served.requests).outputs[1]
    assert len(full) > 3
    for run in (engine.run_sync, engine.run_overlap):
        streamed.clear()
        got = run(served.requests, on_token=on_token)
        assert got.outputs[1] == streamed[1] == full[:2] and got.aborted == [1]
        assert all(streamed[r] == got.outputs[r] for r in got.outputs)


def test_logprobs_are_the_raw_log_softmax(served: Any, engine: Engine) -> None:
    """Pins logprobs of the processed logits (or of another row): with no setting the
    greedy token is the top logprob, the two top logprobs are ordered and sum below 0."""
    reqs = [replace(r, sampling=Sampling(logprobs=2)) for r in served.requests]
    got = engine.run_overlap(reqs)
    for rid, out in got.outputs.items():
        lps = got.logprobs[rid]
        assert len(lps) == len(out)
        for tok, (lp, ids, top) in zip(out, lps, strict=True):
            assert ids[0] == tok and lp == pytest.approx(top[0]) and top[0] >= top[1]
            assert np.logaddexp(*top) <= 1e-6


def test_a_feature_off_is_not_computed() -> None:
    """Pins a feature compiled into every step (no feature is free when off): a run's least
    features are those its requests ask for."""
    assert Features.of([Sampling()]) == Features()
    assert Features.of([Sampling(top_p=0.9), Sampling(logprobs=3)]) == Features(
        logprobs=3, filtered=True
    )
    assert Features.of([Sampling(bad_words=((1, 2, 3), (4,)))]).bad_words == (2, 3)


def test_setting_requests_refuses_an_unknown_setting(served: Any, engine: Engine) -> None:
    """Pins a typo'd matrix setting served as the default."""
    ref = engine.run_sync(served.requests[:1])
    with pytest.raises(ValueError, match="unknown setting"):
        setting_requests("nope", served, ref)
    assert diff_outputs("", ref, ref) == []
