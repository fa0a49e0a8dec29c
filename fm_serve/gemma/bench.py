"""`fm-serve-bench`: Gemma 3 270M, synchronous vs overlap serving, at several batch sizes.

For each batch size B (requests in a batch at once) the same 2B requests (real prompts,
greedy, up to `--max-tokens` each, stopped early by end of sequence or end of turn) are
served by the synchronous loop and by the overlap loop (fm_jax's engine step), back to
back `--repeats` times (the order alternating); the pair of median speed-up counts, so
load that drifts over minutes on a shared machine hits both of a pair alike. Per step: H,
the host's time in the sync loop (building the batch, reading and processing its tokens);
S, the sync step from dispatch to tokens (the device's step as the host sees it); D, the
time inside the overlap step's call (the host is busy for it). Overlap's speed-up is set
against the bound that counts the dispatch as host time, (H + S) / max(H + D, S)
(`sweep.SweepRun`). `--ratios` adds a simulated host cost per batch, a multiple of the
first sync run's S (`--host-cost sleep` yields the core, as a host with cores of its own
would). Every run's tokens are compared with the first synchronous run's. `--startup`
also times two fresh processes of `fm-serve` on an empty cache: the first start (unpack
the GGUF, compile) and the second (read the cache).

`--random-weights` serves the same architecture (Gemma 3 270M, `GemmaConfig()`) with random
weights (`load.random_model`): no weights package, gguf or tokenizer needed. Its prompts are
random token ids (8 to 32 of them, seeded) and it has no stop token, so every request runs to
`--max-tokens` (the figures are throughput, the tokens meaningless); its results are named
gemma_random_<dtype>_<tag>, beside the real model's gemma_serve_<tag>. `--dtype bfloat16`
computes in bfloat16 (weights, activations, KV cache; norms and softmax in float32).

Engine settings (`config.engine_for`): `--batch-sizes` sets max_running (and the decode
bucket, rounded up to a multiple of `--row-tile`); a step that prefills carries up to
`--prefill-budget` prompt tokens beside the running decodes (its token bucket is
prefill_budget + B, rounded up to the row tile). Every matmul runs on tiles of `--row-tile`
rows (batch invariance: sync and overlap serve the same tokens), unrolled, so a bucket of
T tokens costs T / row_tile tiles per matmul: on a GPU, where each tile is a kernel launch,
take a larger tile. `--max-seq-len` must hold a prompt and its output (32 + max tokens).
On a GPU, e.g. (2B prompts of ~20 tokens prefill in a few steps even at B = 128):

  fm-serve-bench --random-weights --dtype bfloat16 --batch-sizes 8,32,128 --max-tokens 32 \
      --repeats 1 --max-seq-len 128 --row-tile 16 --prefill-budget 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from fm_serve.args import float_list, int_at_least, int_list, odd_count

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three primary colours are",
    "Water boils at",
    "A short poem about the moon:\n",
    "The main causes of the First World War were",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The quick brown fox",
    "In machine learning, overfitting means",
    "My favourite book is",
    "The Pacific Ocean is",
    "Here is a list of five European countries:\n1.",
    "The history of the Roman Empire spans many centuries, from its founding to",
    "<start_of_turn>user\nWhat is a prime number?<end_of_turn>\n<start_of_turn>model\n",
)


def bench_prompts(n: int) -> list[str]:
    """`n` prompts: the list above, then again with a prefix (so no two are the same)."""
    return [("Question: " * (i // len(PROMPTS))) + PROMPTS[i % len(PROMPTS)] for i in range(n)]


def environment() -> dict[str, str]:
    """The device and the versions the figures were taken with."""
    import jax

    d = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    versions = {}
    for p in ("jax", "jaxlib", "numpy", "gguf"):
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            versions[p] = "not installed"
    return {
        "device": f"{d.platform} ({d.device_kind})",
        "host": f"{cpu}, {os.cpu_count()} logical CPUs",
        "python": platform.python_version(),
        **versions,
    }


def bench_requests(loaded: Any, batch: int, max_tokens: int) -> list[Any]:
    """The 2 x `batch` requests of a batch size: real prompts, or (random weights, no
    tokenizer) random token-id prompts."""
    from fm_serve.gemma.serve import make_requests, random_requests

    if loaded.tokenizer is None:
        return random_requests(loaded, 2 * batch, max_tokens)
    return make_requests(loaded, bench_prompts(2 * batch), max_tokens)


def run_batch_size(
    loaded: Any,
    batch: int,
    *,
    max_tokens: int,
    prefill_budget: int,
    ratios: Sequence[float],
    host_cost_kind: str,
    repeats: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Serve 2 x `batch` requests sync and overlap at each host-cost ratio; the record."""
    from fm_serve.config import engine_for
    from fm_serve.engine import Engine, ServeResult
    from fm_serve.host_cost import HostCost
    from fm_serve.sweep import SweepRun, diff_outputs

    requests = bench_requests(loaded, batch, max_tokens)
    cfg = engine_for(batch, prefill_budget, loaded.model.row_tile)
    engine = Engine(loaded.model, loaded.params, cfg, protocol="gather")
    t0 = time.perf_counter()
    engine.warm_up(overlap=False)
    engine.warm_up(overlap=True)
    log(f"B={batch}: warm-up {time.perf_counter() - t0:.1f} s")
    ref = engine.run_sync(requests)  # also the first touch of every executable
    t_step = sum(ref.step_s) / len(ref.step_s)
    mismatches = diff_outputs("overlap first run", ref, engine.run_overlap(requests))
    runs = []
    for ratio in ratios:
        cost = HostCost(ratio * t_step, host_cost_kind)
        pairs: list[tuple[ServeResult, ServeResult]] = []
        for k in range(repeats):  # back to back, the order alternating: drift hits both
            got: dict[str, ServeResult] = {}
            order = ("sync", "overlap") if k % 2 == 0 else ("overlap", "sync")
            for name in order:
                got[name] = (engine.run_sync if name == "sync" else engine.run_overlap)(
                    requests, cost
                )
                mismatches += diff_outputs(f"{name} r={ratio:g}", ref, got[name])
            pairs.append((got["sync"], got["overlap"]))
        pairs.sort(key=lambda p: p[1].tok_s / p[0].tok_s)
        sync, overlap = pairs[len(pairs) // 2]  # the pair of median speed-up
        r = SweepRun(ratio, 1e3 * cost.seconds, sync, overlap)
        log(
            f"B={batch} host/S={ratio:g}: sync {r.sync.tok_s:.1f} tok/s, overlap "
            f"{r.overlap.tok_s:.1f} tok/s ({r.speedup:.3f}x, bound {r.ideal_speedup:.3f}x); "
            f"H {r.t_host_ms:.2f} ms, S {r.t_step_ms:.1f} ms, D {r.t_dispatch_ms:.2f} ms"
        )
        runs.append(
            {
                **r.as_json(),
                "overlap_host_ms": 1e3 * sum(r.overlap.host_s) / len(r.overlap.host_s),
                "modes": r.sync.modes,
            }
        )
    stops = set(loaded.model.stop_ids)
    return {
        "batch": batch,
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": ref.tokens,
        "stopped_early": sum(1 for o in ref.outputs.values() if o[-1] in stops),
        "tokens_equal": not mismatches,
        "mismatches": mismatches[:10],
        "engine": cfg._asdict(),
        "runs": runs,
    }


def measure_startup(max_tokens: int = 8) -> dict[str, Any]:
    """Two fresh `fm-serve` processes on an empty cache directory: the first start unpacks
    the GGUF and compiles, the second reads the unpacked weights and compiled steps."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "FM_JAX_CACHE": cache}
        for name in ("first", "cached"):
            doc = Path(cache) / f"{name}.json"
            cmd = [
                sys.executable,
                "-m",
                "fm_serve.gemma.cli",
                "--max-tokens",
                str(max_tokens),
            ]
            t0 = time.perf_counter()
            subprocess.run([*cmd, "--json", str(doc)], env=env, check=True, capture_output=True)
            got = json.loads(doc.read_text())
            run = got["runs"]["overlap"]
            out[name] = {
                "process_s": time.perf_counter() - t0,
                "load_s": got["load_s"],
                "first_load": got["first_load"],
                "warm_up_s": run["warm_up_s"],
                "load_plus_warm_up_s": got["load_s"] + run["warm_up_s"],
            }
    return out


def markdown(doc: dict[str, Any], plot_name: str | None) -> str:
    """The result file: environment, settings, the table, start-up and the plot."""
    env = doc["environment"]
    dtype = doc.get("dtype", "float32")
    if doc.get("weights") == "random":
        model = f"Gemma 3 270M architecture (random weights, {dtype}; no stop token)"
        prompts = "random token-id prompts of 8 to 32 tokens"
    else:
        cast = f", computed in {dtype}" if dtype != "float32" else ""
        model = f"Gemma 3 270M (Q4_K_M GGUF, dequantized to float32{cast})"
        prompts = "real prompts"
    lines = [
        f"# Gemma 3 270M{' (random weights)' if doc.get('weights') == 'random' else ''} "
        "served with fm_jax: synchronous vs overlap",
        "",
        f"Device: {env['device']}; host: {env['host']}. Python {env['python']}, jax "
        f"{env['jax']}, jaxlib {env['jaxlib']}, numpy {env['numpy']}, gguf {env['gguf']}. "
        f"Taken {doc['date']}, `{doc['command']}`.",
        "",
        f"Model: {model}, KV cache of "
        f"{doc['max_seq_len']} positions per slot, row tile {doc['row_tile']}. Per batch "
        f"size B: 2B requests ({prompts}), greedy, at most {doc['max_tokens']} new "
        f"tokens each, prefill budget {doc['prefill_budget']} tokens per step; of "
        f"{doc['repeats']} back-to-back sync/overlap pairs, the one of median speed-up. "
        "Relay protocol: gather.",
        "",
        "H: host time per step of the sync loop; S: the sync step, dispatch to tokens; D: time "
        "inside the overlap step's call; overlap H: the overlap loop's host time per step "
        "(dispatch included); overlap wall: its wall time per step. bound = (H + S) / "
        "max(H + D, S). The overlap loop reads a finished request's last token a step late, "
        "so its slot is reused a step later: it runs a step or so more. The two runs of a "
        "pair see the same machine only as far as other jobs' load holds still; where the "
        "overlap wall per step is below the sync S, the device ran faster during the overlap "
        "run, and the speed-up can pass its bound.",
        "",
        "| B | host cost / S | H ms | S ms | D ms | overlap H ms | overlap wall ms | steps "
        "sync/overlap | sync tok/s | overlap tok/s | speed-up | bound | of bound | tokens "
        "equal |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for b in doc["batches"]:
        for r in b["runs"]:
            wall = 1e3 * b["output_tokens"] / r["overlap_tok_s"] / r["overlap_steps"]
            lines.append(
                f"| {b['batch']} | {r['host_cost_ratio']:g} | {r['t_host_ms']:.2f} | "
                f"{r['t_step_ms']:.1f} | {r['t_dispatch_ms']:.2f} | {r['overlap_host_ms']:.2f} | "
                f"{wall:.1f} | {r['sync_steps']}/{r['overlap_steps']} | "
                f"{r['sync_tok_s']:.1f} | {r['overlap_tok_s']:.1f} | {r['speedup']:.3f}x | "
                f"{r['ideal_speedup']:.3f}x | {r['fraction_of_ideal']:.3f} | "
                f"{'yes' if b['tokens_equal'] else 'NO'} |"
            )
    lines.append("")
    for b in doc["batches"]:
        lines.append(
            f"B={b['batch']}: {b['requests']} requests, {b['output_tokens']} output tokens, "
            f"{b['stopped_early']} stopped by a stop token; step kinds (sync) "
            f"{b['runs'][0]['modes']}."
        )
    if doc.get("bound"):
        lines += ["", *bound_lines(doc)]
    if doc.get("startup"):
        s = doc["startup"]
        lines += [
            "",
            "Start-up (`fm-serve`, default settings, overlap mode, fresh processes on an empty "
            "cache): first start: load "
            f"{s['first']['load_s']:.1f} s (GGUF assembled, dequantized and cached) + "
            f"warm-up {s['first']['warm_up_s']:.1f} s (compile); from the cache: load "
            f"{s['cached']['load_s']:.2f} s + warm-up {s['cached']['warm_up_s']:.2f} s = "
            f"{s['cached']['load_plus_warm_up_s']:.2f} s (whole process "
            f"{s['cached']['process_s']:.1f} s, imports included).",
        ]
    if plot_name:
        lines += ["", f"![sync vs overlap]({plot_name})"]
    return "\n".join(lines) + "\n"


def bound_lines(doc: dict[str, Any]) -> list[str]:
    """Each B's tokens/s (its runs without a simulated host cost) beside the machine's
    bound on a decode step (`bound.decode_bound`)."""
    from fm_serve.gemma.bound import decode_bound

    rates = doc["bound"]
    lines = [
        "## Against the machine's bound",
        "",
        f"Measured here: the weights ({rates['weight_bytes'] / 1e9:.2f} GB) read once in "
        f"{rates['weight_read_ms']:.1f} ms ({rates['bandwidth_gb_s']:.1f} GB/s); matmuls at "
        f"{rates['matmul_gflop_s']:.1f} GFLOP/s; a decode token multiplies "
        f"{rates['matmul_weights'] / 1e6:.0f}M weights (2 FLOPs each). Bound step: the longer "
        "of the weight read and the step's FLOPs at that rate; bound tok/s = B / bound step "
        "(decode only: the runs' prefill and MIXED steps and their stop-token ends count "
        f"against them). With row tile {doc['row_tile']} every matmul reads the weights once "
        "per tile, so a decode step of B rows reads them about ceil(B / tile) times, and a "
        f"prefill step of up to {doc['prefill_budget']} + B tokens that many over the tile. "
        "S: the sync run's mean step, its prefill and MIXED steps included.",
        "",
        "| B | S ms | bound step ms | roof | weight reads per step | sync tok/s | overlap "
        "tok/s | bound tok/s | sync of bound | overlap of bound |",
        "|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in doc["batches"]:
        r = next((r for r in b["runs"] if r["host_cost_ratio"] == 0), b["runs"][0])
        got = decode_bound(rates, b["batch"])
        tiles = -(-b["batch"] // doc["row_tile"])
        lines.append(
            f"| {b['batch']} | {r['t_step_ms']:.1f} | {got['step_ms']:.1f} | {got['roof']} | "
            f"{tiles} | {r['sync_tok_s']:.1f} | {r['overlap_tok_s']:.1f} | {got['tok_s']:.1f} | "
            f"{r['sync_tok_s'] / got['tok_s']:.2f} | {r['overlap_tok_s'] / got['tok_s']:.2f} |"
        )
    return lines


def plot(doc: dict[str, Any], path: Path) -> Path:
    """Tokens/s against batch size (sync, overlap), and the speed-up against its bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ratios = sorted({r["host_cost_ratio"] for b in doc["batches"] for r in b["runs"]})
    for ratio in ratios:
        pts = [
            (b["batch"], r)
            for b in doc["batches"]
            for r in b["runs"]
            if r["host_cost_ratio"] == ratio
        ]
        xs = [p[0] for p in pts]
        tag = f" (host cost {ratio:g} S)" if ratio else ""
        ax1.plot(xs, [p[1]["sync_tok_s"] for p in pts], "o--", label=f"sync{tag}")
        ax1.plot(xs, [p[1]["overlap_tok_s"] for p in pts], "s-", label=f"overlap{tag}")
        ax2.plot(xs, [p[1]["speedup"] for p in pts], "s-", label=f"speed-up{tag}")
        ax2.plot(xs, [p[1]["ideal_speedup"] for p in pts], "k:", label=f"bound{tag}")
    for ax, ylabel in ((ax1, "output tokens / s"), (ax2, "overlap / sync")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (requests at once)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    what = f" (random weights, {doc.get('dtype')})" if doc.get("weights") == "random" else ""
    fig.suptitle(f"Gemma 3 270M{what} on {doc['environment']['device']}: sync vs overlap (fm_jax)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_if_possible(doc: dict[str, Any], path: Path) -> Path | None:
    """`plot`, or None when matplotlib is not installed (the markdown then has no plot)."""
    try:
        return plot(doc, path)
    except ImportError:
        return None


def rewrite(json_path: Path) -> Path:
    """Write the markdown and the plot again from a result JSON (no run)."""
    doc = json.loads(json_path.read_text())
    png = plot_if_possible(doc, json_path.with_suffix(".png"))
    json_path.with_suffix(".md").write_text(markdown(doc, png.name if png else None))
    return json_path.with_suffix(".md")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return 0 when every run's tokens equal the sync run's."""
    p = argparse.ArgumentParser(prog="fm-serve-bench", description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int_list(1), default=[4, 8, 16])
    p.add_argument("--max-tokens", type=int_at_least(1), default=32)
    p.add_argument("--prefill-budget", type=int_at_least(1), default=32)
    p.add_argument("--max-seq-len", type=int_at_least(2), default=128)
    p.add_argument("--row-tile", type=int_at_least(1), default=4)
    p.add_argument("--ratios", type=float_list(0.0), default=[0.0], help="host cost / S list")
    p.add_argument("--host-cost", choices=("spin", "sleep"), default="sleep")
    p.add_argument("--repeats", type=odd_count, default=3, help="sync/overlap pairs (odd)")
    p.add_argument("--startup", action="store_true", help="also time two fresh starts")
    p.add_argument(
        "--bound",
        action="store_true",
        help="also measure the machine's bound (weights read once at the measured bandwidth, "
        "FLOPs at the measured matmul rate) and set each B's tokens/s beside it",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="the 270M architecture with random weights and token-id prompts (no weights "
        "package, gguf or tokenizer); results named gemma_random_<dtype>_<tag>",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights, activations and KV cache (norms and softmax in float32)",
    )
    p.add_argument(
        "--out", type=Path, help="write gemma_serve_<tag>.{json,md,png} (or gemma_random_...) here"
    )
    p.add_argument("--tag", default=None, help="file tag (default: the device platform)")
    p.add_argument(
        "--matrix",
        action="store_true",
        help="instead of the benchmark: the correctness matrix (sync vs overlap under each "
        "sampling setting, preemption and debug), written to --out as gemma_matrix_<tag>.json",
    )
    p.add_argument(
        "--costs",
        action="store_true",
        help="instead of the benchmark: each sampling feature's price per step (host us, "
        "step ms; off vs on), written to --out as gemma_feature_costs_<tag>.{json,md}",
    )
    p.add_argument(
        "--spec-grammar-matrix",
        action="store_true",
        help="instead of the benchmark: speculative decoding {off, on} x grammar {off, on} x "
        "{sync, overlap}, written to --out as gemma_spec_grammar_matrix_<tag>.{json,md}",
    )
    p.add_argument(
        "--draft-tokens", type=int_at_least(1), default=4, help="K, --spec-grammar-matrix"
    )
    args = p.parse_args(argv)
    if args.startup and args.random_weights:
        p.error("--startup times fm-serve on the real weights; leave out --random-weights")
    if args.matrix + args.costs + args.spec_grammar_matrix > 1:
        p.error("argument --matrix: not with --costs or --spec-grammar-matrix (one at a time)")
    if args.spec_grammar_matrix and args.random_weights:
        p.error("argument --spec-grammar-matrix: needs the tokenizer; leave out --random-weights")
    if args.spec_grammar_matrix:
        from fm_serve.spec import Ngram

        try:
            Ngram(args.draft_tokens).check()
        except ValueError as err:
            p.error(f"argument --draft-tokens: {err}")
    if args.max_tokens >= args.max_seq_len:
        p.error(
            f"argument --max-tokens: {args.max_tokens} new tokens do not fit --max-seq-len "
            f"{args.max_seq_len} with a prompt"
        )
    import jax

    from fm_serve.gemma import load

    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    if args.random_weights:
        loaded = load.random_model(
            max_seq_len=args.max_seq_len, row_tile=args.row_tile, dtype=args.dtype
        )
        log(f"random weights ({args.dtype}) built in {loaded.load_s:.2f} s")
    else:
        from fm_serve.gemma.files import ModelFilesMissing

        try:
            plain = load.load_model(max_seq_len=args.max_seq_len, row_tile=args.row_tile)
        except ModelFilesMissing as err:
            print(f"fm-serve-bench: {err} (or run with --random-weights)", file=sys.stderr)
            return 2
        loaded = load.with_dtype(plain, args.dtype)
        log(f"model loaded in {loaded.load_s:.2f} s")
    if args.matrix or args.costs or args.spec_grammar_matrix:
        from fm_serve.gemma import features_bench

        run = features_bench.matrix if args.matrix else features_bench.costs
        if args.spec_grammar_matrix:
            run = features_bench.spec_grammar_matrix
        return run(loaded, args, log)
    for b in args.batch_sizes:
        longest = max(len(r.prompt) for r in bench_requests(loaded, b, args.max_tokens))
        if longest + args.max_tokens > args.max_seq_len:
            p.error(
                f"argument --max-seq-len: {args.max_seq_len} does not hold a prompt of "
                f"{longest} tokens + --max-tokens {args.max_tokens} (batch size {b})"
            )
    batches = [
        run_batch_size(
            loaded,
            b,
            max_tokens=args.max_tokens,
            prefill_budget=args.prefill_budget,
            ratios=args.ratios,
            host_cost_kind=args.host_cost,
            repeats=args.repeats,
            log=log,
        )
        for b in args.batch_sizes
    ]
    doc = {
        "environment": environment(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "fm-serve-bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "weights": "random" if args.random_weights else "gguf",
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "prefill_budget": args.prefill_budget,
        "max_seq_len": args.max_seq_len,
        "row_tile": args.row_tile,
        "repeats": args.repeats,
        "host_cost_kind": args.host_cost,
        "batches": batches,
    }
    if args.bound:
        from fm_serve.gemma.bound import machine_rates

        doc["bound"] = machine_rates(loaded.params)
        log(f"bound: {doc['bound']}")
    if args.startup:
        log("start-up: two fresh fm-serve processes on an empty cache")
        doc["startup"] = measure_startup()
    print(markdown(doc, None))
    if args.out is not None:
        tag = args.tag or jax.devices()[0].platform
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"gemma_random_{args.dtype}_{tag}" if args.random_weights else f"gemma_serve_{tag}"
        stem = args.out / name
        Path(f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
        png = plot_if_possible(doc, Path(f"{stem}.png"))
        Path(f"{stem}.md").write_text(markdown(doc, png.name if png else None))
        log(f"wrote {stem}.{{json,md,png}}" if png else f"wrote {stem}.{{json,md}} (no matplotlib)")
    return 0 if all(b["tokens_equal"] for b in doc["batches"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
