"""Run `fm-bench --headline-only` N times, one after another, and write each figure's ratio
per run with their median (`fm_bench/results/headline_<platform>_runs.md`): a noisy
machine's single run says little, the median of five says more.

    .venv/bin/python scripts/headline_runs.py [--runs 5] [--out fm_bench/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("fm_bench/results"))
    ap.add_argument("--note", default="", help="a line on the machine's state, for the page")
    args = ap.parse_args()
    runs: list[list[dict]] = []
    platform = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            path = Path(tmp) / f"run{i}.json"
            cmd = [sys.executable, "-m", "fm_bench.cli", "--headline-only", "--json", str(path)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            got = json.loads(path.read_text())
            platform = "cuda" if "cuda" in str(got["device"]).lower() else "cpu"
            runs.append(got["headline"])
            print(f"run {i + 1}/{args.runs} done", file=sys.stderr, flush=True)
    head = "| figure | " + " | ".join(f"run {i + 1}" for i in range(len(runs)))
    lines = [
        f"# Headline figures over {len(runs)} runs ({platform.upper()})",
        "",
        f"`{len(runs)}` `fm-bench --headline-only` runs one after another "
        "(`scripts/headline_runs.py`). Per figure: the ratio its target judges (host time "
        "unless marked waited) in each run, their median and the target ('reported': none).",
        *([""] + [args.note] if args.note else []),
        "",
        head + " | median | target |",
        "| --- |" + " ---: |" * (len(runs) + 1) + " --- |",
    ]
    for k, fig in enumerate(runs[0]):
        vals = [r[k]["ratio"] for r in runs]
        waited = " (waited)" if fig.get("judged_on") == "waited" else ""
        cells = " | ".join(f"{v:.2f}" for v in vals)
        lines.append(
            f"| {fig['figure']} | {cells} | {statistics.median(vals):.2f} | "
            f"{fig['target'] or 'reported'}{waited} |"
        )
    out = args.out / f"headline_{platform}_runs.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
