"""PNG plots: cost vs batch and cost vs pool size, one line per implementation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fm_bench.report import COLUMNS, column_name

PLOT_OPS = ("step", "resolve_decode", "stash", "publish")
SPEC_PLOT_OPS = ("step", "resolve_spec", "stash_spec")


def plot(
    rows: Sequence[dict[str, Any]], vary: str, ops: Sequence[str], title: str, path: Path
) -> Path | None:
    """Median µs against `vary` ('batch' or 'pool'), log-log, a panel per op."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in ops if any(r["op"] == op for r in rows)]
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, op in zip(axes[0], ops, strict=True):
        for n, (impl, debug) in enumerate(COLUMNS):
            pts = sorted(
                (r[vary], r["median_us"])
                for r in rows
                if r["op"] == op and r["impl"] == impl and r["debug"] == debug
            )
            pts = [(x, y) for x, y in pts if y > 0]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(
                    xs,
                    ys,
                    # Colours repeat past the cycle's length: the marker tells those apart.
                    marker="os^"[(n // len(colors)) % 3],
                    linestyle="--" if debug else "-",
                    color=colors[n % len(colors)],
                    label=column_name(impl, debug),
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel(vary)
        ax.set_ylabel("median µs")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
