"""`fm-serve-demo`: serve a request set synchronously and with overlap, print the table."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fm_serve.config import (
    DEFAULT_REQUESTS,
    TINY_REQUESTS,
    EngineConfig,
    ModelConfig,
    accelerator_model,
    tiny_engine,
    tiny_model,
)
from fm_serve.host_cost import KINDS
from fm_serve.requests import make_requests

SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false"


def _ratios(text: str) -> list[float]:
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"--ratios wants numbers like 0,0.5,1,2; got {text!r}"
        ) from err
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"--ratios wants non-negative numbers, got {text!r}")
    return vals


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see --help)."""
    p = argparse.ArgumentParser(
        prog="fm-serve-demo",
        description="Overlap-scheduled serving on a small JAX transformer, built on fm_jax: "
        "serves one request set synchronously and with overlap over a sweep of simulated "
        "host scheduling cost, checks the tokens are equal and prints tokens/s.",
    )
    p.add_argument("--quick", action="store_true", help="tiny model and request set (tests)")
    p.add_argument("--requests", type=int, default=None, help="requests (default 64)")
    p.add_argument("--ratios", type=_ratios, default=None, help="host cost / forward time list")
    p.add_argument("--host-cost", choices=KINDS, default="spin", help="how host cost is spent")
    p.add_argument(
        "--xla-cpu-threads",
        choices=("1", "all"),
        default="1",
        help="CPU device only: '1' runs XLA's matmuls (Eigen) on the calling thread, so that "
        "the simulated host work mostly has the other core (as a GPU host would); 'all' lets "
        "Eigen use every core",
    )
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 8192)")
    p.add_argument(
        "--d-model",
        type=int,
        default=None,
        help="residual width (default: 256 on CPU; 4096 on an accelerator, whose step must "
        "outlast its dispatch for overlap to show)",
    )
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (4; GPU 8)")
    p.add_argument(
        "--no-mixed", action="store_true", help="no MIXED batches (prefill steps run alone)"
    )
    p.add_argument(
        "--prefill-budget",
        type=int,
        default=None,
        help="prompt tokens per step (chunked prefill); a budget above every prompt turns "
        "chunking off",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and requests")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per mode and ratio; the fastest counts"
    )
    p.add_argument("--no-debug-check", action="store_true", help="skip the debug overlap run")
    p.add_argument(
        "--protocol",
        choices=("sentinel", "gather"),
        default="sentinel",
        help="the overlap engine's FutureMap relay protocol (docs/CONTRACT.md, 'Two "
        "protocols'): sentinel placeholders, or gathers at the rows' slots; same tokens",
    )
    p.add_argument(
        "--matrix",
        action="store_true",
        help="instead of the sweep: the correctness matrix on the tiny model (sync vs overlap "
        "tokens across protocol x debug x chunked prefill x MIXED x slot reuse)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--out", type=Path, default=None, help="write serve_<tag>.{json,md,png} here")
    p.add_argument("--tag", default=None, help="file tag for --out (default: device platform)")
    return p.parse_args(argv)


def _configure_xla_threads(choice: str) -> str:
    """Apply --xla-cpu-threads through XLA_FLAGS; returns what holds for this process."""
    if choice == "all":
        return "all"
    if "jax" in sys.modules:
        return "unchanged (jax was already imported)"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SINGLE_THREAD_XLA}".strip()
    return "1"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return 0 when every run's tokens equal the synchronous reference."""
    args = parse_args(argv)
    threads = _configure_xla_threads(args.xla_cpu_threads)
    # jax is imported only now, so that the XLA flags above apply
    from fm_serve import report
    from fm_serve.sweep import run_sweep

    if args.matrix:
        from fm_serve.matrix import run_matrix

        got = run_matrix(log=lambda m: print(m, file=sys.stderr, flush=True))
        bad = {k: v for k, v in got.items() if v}
        print(f"correctness matrix: {len(got) - len(bad)}/{len(got)} cells equal")
        for k, v in bad.items():
            print(f"  {k}: {v[:3]}")
        if args.json is not None:
            import json

            args.json.write_text(json.dumps({"cells": got, "equal": not bad}, indent=2) + "\n")
        return 0 if not bad else 1

    if args.quick:
        model, engine = tiny_model(), tiny_engine()
        n = args.requests or 64
        shape = TINY_REQUESTS
        ratios = args.ratios or [0.0, 1.0]
    else:
        import jax

        on_cpu = jax.devices()[0].platform == "cpu"
        model, engine = (ModelConfig() if on_cpu else accelerator_model()), EngineConfig()
        n = args.requests or 64
        shape = DEFAULT_REQUESTS
        ratios = args.ratios or [0.0, 0.5, 1.0, 2.0]
    model = model._replace(seed=args.seed, **({"vocab": args.vocab} if args.vocab else {}))
    if args.d_model is not None:
        heads = model.n_heads if args.d_model % model.n_heads == 0 else 1
        model = model._replace(d_model=args.d_model, d_ff=4 * args.d_model, n_heads=heads)
    if args.layers is not None:
        model = model._replace(n_layers=args.layers)
    if args.no_mixed:
        engine = engine._replace(mixed=False)
    if args.prefill_budget is not None:
        budget = args.prefill_budget
        tokens = max(max(engine.token_buckets), budget + engine.max_running)
        tokens += -tokens % model.row_tile
        engine = engine._replace(
            prefill_budget=budget, token_buckets=(*engine.token_buckets[:-1], tokens)
        )
    requests = make_requests(
        n, vocab=model.vocab, seed=args.seed, prompt_len=shape.prompt_len, max_new=shape.max_new
    )

    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    res = run_sweep(
        requests,
        model,
        engine,
        ratios=ratios,
        host_cost_kind=args.host_cost,
        debug_check=not args.no_debug_check,
        repeats=args.repeats,
        protocol=args.protocol,
        log=log,
    )
    res.xla_cpu_threads = threads
    print(report.text_table(res))
    if args.json is not None:
        report.write_json(res, args.json)
    if args.out is not None:
        import jax

        tag = args.tag or jax.devices()[0].platform
        for path in report.write_results(res, args.out, tag):
            log(f"wrote {path}")
    log("done")
    return 0 if res.tokens_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
