"""Gemma 3 270M served on fm_jax's engine step: the three loops give the same tokens.

A few short requests (CI's share is small) that still reach every path: more requests than
slots (slots reused at once), a prompt longer than the prefill budget (chunked prefill),
prefill chunks beside running decodes (MIXED), requests ended by a stop token (read one
step late by the overlap loops) and by the token limit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gemma_weights import require_weights

require_weights()
pytestmark = pytest.mark.slow  # the real model's engines warmed: minutes on 2 cores

from fm_serve.config import engine_for  # noqa: E402
from fm_serve.engine import Engine, ServeResult  # noqa: E402
from fm_serve.gemma import cli  # noqa: E402
from fm_serve.gemma.load import Loaded, load_model  # noqa: E402
from fm_serve.requests import Request  # noqa: E402
from fm_serve.sweep import diff_outputs  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "List three fruits:",
    "The history of the Roman Empire spans many centuries, from its founding to",
    "Water boils at",
    "My favourite book is",
]
MAX_NEW = 8
MODES = ("sync", "overlap", "debug")


@pytest.fixture(scope="module")
def loaded() -> Loaded:
    got = load_model(max_seq_len=64, row_tile=4)
    full_stop = got.tokenizer.ids["."]  # a frequent stop, so some requests end early
    return Loaded(
        got.model._replace(stop_ids=(*got.model.stop_ids, full_stop)),
        got.params,
        got.tokenizer,
        got.unpacked,
        got.load_s,
        got.source,
    )


@pytest.fixture(scope="module")
def engines(loaded: Loaded) -> dict[str, Engine]:
    cfg = engine_for(max_running=3, prefill_budget=8, row_tile=loaded.model.row_tile)
    out = {}
    for mode in MODES:
        out[mode] = Engine(
            loaded.model, loaded.params, cfg, debug=mode == "debug", protocol="gather"
        )
        out[mode].warm_up(overlap=mode != "sync")  # overlap: the serving guard is on
    return out


def _requests(loaded: Loaded, temperature: float = 0.0, seed: int = 0) -> list[Request]:
    tok = loaded.tokenizer
    return [
        Request(i, tuple(tok.encode(p)), MAX_NEW, temperature, seed + i)
        for i, p in enumerate(PROMPTS)
    ]


def _serve(engine: Engine, mode: str, requests: list[Request]) -> ServeResult:
    return (engine.run_sync if mode == "sync" else engine.run_overlap)(requests)


@pytest.fixture(scope="module")
def greedy(loaded: Loaded, engines: dict[str, Engine]) -> dict[str, ServeResult]:
    return {m: _serve(e, m, _requests(loaded)) for m, e in engines.items()}


def test_greedy_run_reaches_every_path(loaded: Loaded, greedy: dict[str, ServeResult]) -> None:
    """Pins a request set too easy to test the loop: no chunking, no MIXED batch, no early
    stop, no request ended by its limit, no slot reuse."""
    ref = greedy["sync"]
    stops = set(loaded.model.stop_ids)
    ended = [out[-1] in stops for out in ref.outputs.values()]
    assert any(ended) and not all(ended)
    assert any(len(o) == MAX_NEW for o in ref.outputs.values())
    assert {"MIXED", "DECODE"} <= set(greedy["overlap"].modes)
    assert max(len(r.prompt) for r in _requests(loaded)) > 8  # chunked
    assert len(PROMPTS) > 3  # more requests than slots


def test_sync_overlap_and_debug_overlap_serve_the_same_greedy_tokens(
    greedy: dict[str, ServeResult],
) -> None:
    """Pins a relay fault on a real model (a decode row fed another slot's or a stale token,
    a slot reused before its stop was read, a debug invariant tripping on a correct run)."""
    for mode in ("overlap", "debug"):
        assert diff_outputs(mode, greedy["sync"], greedy[mode]) == []


def test_seeded_temperature_sampling_is_the_same_in_every_loop(
    loaded: Loaded, engines: dict[str, Engine], greedy: dict[str, ServeResult]
) -> None:
    """Pins sampling keyed by anything the loops schedule differently (the batch, the step,
    the row), or a temperature the step ignores."""
    hot = _requests(loaded, temperature=1.5, seed=7)
    sync = _serve(engines["sync"], "sync", hot)
    assert diff_outputs("overlap", sync, _serve(engines["overlap"], "overlap", hot)) == []
    assert sync.outputs != greedy["sync"].outputs
    reseeded = _serve(engines["sync"], "sync", _requests(loaded, temperature=1.5, seed=8))
    assert reseeded.outputs != sync.outputs


def test_fm_serve_prints_text_and_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pins the console command: text out, tokens/s and the per-step times, JSON written."""
    out = tmp_path / "run.json"
    args = ["--prompt", "The capital of France is", "--max-tokens", "4", "--max-running", "2"]
    args += ["--prefill-budget", "8", "--max-seq-len", "64", "--no-compile-cache"]
    assert cli.main([*args, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tok/s" in printed and "per step: host" in printed
    doc = json.loads(out.read_text())
    run = doc["runs"]["overlap"]
    assert run["tokens"] == 4 and run["texts"][0].strip()
    assert run["host_ms_per_step"] > 0
