"""Outputs of the serving demo: a text table, a markdown report, a PNG plot and JSON."""

from __future__ import annotations

import json
from pathlib import Path

from fm_serve.sweep import SweepResult

COLUMNS = (
    "host/fwd",
    "host ms",
    "t_host ms",
    "t_step ms",
    "t_disp ms",
    "sync tok/s",
    "overlap tok/s",
    "speedup",
    "ideal",
    "of ideal",
    "ideal/step",
    "of ideal/step",
)


def _rows(res: SweepResult) -> list[list[str]]:
    out = []
    for r in res.runs:
        out.append(
            [
                f"{r.host_cost_ratio:g}",
                f"{r.host_cost_ms:.1f}",
                f"{r.t_host_ms:.1f}",
                f"{r.t_step_ms:.2f}",
                f"{r.t_dispatch_ms:.2f}",
                f"{r.sync.tok_s:.0f}",
                f"{r.overlap.tok_s:.0f}",
                f"{r.speedup:.2f}x",
                f"{r.ideal_speedup:.2f}x",
                f"{r.speedup / r.ideal_speedup:.2f}",
                f"{r.ideal_speedup_per_step:.2f}x",
                f"{r.speedup / r.ideal_speedup_per_step:.2f}",
            ]
        )
    return out


def _summary(res: SweepResult) -> str:
    dbg = {None: "not run", True: "equal", False: "DIFFERENT"}[res.debug_tokens_equal]
    return (
        f"device: {res.device} (XLA CPU threads: {res.xla_cpu_threads}); relay protocol: "
        f"{res.protocol}; {res.requests} "
        f"requests, {res.output_tokens} output tokens, {res.eos_stops} stopped early by EOS; "
        f"t_fwd {res.t_fwd_ms:.1f} ms (mean warm sync step); host cost: {res.host_cost_kind}; "
        f"best of {res.repeats} run(s) per mode and ratio\n"
        f"overlap tokens == sync tokens: {res.tokens_equal} (debug overlap run: {dbg})"
    )


def text_table(res: SweepResult) -> str:
    """A fixed-width table for the terminal, with a one-paragraph summary on top."""
    rows = [list(COLUMNS)] + _rows(res)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [_summary(res), ""]
    for k, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.extend(f"mismatch: {m}" for m in res.mismatches[:10])
    return "\n".join(lines)


def markdown(res: SweepResult, plot_name: str | None = None) -> str:
    """The markdown report: summary, settings, table and (optionally) the plot."""
    m, e = res.model, res.engine
    lines = [
        "# fm-serve-demo: synchronous vs overlap scheduling",
        "",
        _summary(res).replace("\n", "  \n"),
        "",
        f"Model: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, vocab {m.vocab}, "
        f"max_seq_len {m.max_seq_len}. Engine: {e.max_running} running slots, prefill budget "
        f"{e.prefill_budget} tokens/step, batch buckets {list(e.batch_buckets)}, token buckets "
        f"{list(e.token_buckets)}.",
        "",
        "`host/fwd`: simulated host cost per batch as a multiple of t_fwd. `t_host` (H), "
        "`t_step` (S): per-step host time and step (dispatch to tokens) in that ratio's sync "
        "run; `t_disp` (D): time inside the step call in its overlap run (the host is busy "
        "for it). `ideal` = (H + S) / max(H + D, S), the bound that counts the dispatch as "
        "host time. `ideal/step`: the same bound step by step, sum(h_i + s_i) / "
        "sum(max(h_i + D, s_i)) over the sync run's steps (tighter when step times vary: "
        "MIXED steps with a prefill chunk cost more than DECODE steps).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---:|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in _rows(res)]
    if plot_name:
        lines += ["", f"![sync vs overlap]({plot_name})"]
    return "\n".join(lines) + "\n"


def write_plot(res: SweepResult, path: Path) -> None:
    """Speedup (achieved and ideal) and tokens/s against the host-cost ratio, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.host_cost_ratio for r in res.runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(x, [r.ideal_speedup for r in res.runs], "k--o", label="ideal (mean times)")
    a.plot(x, [r.ideal_speedup_per_step for r in res.runs], "k:s", label="ideal (per step)")
    a.plot(x, [r.speedup for r in res.runs], "C1-o", label="overlap / sync")
    a.set_xlabel("host cost / forward time")
    a.set_ylabel("speedup")
    a.set_title("overlap speedup")
    a.legend()
    a.grid(alpha=0.3)
    b.plot(x, [r.sync.tok_s for r in res.runs], "C0-o", label="sync")
    b.plot(x, [r.overlap.tok_s for r in res.runs], "C1-o", label="overlap")
    b.set_xlabel("host cost / forward time")
    b.set_ylabel("output tokens / s")
    b.set_title(f"throughput ({res.device})")
    b.legend()
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(res: SweepResult, path: Path) -> None:
    """Write the `--json` document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res.as_json(), indent=2) + "\n")


def write_results(res: SweepResult, out_dir: Path, tag: str) -> list[Path]:
    """Write serve_<tag>.json, .md and .png into `out_dir`; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"serve_{tag}"
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    write_json(res, paths[0])
    plot: str | None = f"{stem}.png"
    try:
        write_plot(res, out_dir / f"{stem}.png")
        paths.append(out_dir / f"{stem}.png")
    except ImportError:
        plot = None  # matplotlib is in the optional `tools` extra
    paths[1].write_text(markdown(res, plot))
    return paths
