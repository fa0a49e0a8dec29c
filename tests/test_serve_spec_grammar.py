"""Speculative decoding with a grammar (the split verify), and the spec x grammar matrix."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fm_serve.grammar import LLGUIDANCE_MISSING, llguidance_available

if not llguidance_available():
    pytest.skip(LLGUIDANCE_MISSING, allow_module_level=True)

from fm_serve.config import tiny_model
from fm_serve.engine import Engine, ServeResult
from fm_serve.grammar import DEAD_END, Grammar, satisfies, toy_tokenizer
from fm_serve.matrix import last_logits, near_ties, run_spec_grammar_matrix, toy_spec_grammar
from fm_serve.requests import Request


def test_spec_with_a_grammar_serves_the_non_spec_constrained_tokens() -> None:
    """Speculative decoding over constrained requests (masks for every verified position
    from the matcher advanced over the drafts, then rolled back) serves the non-spec
    constrained loop's tokens and reasons, in sync and debug overlap, with drafts of the
    constrained requests accepted. Request 4's grammar reaches a dead end one verified
    position past its bonus token ("ab", then a "z" no token spells): it ends with the
    dead end's reason there and the others go on. A mask built before the drafts were
    consumed, one position off, or not rolled back would change the tokens."""
    cfg = tiny_model()
    tokens = toy_tokenizer(cfg.vocab, cfg.eos_id)
    tokens.tokens[2 + ord("z")] = b"\xff<no z>"
    tokens.encode = lambda text: [2 + c for c in text if c != ord("z")]
    sg = toy_spec_grammar(tokens=tokens)
    dead = Request(4, tuple(2 + c for c in b"abababab"), 6)
    grammars = {**sg.grammars, 4: Grammar("regex", "ab?z")}
    reqs = [replace(r, grammar=grammars.get(r.rid)) for r in [*sg.served.requests, dead]]
    s = sg.served
    plain = Engine(s.model, s.params, s.engine, protocol="gather", grammar=sg.matchers)
    ref = plain.run_sync(reqs)
    assert ref.reasons[4] == DEAD_END and ref.outputs[4] == [2 + ord("a"), 2 + ord("b")]
    spec = Engine(
        s.model, s.params, s.engine, debug=True, speculative=sg.ngram, grammar=sg.matchers
    )
    for run in (spec.run_sync, spec.run_overlap):
        got = run(reqs)
        assert got.outputs == ref.outputs
        assert got.reasons == ref.reasons
        for rid, g in sg.grammars.items():
            assert satisfies(g, sg.text(got.outputs[rid])), (rid, sg.text(got.outputs[rid]))
        assert sum(got.accepted.get(rid, 0) for rid in sg.grammars) > 2, got.accepted
        assert got.accepted.get(4, 0) >= 1  # its dead end met past an accepted draft


def test_near_ties_measure_the_gap_where_outputs_part() -> None:
    """A difference at a token whose top two logits are far apart is no near-tie (its gap
    is the top two's); one output a prefix of the other is none either."""
    sg = toy_spec_grammar()
    r = sg.served.requests[2]
    logits = last_logits(sg.served.model, sg.served.params, r.prompt)
    top = [int(t) for t in np.argsort(-logits, kind="stable")[:3]]
    ref = ServeResult({r.rid: [top[0]]}, 0.0, 1, 0.0)
    for other, tie in ((top[1], logits[top[0]] - logits[top[1]] <= 1e-4), (top[2], False)):
        got = ServeResult({r.rid: [other]}, 0.0, 1, 0.0)
        (d,) = near_ties(sg, [r], ref, got)
        assert d["position"] == 0 and d["tokens"] == [top[0], other]
        assert d["gap"] == pytest.approx(float(logits[top[0]] - logits[top[1]]))
        assert d["near_tie"] == tie
    longer = ServeResult({r.rid: [top[0], 5]}, 0.0, 1, 0.0)
    assert near_ties(sg, [r], ref, longer) == [{"rid": r.rid, "position": 1, "near_tie": False}]


@pytest.mark.slow
def test_spec_grammar_matrix_on_the_toy_model() -> None:
    """Every cell of spec {off, on} x grammar {off, on} x {sync, debug overlap} is ok:
    tokens equal sync's and the non-spec loop's, constrained outputs complete and
    meeting their grammar, drafts accepted, the grammar changing what is served."""
    cells = run_spec_grammar_matrix(toy_spec_grammar(), debug=True)
    assert len(cells) == 8
    bad = [(c["setting"], c["overlap"], c["notes"], c["mismatches"]) for c in cells if not c["ok"]]
    assert not bad
    assert all(c["equal_to_non_spec"] for c in cells)
