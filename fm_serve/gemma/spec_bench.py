"""Speculative decoding on Gemma 3: spec {off, on} x loop {sync, overlap}, per prompt set.

`python -m fm_serve.gemma.spec_bench --out fm_bench/results` serves two prompt sets, one
where prompt lookup helps (code to continue, a list to repeat, a text to summarise) and one
where it does not (open questions), greedily, with and without the n-gram drafter (K draft
tokens per step), each in the synchronous and the overlap loop. Each configuration runs
once to compile what it uses, then once timed. It reports tokens/s, steps, the drafts'
acceptance rate and output tokens per verified row, and whether each run's tokens equal
the non-spec synchronous loop's (where they do not, the first differing position).
`--random-weights`: the 270M architecture with random weights (no weights file), prompts
of random token ids (a repeated random n-gram for the set where lookup helps).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fm_serve.args import int_at_least

HELPS = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\ndef div(a, b):",
    "Repeat this list exactly three times: apple, banana, cherry, date, elderberry, fig.",
    "Text: The committee met on Monday to review the budget. The committee approved the "
    "budget for the new library and asked the city to publish the budget online.\n"
    "Summarise the text in one sentence, reusing its words:",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "class Point3:\n    def __init__(self, x, y, z):",
)
"""Prompts where the output reuses the prompt's n-grams."""
NO_HELP = (
    "Write a short poem about the sea.",
    "What are three reasons people enjoy travelling?",
    "Describe a sunrise over the mountains.",
    "Give advice to a student starting university.",
)
"""Open prompts: little of the output repeats the prompt."""


def _requests(loaded: Any, which: str, max_tokens: int) -> list[Any]:
    from fm_serve.gemma.serve import make_requests
    from fm_serve.requests import Request

    if loaded.tokenizer is not None:
        return make_requests(loaded, HELPS if which == "helps" else NO_HELP, max_tokens)
    rng = np.random.default_rng(0 if which == "helps" else 1)
    vocab, out = loaded.model.vocab, []
    for i in range(4):
        if which == "helps":  # a random 6-gram four times, then its first half
            gram = [int(t) for t in rng.integers(3, vocab, size=6)]
            ids = gram * 4 + gram[:3]
        else:
            ids = [int(t) for t in rng.integers(3, vocab, size=27)]
        out.append(Request(i, (2, *ids), max_tokens))
    return out


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
"""`--grammar`: every completion must parse under this schema."""
PEOPLE = (
    "Give a JSON record for a person named Ada who is 36.",
    "Describe Bob, 41, as JSON.",
    "JSON for the engineer Chen, aged 29:",
    "Write Dana (age 52) as a JSON object.",
)


def run_grammar(args: argparse.Namespace) -> dict[str, Any]:
    """Grammar {off, on} x loop {sync, overlap} on the JSON-schema prompts: tokens/s, and
    whether every constrained completion parses under the schema."""
    import jax

    from fm_serve.config import engine_for
    from fm_serve.engine import Engine
    from fm_serve.gemma.load import load_model
    from fm_serve.gemma.serve import grammar_matchers, make_requests
    from fm_serve.grammar import Grammar

    loaded = load_model(max_seq_len=args.max_seq_len)
    tok = loaded.tokenizer
    assert tok is not None
    cfg = engine_for(args.max_running, args.prefill_budget, loaded.model.row_tile)
    engine = Engine(
        loaded.model, loaded.params, cfg, protocol="gather", grammar=grammar_matchers(loaded)
    )
    plain = make_requests(loaded, PEOPLE, args.max_tokens)
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    constrained = [replace(r, grammar=grammar) for r in plain]
    rows = []
    for label, reqs in (("off", plain), ("on", constrained)):
        ref = None
        for loop in ("sync", "overlap"):
            serve = engine.run_sync if loop == "sync" else engine.run_overlap
            serve(reqs)  # compiles what this configuration uses
            res = serve(reqs)
            ref = ref or res.outputs
            texts = {rid: tok.decode(o, skip_special=True) for rid, o in res.outputs.items()}
            parsed = 0
            for text in texts.values():
                try:
                    doc = json.loads(text)
                    parsed += isinstance(doc, dict) and set(doc) == {"name", "age"}
                except json.JSONDecodeError:
                    pass
            row = {
                "grammar": label,
                "loop": loop,
                "tokens": res.tokens,
                "steps": res.steps,
                "wall_s": res.wall_s,
                "tok_s": res.tok_s,
                "host_ms_per_step": 1e3 * sum(res.host_s) / max(len(res.host_s), 1),
                "parsed": parsed,
                "requests": len(reqs),
                "equal_to_sync": res.outputs == ref,
                "reasons": res.reasons,
                "texts": texts,
            }
            rows.append(row)
            print(
                f"grammar {label:3s} {loop:7s}: {res.tokens} tokens {res.tok_s:6.2f} tok/s, "
                f"{res.steps} steps, parsed {parsed}/{len(reqs)}, equal {row['equal_to_sync']}",
                flush=True,
            )
    return {
        "command": "python -m fm_serve.gemma.spec_bench " + " ".join(args.argv),
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "max_tokens": args.max_tokens,
        "schema": SCHEMA,
        "rows": rows,
    }


def grammar_markdown(doc: dict[str, Any]) -> str:
    """The grammar figures as a table."""
    lines = [
        "# Structured output (JSON schema, llguidance) on Gemma 3 270M, split step",
        "",
        f"Device: {doc['device']} ({doc['platform']}), jax {doc['jax']}. `{doc['command']}`. "
        f"4 greedy requests, at most {doc['max_tokens']} new tokens; each configuration run "
        "once to compile, then timed. Parsed: completions that are JSON objects with exactly "
        "the schema's keys. Equal: tokens equal to the same grammar setting's sync loop.",
        "",
        "| grammar | loop | tokens | steps | tok/s | host ms/step | parsed | equal |",
        "|---|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['grammar']} | {r['loop']} | {r['tokens']} | {r['steps']} | "
            f"{r['tok_s']:.2f} | {r['host_ms_per_step']:.1f} | {r['parsed']}/{r['requests']} | "
            f"{'yes' if r['equal_to_sync'] else 'NO'} |"
        )
    lines += ["", "Completions (grammar on, overlap):", ""]
    last = [r for r in doc["rows"] if r["grammar"] == "on"][-1]
    lines += [f"- `{t}`" for t in last["texts"].values()]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration's figures, as a JSON document."""
    import jax

    from fm_serve.config import engine_for
    from fm_serve.engine import Engine
    from fm_serve.gemma.load import load_model, random_model
    from fm_serve.spec import Ngram

    if args.random_weights:
        loaded = random_model(max_seq_len=args.max_seq_len, row_tile=4, dtype=args.dtype)
    else:
        loaded = load_model(max_seq_len=args.max_seq_len)
    k = args.draft_tokens
    cfg = engine_for(args.max_running, args.prefill_budget, loaded.model.row_tile)
    tile = loaded.model.row_tile
    verify = -(-args.max_running * (k + 1) // tile) * tile  # a spec DECODE's tokens
    cfg = cfg._replace(token_buckets=tuple(sorted({*cfg.token_buckets, verify})))
    engines = {
        "off": Engine(loaded.model, loaded.params, cfg, protocol="gather"),
        "on": Engine(loaded.model, loaded.params, cfg, speculative=Ngram(k, args.max_ngram)),
    }
    rows = []
    for which in ("helps", "no_help"):
        reqs = _requests(loaded, which, args.max_tokens)
        ref = None
        for spec in ("off", "on"):
            eng = engines[spec]
            for loop in ("sync", "overlap"):
                serve = eng.run_sync if loop == "sync" else eng.run_overlap
                t0 = time.perf_counter()
                serve(reqs)  # compiles what this configuration uses
                first = time.perf_counter() - t0
                res = serve(reqs)
                if ref is None:
                    ref = res.outputs
                diffs = {
                    rid: next(
                        (i for i, (a, b) in enumerate(zip(o, ref[rid], strict=False)) if a != b),
                        min(len(o), len(ref[rid])),
                    )
                    for rid, o in res.outputs.items()
                    if o != ref[rid]
                }
                row = {
                    "prompts": which,
                    "spec": spec,
                    "loop": loop,
                    "tokens": res.tokens,
                    "steps": res.steps,
                    "modes": res.modes,
                    "wall_s": res.wall_s,
                    "tok_s": res.tok_s,
                    "first_run_s": first,
                    "acceptance": res.acceptance,
                    "tokens_per_verify": res.tokens_per_verify(k) if spec == "on" else 1.0,
                    "equal_to_non_spec_sync": not diffs,
                    "first_difference": diffs,
                    "outputs": res.outputs,
                }
                rows.append(row)
                print(
                    f"{which:8s} spec {spec:3s} {loop:7s}: {res.tokens} tokens "
                    f"{res.tok_s:6.2f} tok/s, {res.steps} steps, acceptance "
                    f"{row['acceptance']:.2f}, tokens/verify {row['tokens_per_verify']:.2f}, "
                    f"equal {not diffs}",
                    flush=True,
                )
    return {
        "command": "python -m fm_serve.gemma.spec_bench " + " ".join(args.argv),
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "host": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "weights": "random" if args.random_weights else "gguf",
        "dtype": args.dtype,
        "draft_tokens": k,
        "max_ngram": args.max_ngram,
        "max_tokens": args.max_tokens,
        "max_running": args.max_running,
        "rows": rows,
    }


def markdown(doc: dict[str, Any]) -> str:
    """The figures as a table."""
    lines = [
        f"# Speculative decoding (n-gram, K = {doc['draft_tokens']}) on Gemma 3 270M "
        f"({doc['weights']} weights, {doc['dtype']})",
        "",
        f"Device: {doc['device']} ({doc['platform']}), jax {doc['jax']}. `{doc['command']}`. "
        f"4 greedy requests per prompt set, {doc['max_tokens']} new tokens each; each "
        "configuration run once to compile, then timed. Equal: tokens equal to the non-spec "
        "synchronous loop's.",
        "",
        "| prompts | spec | loop | tokens | steps | tok/s | acceptance | tokens/verify | equal |",
        "|---|---|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['prompts']} | {r['spec']} | {r['loop']} | {r['tokens']} | {r['steps']} | "
            f"{r['tok_s']:.2f} | {r['acceptance']:.2f} | {r['tokens_per_verify']:.2f} | "
            f"{'yes' if r['equal_to_non_spec_sync'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison; write spec_<weights>_<tag>.{json,md} under --out."""
    p = argparse.ArgumentParser(prog="python -m fm_serve.gemma.spec_bench")
    p.add_argument("--draft-tokens", type=int_at_least(1), default=4)
    p.add_argument("--max-ngram", type=int_at_least(1), default=3)
    p.add_argument("--max-tokens", type=int_at_least(1), default=24)
    p.add_argument("--max-running", type=int_at_least(1), default=4)
    p.add_argument("--prefill-budget", type=int_at_least(1), default=64)
    p.add_argument("--max-seq-len", type=int_at_least(2), default=160)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--tag", default=None)
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--grammar", action="store_true", help="grammar {off, on} x loop instead (JSON schema)"
    )
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    if args.grammar:
        doc = run_grammar(args)
        if args.out is not None:
            name = f"grammar_gemma_{args.tag or doc['platform']}"
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
            (args.out / f"{name}.md").write_text(grammar_markdown(doc))
        return 0
    doc = run(args)
    if args.out is not None:
        tag = args.tag or doc["platform"]
        name = f"spec_{'random_' + args.dtype if args.random_weights else 'gemma'}_{tag}"
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        (args.out / f"{name}.md").write_text(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
