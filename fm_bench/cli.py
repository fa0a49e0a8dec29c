"""`fm-bench`: side-by-side cost of fm_jax, fm_torch and the peers' future maps.

    fm-bench --quick              # tiny sweep, seconds; prints the tables
    fm-bench                      # full run (a few minutes) into fm_bench/results/
    fm-bench --json out.json      # also write the results as JSON
    fm-bench --headline-only --json h.json   # the headline group only; its rows as results
    fm-bench --startup-only       # the start-up table only (warm_up cold and from disk)
    fm-bench --protocols-only --out fm_bench/results   # gather vs sentinel only, into
                                  # protocols_<platform>.{json,md}
    fm-bench --engine-step-only   # the engine-step group only (fm_bench.engine_step)

The peers are SGLang's FutureMap (`sglang_torch`) and sglang-jax's future token map
(`sglang_jax`), reproduced as they run; `naive_jax` and `floor` are references.

int64 needs JAX's x64 mode, which fm_jax never turns on: that part runs in a child process
with JAX_ENABLE_X64=1 and its rows are merged in.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fm_bench.plan import IMPLS

RESULTS_DIR = Path(__file__).resolve().parent / "results"
IMPL_ORDER = IMPLS
"""Implementations measured in every group, in report order (see fm_bench.plan.IMPLS)."""


def _device() -> str:
    import jax

    d = jax.devices()[0]
    cpu = f"{platform.machine()} {os.cpu_count()} logical CPUs"
    return f"jax {jax.__version__} {d.platform}:{d.device_kind} ({cpu})"


def _platform() -> str:
    """The JAX default device's platform ('cpu', 'gpu', ...), for file names."""
    import jax

    return str(jax.devices()[0].platform)


def fj_compiler_options() -> dict[str, str]:
    """The XLA options fm_jax compiles its class ops and the fused step with, here."""
    import fm_jax

    return fm_jax.compiler_options()


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _on_cpu() -> bool:
    """Whether jax and torch both run on the CPU (some figures are targeted there only)."""
    import jax

    from fm_bench.impls.torch_common import device as torch_device

    return jax.default_backend() == "cpu" and torch_device().type == "cpu"


def _measure_all(
    plan: Any, int64: bool, bar: Any, sweeps: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Headline group (int32 only), then one group per sweep configuration (if `sweeps`).

    Each configuration is built (and compiled) once: the headline group takes its 'step'
    series from the same builds that the sweep groups then measure whole.

    Returns:
      (headline figures, sweep rows, the headline group's rows), rows in the JSON row schema.
    """
    from fm_bench import headline, run

    variants = [(impl, False) for impl in IMPL_ORDER] + [(i, True) for i in plan.debug_variants]
    built: dict[Any, list[Any]] = {}

    def get(cfg: Any) -> list[Any]:
        if cfg not in built:
            built[cfg] = run.build_series(cfg, variants, cfg.ops())
        return built[cfg]

    figs: list[dict[str, Any]] = []
    head_rows: list[dict[str, Any]] = []
    if not int64:
        bar.set_description("headline group")
        sweep = set(plan.sweep_configs(False)) if sweeps else set()
        for cfg in plan.headline.configs().values():
            if cfg in sweep:
                get(cfg)  # built whole once: its sweep group measures it again
        stats = run.measure(
            headline.headline_series(plan.headline, built),
            reps=plan.headline_reps,
            warmup=plan.warmup,
            budget_s=plan.headline_budget_s,
            min_reps=max(plan.min_reps, plan.headline_reps // 4),
        )
        figs = [
            f.evaluate(stats)
            for f in headline.figures(plan.headline, on_cpu=_on_cpu())
            if f.num in stats and f.den in stats  # a plan may leave some variants out
        ]
        head_rows = run.rows_of(stats)
        bar.update(1)
    rows: list[dict[str, Any]] = []
    for cfg in plan.sweep_configs(int64) if sweeps else []:
        bar.set_description(cfg.label())
        stats = run.measure(
            get(cfg),
            reps=plan.reps,
            warmup=plan.warmup,
            budget_s=plan.group_budget_s,
            min_reps=plan.min_reps,
        )
        rows += run.rows_of(stats)
        del built[cfg]
        gc.collect()
        bar.update(1)
    built.clear()
    gc.collect()
    return figs, rows, head_rows


def _int64_child(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str | None]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "int64.json"
        cmd = [sys.executable, "-m", "fm_bench.cli", "--child-int64", "--json", str(out)]
        cmd += ["--plan", args.plan]
        if args.reps is not None:
            cmd += ["--reps", str(args.reps)]
        env = dict(os.environ, JAX_ENABLE_X64="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return [], f"int64 child failed ({proc.returncode}): {proc.stderr[-2000:]}"
        return json.loads(out.read_text())["results"], None


def _plan(args: argparse.Namespace) -> Any:
    from dataclasses import replace

    from fm_bench import plan

    p = plan.get(args.plan)
    if args.reps is not None:
        p = replace(p, reps=args.reps, headline_reps=args.reps, min_reps=min(p.min_reps, args.reps))
        if p.protocols is not None:
            p = replace(p, protocols=replace(p.protocols, reps=args.reps))
    return p


def _sections(p: Any, rows: list[dict[str, Any]]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    def of(cfgs: Any) -> list[dict[str, Any]]:
        keys = {(c.batch, c.pool, c.spec, c.dtype, c.protocol) for c in cfgs}
        return [
            r for r in rows if (r["batch"], r["pool"], r["spec"], r["dtype"], r["protocol"]) in keys
        ]

    b0, r0 = p.batch_sweep[0], p.pool_sweep[0]
    s0 = p.spec_sweep[0] if p.spec_sweep else None
    out = [
        (f"Cost vs batch (R={b0.pool}, int32, spec off)", "batch", of(p.batch_sweep)),
        (f"Cost vs pool size R (B={r0.batch}, int32, spec off)", "pool", of(p.pool_sweep)),
    ]
    if s0 is not None:
        out.append(
            (
                f"Spec extras (B={s0.batch}, K={s0.topk}, H={s0.hidden} {s0.hidden_dtype}, int32)",
                "pool",
                of(p.spec_sweep),
            )
        )
    out.append(("int64 buffers (JAX_ENABLE_X64=1 child process)", "pool", of(p.int64_sweep)))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring. Returns the exit status."""
    ap = argparse.ArgumentParser(prog="fm-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny sweep (seconds), no files by default"
    )
    ap.add_argument("--json", type=Path, help="write the results as JSON to this path")
    ap.add_argument(
        "--out",
        type=Path,
        help=f"directory for results.json, results.md and plots (full run default: {RESULTS_DIR})",
    )
    ap.add_argument("--reps", type=int, help="timed repetitions per series (override)")
    ap.add_argument("--no-int64", action="store_true", help="skip the int64 child process")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument(
        "--headline-only",
        action="store_true",
        help="only the headline group (about 1.5 min in a full run): no sweeps, int64, "
        "in-place check or plots, and no files unless --out or --json is given",
    )
    ap.add_argument(
        "--startup-only",
        action="store_true",
        help="only the start-up table (fresh processes: warm_up cold, filling and reading "
        "JAX's persistent cache); no files unless --out or --json is given",
    )
    ap.add_argument("--no-startup", action="store_true", help="skip the start-up table")
    ap.add_argument(
        "--protocols-only",
        action="store_true",
        help="only the protocol comparison (gather vs sentinel, side by side); with --out, "
        "written as protocols_<platform>.{json,md}; no files unless --out or --json is given",
    )
    ap.add_argument("--no-protocols", action="store_true", help="skip the protocol comparison")
    ap.add_argument(
        "--engine-step-only",
        action="store_true",
        help="only the engine-step group (the map inside the engine's step, host and "
        "waited figures); no files unless --out or --json is given",
    )
    ap.add_argument("--no-engine-step", action="store_true", help="skip the engine-step group")
    ap.add_argument("--plan", choices=("full", "quick", "tiny"), help=argparse.SUPPRESS)
    ap.add_argument("--child-int64", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plan is None:
        args.plan = "quick" if args.quick else "full"

    from tqdm import tqdm

    p = _plan(args)
    if args.child_int64:
        with tqdm(total=len(p.sweep_configs(True)), file=sys.stderr, leave=False) as bar:
            _, int64_rows, _ = _measure_all(p, True, bar)
        if args.json:
            args.json.write_text(json.dumps({"results": int64_rows}))
        return 0

    t0, load_start = time.perf_counter(), _load()
    only_startup, only_protocols = args.startup_only, args.protocols_only
    only_engine_step = args.engine_step_only
    only_part = only_startup or only_protocols or only_engine_step
    sweeps = not (args.headline_only or only_part)
    with_int64 = sweeps and not args.no_int64
    with_startup = (
        p.startup is not None
        and not args.no_startup
        and not args.headline_only
        and not only_protocols
        and not only_engine_step
    )
    protocols = p.protocols if (sweeps or only_protocols) and not args.no_protocols else None
    engine_step = (
        p.engine_step if (sweeps or only_engine_step) and not args.no_engine_step else None
    )
    n_groups = (
        int(not only_part)
        + (len(p.sweep_configs(False)) if sweeps else 0)
        + int(with_int64)
        + int(with_startup)
        + (len(protocols.pools) * protocols.runs if protocols else 0)
        + int(engine_step is not None)
    )
    int64_error = None
    figs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    head_rows: list[dict[str, Any]] = []
    startup_rows: list[dict[str, Any]] = []
    protocol_rows: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    step_doc: dict[str, Any] | None = None
    with tqdm(total=n_groups, file=sys.stderr, unit="group") as bar:
        if not only_part:
            figs, rows, head_rows = _measure_all(p, False, bar, sweeps)
        if protocols is not None:
            from fm_bench import protocols as protocol_groups

            started = [0]

            def next_group(label: str) -> None:
                if started[0]:  # the group before this one is done
                    bar.update(1)
                started[0] += 1
                bar.set_description(label)

            protocol_rows, comparisons = protocol_groups.measure(
                protocols, warmup=p.warmup, min_reps=p.min_reps, on_group=next_group
            )
            bar.update(1)
        if engine_step is not None:
            from fm_bench import engine_step as step_group

            bar.set_description("engine step")
            e = engine_step
            step_doc = step_group.run(
                e.batch,
                list(e.pools),
                e.runs,
                e.steps,
                e.waited,
                log=lambda _: None,
                gap_us=e.gap_us,
            )
            bar.update(1)
        if with_int64:
            bar.set_description("int64 (child process)")
            more, int64_error = _int64_child(args)
            rows += more
            bar.update(1)
        if with_startup:
            from fm_bench import startup

            bar.set_description("start-up (fresh processes)")
            s = p.startup
            startup_rows = startup.measure(s.runs, s.pool, s.small, s.maps)
            bar.update(1)

    import torch

    from fm_bench.impls.torch_common import device as torch_device

    part = ""
    if not sweeps:
        part = ", start-up only" if only_startup else ", headline only"
        part = ", protocols only" if only_protocols else part
        part = ", engine step only" if only_engine_step else part
    given = sys.argv[1:] if argv is None else argv
    doc: dict[str, Any] = {
        "device": _device(),
        "meta": {
            "plan": p.name + part,
            "command": " ".join(["fm-bench", *given]),
            "torch_device": str(torch_device()),
            "torch_threads": torch.get_num_threads(),
            "fm_jax_compiler_options": fj_compiler_options(),
            "load_start": load_start,
            "load_end": _load(),
            "wall_s": round(time.perf_counter() - t0, 1),
            "int64_error": int64_error,
        },
        # A headline-only run has no sweeps: its results are the headline group's rows.
        "results": rows if sweeps else head_rows,
        "headline": figs,
        "headline_results": head_rows,
        "startup": startup_rows,
        "protocols": comparisons,
        "protocol_results": protocol_rows,
        "engine_step": step_doc,
    }
    from fm_bench import plots, report

    if p.inplace_check and sweeps:
        from fm_bench import inplace

        doc["inplace_check"] = inplace.table(list(p.inplace_check))
    sections = _sections(p, rows) if sweeps else []
    md = report.markdown(doc, sections)
    out_dir = args.out or (RESULTS_DIR if args.plan == "full" and sweeps else None)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        # A protocols-only run never overwrites a whole run's results.
        stem = f"protocols_{_platform()}" if only_protocols else "results"
        (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1))
        (out_dir / f"{stem}.md").write_text(md)
        if sweeps and not args.no_plots:
            figures: list[tuple[int, str, tuple[str, ...], str]] = [
                (0, "batch", plots.PLOT_OPS, "cost_vs_batch.png")
            ]
            figures.append((1, "pool", plots.PLOT_OPS, "cost_vs_pool.png"))
            if len(sections) > 3:  # a spec sweep
                figures.append((2, "pool", plots.SPEC_PLOT_OPS, "spec_vs_pool.png"))
            for i, vary, ops, name in figures:
                title, rows_i = sections[i][0], sections[i][2]
                plots.plot(rows_i, vary, ops, title, out_dir / name)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    print(md)
    if int64_error:
        print(int64_error, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
