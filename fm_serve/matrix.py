"""End-to-end correctness matrix: overlap tokens equal the synchronous run's in every setting.

As vLLM tests its async scheduling: the same requests served synchronously and with overlap,
across relay protocol (sentinel, gather) x debug (off, on) x chunked prefill (on, off) x
MIXED batches (on, off) x slot reuse (heavy: a few slots for many requests; none: a slot
per request). The model is batch-invariant (`tiles.by_tiles`), so every setting's synchronous
run must also give the same tokens as every other's: one reference for the whole matrix.

The sampling-feature matrix (`run_feature_matrix`), on the toy model or Gemma 3: each of
the settings {default, presence_penalty -1, bad words, logprobs 2, logprobs 2 with
presence_penalty -1, seeded sampling with top-p, stop strings, an abort} x preemption
(off; on: a KV budget that retracts requests) x {sync, overlap, debug overlap}, every
run's tokens equal to the setting's synchronous run without preemption and its logprobs
within rel 1e-3 / abs 1e-6; and each setting (and preemption) checked to change what is
served.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fm_serve.config import TINY_REQUESTS, EngineConfig, ModelConfig, tiny_model
from fm_serve.engine import Engine, ServeResult
from fm_serve.grammar import Grammar, GrammarTokenizer, Matchers, satisfies
from fm_serve.model import toy
from fm_serve.requests import Request, make_requests
from fm_serve.sampling import Features, Sampling
from fm_serve.spec import Ngram
from fm_serve.sweep import diff_outputs

AXES = ("protocol", "debug", "chunked", "mixed", "reuse")


@dataclass(frozen=True)
class Cell:
    """One setting of the matrix."""

    protocol: str
    debug: bool
    chunked: bool
    mixed: bool
    reuse: bool

    def name(self) -> str:
        """The setting in words, e.g. 'gather debug chunked mixed reuse'."""
        flags = [f if getattr(self, f) else f"no-{f}" for f in AXES[1:]]
        return " ".join([self.protocol, *flags])


def engine_config(cell: Cell, requests: int, row_tile: int) -> EngineConfig:
    """The engine for a cell: a prefill budget below the longest prompt (chunked) or above
    it; 3 slots (heavy reuse) or one per request."""
    running = 3 if cell.reuse else requests
    budget = 12 if cell.chunked else TINY_REQUESTS.prompt_len[1] + 2
    up = lambda n: n + (-n % row_tile)  # noqa: E731
    batch = tuple(sorted({up(min(4, running)), up(running)}))
    tokens = tuple(sorted({up(running), up(budget + running)}))
    return EngineConfig(
        max_running=running,
        prefill_budget=budget,
        batch_buckets=batch,
        token_buckets=tokens,
        mixed=cell.mixed,
    )


def cells(half: bool = False) -> list[Cell]:
    """Every cell of the matrix (32), or (`half`) the half fraction of 16 cells in which an
    even number of the five axes take their second value (the 2^(5-1) design of defining
    relation I = ABCDE): any four axes still meet in all 16 of their combinations, so a
    fault that needs up to four settings at once shows in the half as in the whole."""
    values: tuple[tuple[Any, Any], ...] = (
        ("sentinel", "gather"),
        (False, True),
        (True, False),
        (True, False),
        (True, False),
    )
    every = itertools.product(*((0, 1),) * len(AXES))
    return [
        Cell(*(axis[i] for axis, i in zip(values, at, strict=True)))
        for at in every
        if not half or sum(at) % 2 == 0
    ]


def run_matrix(
    n_requests: int = 24,
    model: ModelConfig | None = None,
    only: Sequence[Cell] | None = None,
    half: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, list[str]]:
    """Serve the requests in every cell; returns cell name -> mismatches (empty: equal).

    Each cell's sync and overlap runs are compared with the first cell's sync run. `only`
    picks cells; `half` runs the half fraction (`cells(half=True)`).
    """
    model = model or tiny_model()
    shape = TINY_REQUESTS
    requests: list[Request] = make_requests(
        n_requests, vocab=model.vocab, prompt_len=shape.prompt_len, max_new=shape.max_new
    )
    ref: ServeResult | None = None
    out: dict[str, list[str]] = {}
    for cell in only or cells(half):
        cfg = engine_config(cell, n_requests, model.row_tile)
        engine = Engine(*toy(model), cfg, debug=cell.debug, protocol=cell.protocol)
        sync = engine.run_sync(requests)
        ref = ref or sync
        got = engine.run_overlap(requests)
        bad = diff_outputs("sync", ref, sync) + diff_outputs("overlap", ref, got)
        if cell.mixed and cell.chunked and "MIXED" not in got.modes:
            bad.append("no MIXED batch was served")
        if not cell.mixed and "MIXED" in got.modes:
            bad.append("a MIXED batch was served with MIXED off")
        out[cell.name()] = bad
        log(f"{cell.name()}: {'equal' if not bad else f'{len(bad)} mismatches'}")
    return out


# ------------------------------------------------------------------ the sampling features
SETTINGS = (
    "default",
    "presence_penalty",
    "bad_words",
    "logprobs",
    "logprobs_presence",
    "seeded_top_p",
    "stop_strings",
    "abort",
)
"""The served settings: greedy unless named, as vLLM's async-scheduling test and beyond."""
MODES = ("sync", "overlap", "debug")

LOGPROB_RTOL, LOGPROB_ATOL = 1e-3, 1e-6


@dataclass
class Served:
    """A model to serve the feature matrix on, with its request set.

    `bad_words`: the tokenizer's equivalent of ["the", " the"] (the toy model: its most
    frequent output tokens); `decode`: ids -> text for stop strings.
    """

    model: Any
    params: Any
    requests: list[Request]
    engine: EngineConfig
    kv_budget: int
    decode: Callable[[Sequence[int]], str]
    bad_words: tuple[tuple[int, ...], ...] | None = None


def toy_decode(ids: Sequence[int]) -> str:
    """The toy model's text: a character per token id (injective)."""
    return "".join(chr(0x100 + int(i)) for i in ids)


def toy_served(n_requests: int = 8, model: ModelConfig | None = None) -> Served:
    """The tiny toy model: 3 slots (heavy reuse), chunked prefill, a KV budget of a bit
    more than the longest request, so the newest running request is retracted often."""
    model = model or tiny_model()
    shape = TINY_REQUESTS
    reqs = make_requests(
        n_requests, vocab=model.vocab, prompt_len=shape.prompt_len, max_new=shape.max_new
    )
    cfg = engine_config(Cell("gather", False, True, True, True), n_requests, model.row_tile)
    longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    return Served(*toy(model), reqs, cfg, longest + 8, toy_decode)


def _with(settings: Sampling, reqs: Sequence[Request], **kw: Any) -> list[Request]:
    return [replace(r, sampling=replace(settings, **kw)) for r in reqs]


def setting_requests(
    name: str, served: Served, reference: ServeResult
) -> tuple[list[Request], dict[int, int]]:
    """The requests of a setting, and (abort) rid -> the output tokens after which the
    request is aborted. `reference`: the default setting's run (stop strings and the toy's
    bad words are taken from its outputs, so that they occur)."""
    reqs, none = served.requests, Sampling()
    if name == "default":
        return list(reqs), {}
    if name == "presence_penalty":
        return _with(none, reqs, presence_penalty=-1.0), {}
    if name == "bad_words":
        words = served.bad_words
        if words is None:  # the toy: its two most frequent output tokens
            counts = collections.Counter(t for o in reference.outputs.values() for t in o[:-1])
            words = tuple((t,) for t, _ in counts.most_common(2))
        return _with(none, reqs, bad_words=words), {}
    if name == "logprobs":
        return _with(none, reqs, logprobs=2), {}
    if name == "logprobs_presence":
        return _with(none, reqs, logprobs=2, presence_penalty=-1.0), {}
    if name == "seeded_top_p":
        return [
            replace(r, temperature=1.0, seed=100 + r.rid, sampling=replace(none, top_p=0.8))
            for r in reqs
        ], {}
    if name == "stop_strings":
        out = []
        for r in reqs:  # the text of two tokens three quarters through the reference
            o = reference.outputs[r.rid]  # output: requests stay long enough to preempt
            k = 3 * len(o) // 4
            stop = (served.decode(o[k : k + 2]),) if len(o) >= 4 else ()
            out.append(replace(r, sampling=replace(none, stop=stop)))
        return out, {}
    if name == "abort":
        return list(reqs), {r.rid: 2 for r in reqs if r.rid % 3 == 0 and r.max_new_tokens > 3}
    raise ValueError(f"unknown setting {name!r}; the settings are {SETTINGS}")


def logprobs_close(ref: ServeResult, got: ServeResult) -> list[str]:
    """Mismatches of two runs' logprobs beyond rel 1e-3 / abs 1e-6 (top ids exactly)."""
    bad = []
    for rid, want in ref.logprobs.items():
        have = got.logprobs.get(rid, [])
        if len(have) != len(want):
            bad.append(f"request {rid}: {len(want)} logprob entries, got {len(have)}")
            continue
        for i, ((a, ids_a, lp_a), (b, ids_b, lp_b)) in enumerate(zip(want, have, strict=True)):
            close = np.allclose([a, *lp_a], [b, *lp_b], rtol=LOGPROB_RTOL, atol=LOGPROB_ATOL)
            if ids_a != ids_b or not close:
                bad.append(f"request {rid} token {i}: {(a, ids_a, lp_a)} vs {(b, ids_b, lp_b)}")
    return bad


def _serve(
    engine: Engine, mode: str, reqs: Sequence[Request], aborts: dict[int, int]
) -> ServeResult:
    def on_token(st: Any, tok: int) -> None:
        if len(st.output) == aborts.get(st.req.rid, -1):
            engine.abort(st.req.rid)

    run = engine.run_sync if mode == "sync" else engine.run_overlap
    return run(reqs, on_token=on_token if aborts else None)


def _vacuity(
    name: str,
    reqs: Sequence[Request],
    got: ServeResult,
    default: ServeResult,
    plain_sampled: ServeResult,
) -> list[str]:
    """Why a setting's reference serves nothing it should change (empty: it does)."""
    changes = ("presence_penalty", "logprobs_presence", "bad_words", "stop_strings", "abort")
    if name in changes and diff_outputs("", default, got) == []:
        return [f"{name}: the tokens equal the default setting's"]
    if name == "bad_words":
        words = reqs[0].sampling.bad_words
        for rid, o in got.outputs.items():
            seq = list(reqs[rid].prompt) + o
            for w in words:
                n = len(w)
                if any(
                    tuple(seq[i : i + n]) == w
                    for i in range(len(reqs[rid].prompt), len(seq) - n + 1)
                ):
                    return [f"bad_words: request {rid} produced {w}"]
    if name in ("logprobs", "logprobs_presence"):
        entries = [e for v in got.logprobs.values() for e in v]
        if len(entries) != got.tokens:
            return [f"{name}: {len(entries)} logprob entries for {got.tokens} tokens"]
        if name == "logprobs" and any(
            e[1][0] != t
            for rid, v in got.logprobs.items()
            for e, t in zip(v, got.outputs[rid], strict=True)
        ):
            return ["logprobs: a greedy token is not its top logprob"]
        if not all(e[0] < 0 and e[2][0] >= e[2][1] for e in entries):
            return [f"{name}: logprobs not negative and ordered"]
    if name == "seeded_top_p" and diff_outputs("", plain_sampled, got) == []:
        return ["seeded_top_p: the tokens equal seeded sampling without top-p"]
    if name == "abort" and not got.aborted:
        return ["abort: no request was aborted"]
    return []


def run_feature_matrix(
    served: Served,
    *,
    settings: Sequence[str] = SETTINGS,
    modes: Sequence[str] = MODES,
    protocol: str = "gather",
    features: Features | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Serve every setting x preemption (off, on) x mode (sync, overlap, debug overlap); a
    cell per run, its tokens (and logprobs) compared with the setting's synchronous run
    without preemption. Non-vacuity: each setting changes what is served against the
    default (`_vacuity`), and preemption retracts requests and prefills more tokens.

    `features`: the one feature set every run's engine computes (fewer compiles; a feature
    a setting leaves off then runs with neutral values); None: each setting's least."""
    engines: dict[tuple[Any, bool], Engine] = {}

    def engine_for_run(features: Features, debug: bool, budget: int | None) -> Engine:
        key = (features, debug)
        if key not in engines:
            engines[key] = Engine(
                served.model,
                served.params,
                served.engine,
                debug=debug,
                protocol=protocol,
                features=features,
                decode=served.decode,
            )
        e = engines[key]
        e.engine_cfg = served.engine._replace(kv_budget=budget)
        return e

    none = features or Features()
    default = engine_for_run(none, False, None).run_sync(served.requests)
    plain_sampled = default
    if "seeded_top_p" in settings:  # seeded sampling without top-p, to tell top-p's effect
        sampled, _ = setting_requests("seeded_top_p", served, default)
        plain = [replace(r, sampling=Sampling()) for r in sampled]
        plain_sampled = engine_for_run(none, False, None).run_sync(plain)
    cells_out: list[dict[str, Any]] = []
    for name in settings:
        reqs, aborts = setting_requests(name, served, default)
        computed = features or Features.of([r.sampling for r in reqs])
        ref = _serve(engine_for_run(computed, False, None), "sync", reqs, aborts)
        vacuous = _vacuity(name, reqs, ref, default, plain_sampled)
        for preempt in (False, True):
            for mode in modes:
                budget = served.kv_budget if preempt else None
                e = engine_for_run(computed, mode == "debug", budget)
                got = _serve(e, mode, reqs, aborts)
                tokens = diff_outputs(mode, ref, got)
                lps = logprobs_close(ref, got)
                notes = list(vacuous)
                if preempt and got.retractions == 0:
                    notes.append("preemption: no request was retracted")
                if preempt and got.prefill_tokens <= ref.prefill_tokens:
                    notes.append("preemption: no prefix was recomputed")
                cell = {
                    "setting": name,
                    "preemption": preempt,
                    "overlap": mode != "sync",
                    "debug": mode == "debug",
                    "protocol": protocol,
                    "tokens_equal": not tokens,
                    "logprobs_equal": not lps,
                    "non_vacuous": not notes,
                    "retractions": got.retractions,
                    "prefill_tokens": got.prefill_tokens,
                    "output_tokens": got.tokens,
                    "aborted": got.aborted,
                    "mismatches": (tokens + lps)[:5],
                    "notes": notes,
                }
                cells_out.append(cell)
                ok = cell["tokens_equal"] and cell["logprobs_equal"] and cell["non_vacuous"]
                log(
                    f"{name} preemption={'on' if preempt else 'off'} {mode}: "
                    f"{'ok' if ok else 'FAIL'} ({got.retractions} retractions)"
                )
    return cells_out


# ---------------------------------------------------- speculative decoding x grammar
NEAR_TIE = 1e-4
"""The largest gap of the top two logits that explains a greedy difference (float32)."""


@dataclass
class SpecGrammar:
    """What the spec x grammar matrix serves: `served`'s requests (greedy, no sampling
    settings), the ones named in `grammars` constrained when the grammar is on.

    Attributes:
      matchers: the model's vocabulary for llguidance (`grammar.Matchers`).
      text: ids -> the text a grammar constrains (special tokens left out).
      ngram: the drafter when speculative decoding is on.
    """

    served: Served
    grammars: dict[int, Grammar]
    matchers: Matchers
    text: Callable[[Sequence[int]], str]
    ngram: Ngram


def toy_spec_grammar(
    ngram: Ngram | None = None, tokens: GrammarTokenizer | None = None
) -> SpecGrammar:
    """The toy model's spec x grammar requests (byte tokens, `grammar.toy_tokenizer`, or
    `tokens`): prompts that repeat what their grammar asks for (lookup drafts it), beside
    an unconstrained request whose prompt repeats itself."""
    from fm_serve.grammar import toy_decode as byte_text
    from fm_serve.grammar import toy_tokenizer

    model_cfg = tiny_model()
    model, params = toy(model_cfg)

    def ids(text: str) -> tuple[int, ...]:
        return tuple(2 + c for c in text.encode())

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    reqs = [
        Request(0, ids("abababab"), 12),
        Request(1, ids('{"ok":true,"n":22}{"ok":'), 30),
        Request(2, (20, 21, 20, 21, 20), 8),
        Request(3, ids("[0-9]"), 12),
    ]
    grammars = {
        0: Grammar("regex", "(ab){1,5}!"),
        1: Grammar("json_schema", json.dumps(schema)),
        3: Grammar("regex", "[0-9]{3}-[a-c]{2}"),
    }
    cfg = EngineConfig(max_running=3, prefill_budget=8, batch_buckets=(4,), token_buckets=(12,))
    tokens = tokens or toy_tokenizer(model_cfg.vocab, model_cfg.eos_id)
    served = Served(model, params, reqs, cfg, 0, toy_decode)
    return SpecGrammar(
        served, grammars, Matchers(tokens, model_cfg.vocab), byte_text, ngram or Ngram(3)
    )


@functools.cache
def _forward(model: Any) -> Callable[..., Any]:
    import jax

    return jax.jit(model.forward)


def last_logits(model: Any, params: Any, ids: Sequence[int]) -> np.ndarray:
    """The model's logits [V] after `ids` (one prefill into a fresh cache's slot 1)."""
    n, tile = len(ids), model.row_tile
    t = n + (-n % tile)
    flat = np.zeros(t, np.int32)
    flat[:n] = ids
    slots = np.zeros(t, np.int32)
    slots[:n] = 1
    pos = np.zeros(t, np.int32)
    pos[:n] = np.arange(n)
    last = np.zeros(tile, np.int32)
    last[0] = n - 1
    logits, _ = _forward(model)(params, model.init_cache(2), flat, slots, pos, last)
    return np.asarray(logits[0], np.float32)


def near_ties(
    sg: SpecGrammar, reqs: Sequence[Request], ref: ServeResult, got: ServeResult
) -> list[dict[str, Any]]:
    """Each request whose output differs from `ref`'s, at its first difference: the two
    tokens, the gap of the top two logits there (within the grammar's mask for a
    constrained request) and whether the difference is a near-tie (the two tokens are the
    top two, their gap <= NEAR_TIE)."""
    out: list[dict[str, Any]] = []
    for r in reqs:
        a, b = ref.outputs.get(r.rid, []), got.outputs.get(r.rid, [])
        if a == b:
            continue
        p = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if p is None:  # one is a prefix of the other: a stop, not a choice
            out.append({"rid": r.rid, "position": min(len(a), len(b)), "near_tie": False})
            continue
        logits = last_logits(sg.served.model, sg.served.params, list(r.prompt) + a[:p])
        if r.grammar is not None:
            m = sg.matchers.compile(r.grammar)
            m.consume_tokens(a[:p])
            words = np.zeros(sg.matchers.words, np.int32)
            sg.matchers.fill(m, words)
            bits = (words[np.arange(logits.size) // 32] >> (np.arange(logits.size) % 32)) & 1
            logits = np.where(bits.astype(bool), logits, -np.inf)
        top = np.argsort(-logits, kind="stable")[:2]
        gap = float(logits[top[0]] - logits[top[1]])
        tie = {int(a[p]), int(b[p])} == {int(t) for t in top} and gap <= NEAR_TIE
        out.append(
            {"rid": r.rid, "position": p, "tokens": [a[p], b[p]], "gap": gap, "near_tie": tie}
        )
    return out


def run_spec_grammar_matrix(
    sg: SpecGrammar,
    *,
    debug: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Serve the requests under speculative decoding {off, on} x grammar {off, on} x
    loop {sync, overlap}; a cell per run (greedy throughout).

    Each cell: its tokens equal the same setting's synchronous run (`equal_to_sync`) and
    the non-speculative synchronous run of the same grammar setting
    (`equal_to_non_spec`), or every difference is a near-tie of the logits (`near_ties`);
    grammar on: every constrained output is complete and meets its grammar
    (`constrained_ok`). Non-vacuity: speculative decoding accepted drafts (grammar on: on
    the constrained requests too), and each constrained output differs from the same
    request's unconstrained one (the grammar changed what was served).
    """
    served = sg.served
    k = sg.ngram.draft_tokens
    cfg = served.engine
    tile = served.model.row_tile
    verify = -(-cfg.max_running * (k + 1) // tile) * tile
    spec_cfg = cfg._replace(
        token_buckets=tuple(sorted({*cfg.token_buckets, verify})), kv_budget=None
    )
    engines = {
        False: Engine(
            served.model,
            served.params,
            cfg._replace(kv_budget=None),
            debug=debug,
            protocol="gather",
            grammar=sg.matchers,
            decode=served.decode,
        ),
        True: Engine(
            served.model,
            served.params,
            spec_cfg,
            debug=debug,
            speculative=sg.ngram,
            grammar=sg.matchers,
            decode=served.decode,
        ),
    }
    plain = list(served.requests)
    constrained = [replace(r, grammar=sg.grammars.get(r.rid)) for r in plain]
    runs: dict[tuple[bool, bool, str], ServeResult] = {}
    for grammar in (False, True):
        for spec in (False, True):
            for mode in ("sync", "overlap"):
                reqs = constrained if grammar else plain
                e = engines[spec]
                runs[spec, grammar, mode] = (e.run_sync if mode == "sync" else e.run_overlap)(reqs)
    out = []
    for (spec, grammar, mode), got in runs.items():
        reqs = constrained if grammar else plain
        sync, ref = runs[spec, grammar, "sync"], runs[False, grammar, "sync"]
        to_sync = diff_outputs(mode, sync, got)
        ties = near_ties(sg, reqs, ref, got) if spec else []
        to_ref = diff_outputs(mode, ref, got)
        notes: list[str] = []
        ok_constrained = None
        if grammar:
            ok_constrained = True
            unconstrained = runs[spec, False, mode]
            for rid, g in sg.grammars.items():
                text = sg.text(got.outputs.get(rid, []))
                complete = got.reasons.get(rid) == "grammar complete"
                if not complete or not satisfies(g, text):
                    ok_constrained = False
                    notes.append(f"request {rid}: {got.reasons.get(rid)!r}, {text!r}")
                if got.outputs.get(rid) == unconstrained.outputs.get(rid):
                    notes.append(f"request {rid}: the grammar changed nothing")
        if spec and got.drafts_accepted == 0:
            notes.append("speculative: no draft was accepted")
        if spec and grammar and not any(got.accepted.get(rid) for rid in sg.grammars):
            notes.append("speculative: no draft of a constrained request was accepted")
        cell = {
            "setting": f"spec {'on' if spec else 'off'} grammar {'on' if grammar else 'off'}",
            "spec": spec,
            "grammar": grammar,
            "overlap": mode == "overlap",
            "debug": debug and mode == "overlap",
            "tokens_equal": not to_ref,
            "equal_to_sync": not to_sync,
            "equal_to_non_spec": not to_ref,
            "near_ties": ties,
            "constrained_ok": ok_constrained,
            "non_vacuous": not any("changed nothing" in n or "no draft" in n for n in notes),
            "steps": got.steps,
            "modes": got.modes,
            "output_tokens": got.tokens,
            "drafts_proposed": got.drafts_proposed,
            "drafts_accepted": got.drafts_accepted,
            "accepted_by_request": got.accepted,
            "reasons": got.reasons,
            "outputs": got.outputs,
            "mismatches": (to_sync + to_ref)[:5],
            "notes": notes,
        }
        cell["ok"] = (
            cell["equal_to_sync"]
            and (cell["equal_to_non_spec"] or all(t["near_tie"] for t in ties))
            and ok_constrained is not False
            and cell["non_vacuous"]
        )
        out.append(cell)
        log(
            f"{cell['setting']} {mode}: {'ok' if cell['ok'] else 'FAIL'} "
            f"({got.drafts_accepted}/{got.drafts_proposed} drafts accepted, {got.steps} steps)"
        )
    return out
