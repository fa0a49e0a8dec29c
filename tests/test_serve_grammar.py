"""Structured output (llguidance regex / JSON schema) with the split step, on the toy model."""

from __future__ import annotations

import json
import re

import pytest

from fm_serve.grammar import LLGUIDANCE_MISSING, llguidance_available

if not llguidance_available():
    pytest.skip(LLGUIDANCE_MISSING, allow_module_level=True)

from fm_serve.config import EngineConfig, tiny_model
from fm_serve.engine import Engine, ServeResult
from fm_serve.grammar import DEAD_END, Grammar, toy_decode, toy_tokenizer
from fm_serve.model import toy
from fm_serve.requests import Request

CFG = EngineConfig(max_running=3, prefill_budget=8, batch_buckets=(4,), token_buckets=(12,))
REGEX = "[0-9]{3}-[a-c]{2}"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    cfg = tiny_model()
    model, params = toy(cfg)
    tokens = toy_tokenizer(cfg.vocab, cfg.eos_id)
    return Engine(model, params, CFG, protocol="gather", grammar=tokens, decode=toy_decode)


@pytest.fixture(scope="module")
def requests() -> list[Request]:
    """Two constrained requests (one sampled) beside an unconstrained one, which shares
    their split steps; a prompt longer than a prefill chunk."""
    return [
        Request(0, (5, 6, 7), 12, grammar=Grammar("regex", REGEX)),
        Request(1, tuple(range(9, 19)), 30, grammar=Grammar("json_schema", json.dumps(SCHEMA))),
        Request(2, (20, 21), 8),
        Request(3, (30, 31, 32), 8, temperature=0.8, seed=3, grammar=Grammar("regex", "(yes|no)!")),
    ]


@pytest.fixture(scope="module")
def sync(engine: Engine, requests: list[Request]) -> ServeResult:
    return engine.run_sync(requests)


def test_constrained_outputs_match_and_parse(sync: ServeResult) -> None:
    """Every constrained output matches its regex or parses under its schema, and its
    grammar finished it (a mask not applied, or applied to the wrong row, fails this)."""
    assert re.fullmatch(REGEX, toy_decode(sync.outputs[0]))
    doc = json.loads(toy_decode(sync.outputs[1]))
    assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and doc["n"] in (1, 22, 333)
    assert re.fullmatch("(yes|no)!", toy_decode(sync.outputs[3]))
    assert sync.reasons == {0: "grammar complete", 1: "grammar complete", 3: "grammar complete"}
    assert len(sync.outputs[2]) == 8


def test_overlap_tokens_equal_sync(
    engine: Engine, requests: list[Request], sync: ServeResult
) -> None:
    """The split overlap step (forward dispatched before the host advanced the grammars
    with the previous tokens) serves the synchronous loop's tokens: a mask one step stale
    would change them."""
    res = engine.run_overlap(requests)
    assert res.outputs == sync.outputs
    assert res.reasons == sync.reasons


def test_bad_grammar_is_named_before_anything_is_served(engine: Engine) -> None:
    bad = [Request(0, (5,), 4), Request(7, (5,), 4, grammar=Grammar("regex", "[0-9"))]
    with pytest.raises(ValueError, match=r"(?s)request 7: regex does not compile: .*unclosed"):
        engine.run_overlap(bad)
    schema = Request(8, (5,), 4, grammar=Grammar("json_schema", "{not json"))
    with pytest.raises(ValueError, match="request 8: JSON schema is not JSON"):
        engine.run_sync([schema])
    cfg = tiny_model()
    model, params = toy(cfg)
    with pytest.raises(ValueError, match="request 9: has a grammar, but the engine was built"):
        Engine(model, params, CFG).run_sync([Request(9, (5,), 4, grammar=Grammar("regex", "a"))])


def test_a_dead_end_finishes_that_request_and_the_others_go_on() -> None:
    """A grammar whose next byte no token spells (a vocabulary without "z") ends its
    request with the reason, after the tokens it could take; the other request runs on."""
    cfg = tiny_model()
    model, params = toy(cfg)
    tokens = toy_tokenizer(cfg.vocab, cfg.eos_id)
    tokens.tokens[2 + ord("z")] = b"\xff<no z>"
    tokens.encode = lambda text: [2 + c for c in text if c != ord("z")]
    engine = Engine(model, params, CFG, grammar=tokens, decode=toy_decode)
    reqs = [Request(0, (5, 6), 6, grammar=Grammar("regex", "ab?z")), Request(1, (7, 8), 5)]
    res = engine.run_sync(reqs)
    assert len(res.outputs[1]) == 5
    assert toy_decode(res.outputs[0]) in ("a", "ab")
    assert res.reasons == {0: DEAD_END}
