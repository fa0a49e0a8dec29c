"""`fm-serve-demo`: serve a request set synchronously and with overlap, print the table."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.serve.config import (
    DEFAULT_REQUESTS,
    TINY_REQUESTS,
    EngineConfig,
    ModelConfig,
    tiny_engine,
    tiny_model,
)
from bench.serve.host_cost import KINDS
from bench.serve.requests import make_requests

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
    from bench.serve import report
    from bench.serve.sweep import run_sweep

    if args.quick:
        model, engine = tiny_model(), tiny_engine()
        n = args.requests or 64
        shape = TINY_REQUESTS
        ratios = args.ratios or [0.0, 1.0]
    else:
        model, engine = ModelConfig(), EngineConfig()
        n = args.requests or 64
        shape = DEFAULT_REQUESTS
        ratios = args.ratios or [0.0, 0.5, 1.0, 2.0]
    model = model._replace(seed=args.seed, **({"vocab": args.vocab} if args.vocab else {}))
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
