"""`fm-serve-bench --matrix` and `--costs`: the sampling features on Gemma 3.

--matrix: `matrix.run_feature_matrix` on Gemma 3 (the real weights, or `--random-weights`):
every setting x preemption x {sync, overlap, debug overlap}, written as
`gemma_matrix_<tag>.json` (a list `cells`, each with its setting and `tokens_equal`).

--costs: each feature's price per step: the same requests served with the feature off
(the engine without it) and on (the engine with it, every request using it), sync and
overlap, `--repeats` times interleaved; per mode the median host time per step (µs) and
step time (sync: dispatch to tokens; overlap: wall per step), written as
`gemma_feature_costs_<tag>.{json,md}`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fm_serve.config import engine_for
from fm_serve.engine import Engine
from fm_serve.matrix import SETTINGS, Served, run_feature_matrix
from fm_serve.sampling import Features, Sampling

EVERY = Features(penalties=True, bad_words=(2, 2), logprobs=2, filtered=True)


def _served(loaded: Any, args: Any, batch: int, requests: int) -> Served:
    from fm_serve.gemma.bench import bench_prompts
    from fm_serve.gemma.serve import make_requests, random_requests

    tok = loaded.tokenizer
    if tok is None:
        reqs = random_requests(loaded, requests, args.max_tokens)
        decode: Callable[..., str] = lambda ids: " ".join(map(str, ids))  # noqa: E731
        words = None
    else:
        reqs = make_requests(loaded, bench_prompts(requests), args.max_tokens)
        decode = tok.decode
        words = tuple(tuple(tok.encode(w, add_bos=False)) for w in ("the", " the"))
    cfg = engine_for(batch, args.prefill_budget, loaded.model.row_tile)
    longest = max(len(r.prompt) + r.max_new_tokens for r in reqs)
    return Served(loaded.model, loaded.params, reqs, cfg, longest + 8, decode, words)


def _tag(args: Any) -> str:
    import jax

    return args.tag or jax.devices()[0].platform


def matrix(loaded: Any, args: Any, log: Callable[[str], None]) -> int:
    """Run the whole feature matrix; 0 when every cell's tokens and logprobs are equal and
    every setting is non-vacuous."""
    from fm_serve.gemma.bench import environment

    batch = args.batch_sizes[0]
    served = _served(loaded, args, batch, 2 * batch)
    t0 = time.perf_counter()
    cells = run_feature_matrix(served, features=EVERY, log=log)
    ok = all(c["tokens_equal"] and c["logprobs_equal"] and c["non_vacuous"] for c in cells)
    doc = {
        "environment": environment(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "fm-serve-bench " + " ".join(sys.argv[1:]),
        "weights": "random" if loaded.tokenizer is None else "gguf",
        "dtype": loaded.model.dtype,
        "requests": len(served.requests),
        "max_running": batch,
        "max_tokens": args.max_tokens,
        "kv_budget_when_preempting": served.kv_budget,
        "settings": list(SETTINGS),
        "seconds": time.perf_counter() - t0,
        "all_equal": ok,
        "cells": cells,
    }
    text = json.dumps(doc, indent=2) + "\n"
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"gemma_matrix_{_tag(args)}.json"
        path.write_text(text)
        log(f"wrote {path}")
    equal = sum(c["tokens_equal"] and c["logprobs_equal"] for c in cells)
    print(
        f"feature matrix: {equal}/{len(cells)} cells equal; all non-vacuous: "
        f"{all(c['non_vacuous'] for c in cells)}"
    )
    return 0 if ok else 1


COST_FEATURES: dict[str, tuple[Features, dict[str, Any]]] = {
    "penalties": (Features(penalties=True), {"presence_penalty": -1.0, "frequency_penalty": 0.5}),
    "bad_words": (Features(bad_words=(2, 2)), {}),
    "logprobs": (Features(logprobs=2), {"logprobs": 2}),
    "top_k_top_p": (Features(filtered=True), {"top_k": 40, "top_p": 0.9}),
    "stop_strings": (Features(), {"stop": ("zzzz",)}),
}


def costs(loaded: Any, args: Any, log: Callable[[str], None]) -> int:
    """Each feature's price per step, off vs on (module docstring)."""
    batch = args.batch_sizes[0]
    served = _served(loaded, args, batch, 2 * batch)
    what = "Gemma 3 270M" + (" (random weights)" if loaded.tokenizer is None else "")
    stem = f"gemma_feature_costs_{_tag(args)}"
    measure_costs(served, what, batch, args.max_tokens, args.repeats, args.out, stem, log)
    return 0


def measure_costs(
    served: Served,
    what: str,
    batch: int,
    max_tokens: int,
    repeats: int,
    out: Path | None,
    stem_name: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Each feature's price per step on `served`, off vs on; the document (written as
    `<out>/<stem_name>.{json,md}` when `out` is given)."""
    words = served.bad_words or ((5,), (6, 7))
    rows = []
    for name, (features, kw) in COST_FEATURES.items():
        settings = Sampling(**kw, bad_words=words if name == "bad_words" else ())
        temp = 1.0 if name == "top_k_top_p" else 0.0
        on_reqs = [replace(r, temperature=temp, sampling=settings) for r in served.requests]
        off_reqs = [replace(r, temperature=temp) for r in served.requests]
        engines = {
            "off": Engine(
                served.model, served.params, served.engine, protocol="gather", decode=served.decode
            ),
            "on": Engine(
                served.model,
                served.params,
                served.engine,
                protocol="gather",
                features=features,
                decode=served.decode,
            ),
        }
        for e in engines.values():
            e.warm_up(overlap=False)
            e.warm_up(overlap=True)
        got: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for k in range(repeats):
            order = ("off", "on") if k % 2 == 0 else ("on", "off")
            for which in order:
                reqs = on_reqs if which == "on" else off_reqs
                e = engines[which]
                s = e.run_sync(reqs)
                o = e.run_overlap(reqs)
                got.setdefault((which, "sync"), []).append(
                    (1e6 * statistics.fmean(s.host_s), 1e3 * statistics.fmean(s.step_s))
                )
                got.setdefault((which, "overlap"), []).append(
                    (1e6 * statistics.fmean(o.host_s), 1e3 * o.wall_s / o.steps)
                )
        row: dict[str, Any] = {"feature": name, "settings": kw}
        for (which, mode), vals in got.items():
            row[f"{mode}_{which}_host_us"] = statistics.median(v[0] for v in vals)
            row[f"{mode}_{which}_step_ms"] = statistics.median(v[1] for v in vals)
        rows.append(row)
        log(
            f"{name}: sync host {row['sync_off_host_us']:.0f} -> {row['sync_on_host_us']:.0f} "
            f"us, step {row['sync_off_step_ms']:.1f} -> {row['sync_on_step_ms']:.1f} ms; "
            f"overlap host {row['overlap_off_host_us']:.0f} -> {row['overlap_on_host_us']:.0f} "
            f"us, step {row['overlap_off_step_ms']:.1f} -> {row['overlap_on_step_ms']:.1f} ms"
        )
    from fm_serve.gemma.bench import environment

    doc: dict[str, Any] = {
        "environment": environment(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "fm-serve-bench " + " ".join(sys.argv[1:]),
        "model": what,
        "batch": batch,
        "requests": len(served.requests),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "features": rows,
    }
    md = [
        f"# {what}: the sampling features' price per step ({doc['environment']['device']})",
        "",
        f"{doc['environment']['host']}; {doc['date']}; `{doc['command']}`. B = {batch}, "
        f"{len(served.requests)} requests, up to {max_tokens} new tokens, gather "
        f"protocol; medians of {repeats} interleaved off/on runs. Off: the engine "
        "without the feature (the same requests); on: the engine with it, every request "
        "using it. Host: the loop's own time per step (overlap: dispatch included); step: "
        "sync dispatch to tokens, overlap wall per step.",
        "",
        "| feature | sync host us off / on | sync step ms off / on | overlap host us off / on "
        "| overlap step ms off / on |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        md.append(
            f"| {r['feature']} | {r['sync_off_host_us']:.0f} / {r['sync_on_host_us']:.0f} | "
            f"{r['sync_off_step_ms']:.1f} / {r['sync_on_step_ms']:.1f} | "
            f"{r['overlap_off_host_us']:.0f} / {r['overlap_on_host_us']:.0f} | "
            f"{r['overlap_off_step_ms']:.1f} / {r['overlap_on_step_ms']:.1f} |"
        )
    print("\n".join(md))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = Path(out) / stem_name
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
        stem.with_suffix(".md").write_text("\n".join(md) + "\n")
        log(f"wrote {stem}.{{json,md}}")
    return doc


SPEC_GRAMMAR_PROMPTS = (
    ('Example: {"name":"Bob","age":41}\nWrite Ada, who is 36, the same way:', "json"),
    ("Is the sky blue on a clear day? Answer Yes. or No.", "regex"),
    (
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
        None,
    ),
)
"""The spec x grammar matrix's prompts and, grammar on, their constraint: a JSON record
whose example is in the prompt (lookup drafts its keys), a yes/no regex, and code left
unconstrained beside them."""
YES_NO = r"(Yes|No)\."


def spec_grammar_matrix(loaded: Any, args: Any, log: Callable[[str], None]) -> int:
    """Speculative decoding {off, on} x grammar {off, on} x {sync, overlap} on Gemma 3
    (`matrix.run_spec_grammar_matrix`), written as `gemma_spec_grammar_matrix_<tag>.{json,md}`;
    0 when every cell is ok."""
    from fm_serve.gemma.bench import environment
    from fm_serve.gemma.serve import grammar_matchers, make_requests
    from fm_serve.gemma.spec_bench import SCHEMA
    from fm_serve.grammar import Grammar
    from fm_serve.matrix import SpecGrammar, run_spec_grammar_matrix
    from fm_serve.spec import Ngram

    tok = loaded.tokenizer
    if tok is None:
        log("the spec x grammar matrix needs the tokenizer (not --random-weights)")
        return 2
    prompts = [p for p, _ in SPEC_GRAMMAR_PROMPTS]
    reqs = make_requests(loaded, prompts, args.max_tokens)
    kinds = {
        "json": Grammar("json_schema", json.dumps(SCHEMA)),
        "regex": Grammar("regex", YES_NO),
    }
    grammars = {
        r.rid: kinds[kind]
        for r, (_, kind) in zip(reqs, SPEC_GRAMMAR_PROMPTS, strict=True)
        if kind is not None
    }
    batch = args.batch_sizes[0]
    cfg = engine_for(batch, args.prefill_budget, loaded.model.row_tile)
    served = Served(loaded.model, loaded.params, reqs, cfg, 0, tok.decode)
    ngram = Ngram(args.draft_tokens)
    sg = SpecGrammar(
        served,
        grammars,
        grammar_matchers(loaded),
        lambda ids: tok.decode(ids, skip_special=True),
        ngram,
    )
    t0 = time.perf_counter()
    cells = run_spec_grammar_matrix(sg, log=log)
    doc = {
        "environment": environment(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "fm-serve-bench " + " ".join(sys.argv[1:]),
        "weights": "gguf",
        "dtype": loaded.model.dtype,
        "requests": len(reqs),
        "prompts": [list(p) for p in SPEC_GRAMMAR_PROMPTS],
        "grammars": {"json": SCHEMA, "regex": YES_NO},
        "max_running": batch,
        "max_tokens": args.max_tokens,
        "draft_tokens": ngram.draft_tokens,
        "max_ngram": ngram.max_ngram,
        "seconds": time.perf_counter() - t0,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "all_ok": all(c["ok"] for c in cells),
        "cells": cells,
    }
    md = spec_grammar_markdown(
        doc, {rid: tok.decode(o, skip_special=True) for rid, o in _texts(cells)}
    )
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = Path(args.out) / f"gemma_spec_grammar_matrix_{_tag(args)}"
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        stem.with_suffix(".md").write_text(md)
        log(f"wrote {stem}.{{json,md}}")
    return 0 if doc["all_ok"] else 1


def _texts(cells: list[dict[str, Any]]) -> list[tuple[int, list[int]]]:
    """The outputs of the (spec on, grammar on, overlap) cell."""
    last = [c for c in cells if c["spec"] and c["grammar"] and c["overlap"]]
    return sorted(last[0]["outputs"].items()) if last else []


def spec_grammar_markdown(doc: dict[str, Any], texts: dict[int, str]) -> str:
    """The spec x grammar matrix as a table."""
    env = doc["environment"]
    lines = [
        f"# Speculative decoding x structured output x overlap on Gemma 3 270M ({env['device']})",
        "",
        f"{env['host']}; {doc['date']}; `{doc['command']}`. {doc['requests']} greedy "
        f"requests (a JSON record, a yes/no regex, code unconstrained), {doc['max_running']} "
        f"at once, up to {doc['max_tokens']} new tokens; n-gram drafter K = "
        f"{doc['draft_tokens']}. Equal to sync: tokens equal the same setting's sync loop; "
        "to non-spec: equal the non-speculative sync loop's with the same grammar setting "
        "(else each difference must be a near-tie, top two logits within 1e-4). "
        "Constrained: each constrained output complete and meeting its grammar. "
        "Non-vacuous: drafts accepted (grammar on: on a constrained request too), each "
        "constrained output unlike its unconstrained one. Correctness only: the seconds "
        f"({doc['seconds']:.0f}) say nothing of speed (load average 1/5/15 min at the end: "
        f"{'/'.join(str(x) for x in doc['load_average'])}; a shared CPU).",
        "",
        "| spec | grammar | loop | ok | equal to sync | to non-spec | constrained "
        "| non-vacuous | drafts accepted | steps (MIXED) |",
        "|---|---|---|:---:|:---:|:---:|:---:|:---:|---:|---:|",
    ]
    yn = {True: "yes", False: "NO", None: "-"}
    for c in doc["cells"]:
        lines.append(
            f"| {'on' if c['spec'] else 'off'} | {'on' if c['grammar'] else 'off'} | "
            f"{'overlap' if c['overlap'] else 'sync'} | {yn[c['ok']]} | "
            f"{yn[c['equal_to_sync']]} | {yn[c['equal_to_non_spec']]} | "
            f"{yn[c['constrained_ok']]} | {yn[c['non_vacuous']]} | "
            f"{c['drafts_accepted']}/{c['drafts_proposed']} | {c['steps']} "
            f"({c['modes'].get('MIXED', 0)}) |"
        )
    notes = [f"- {c['setting']}: {n}" for c in doc["cells"] for n in c["notes"]]
    if notes:
        lines += ["", "Notes:", "", *notes]
    if texts:
        lines += ["", "Outputs (spec on, grammar on, overlap):", ""]
        lines += [f"- request {rid}: `{t!r}`" for rid, t in texts.items()]
    return "\n".join(lines) + "\n"
