"""Markdown: the headline table and one table per sweep (median µs, p10–p90)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

COLUMNS = (
    ("fm_jax", False),
    ("fm_jax", True),
    ("fm_jax_fused", False),
    ("fm_jax_fused", True),
    ("fm_torch", False),
    ("fm_torch", True),
    ("naive_jax", False),
    ("floor", False),
)


def column_name(impl: str, debug: bool) -> str:
    """Header of an implementation column, e.g. 'fm_jax debug'."""
    return impl + (" debug" if debug else "")


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "–"
    return f"{r['median_us']:.1f} ({r['p10_us']:.0f}–{r['p90_us']:.0f})"


def headline_table(figs: Sequence[dict[str, Any]]) -> str:
    """The headline figures with their medians, targets and pass/miss."""
    lines = [
        "| figure | numerator µs | denominator µs | ratio | target | result |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for f in figs:
        res = "–" if f["pass"] is None else ("pass" if f["pass"] else "**miss**")
        ratio = "n/a" if f["ratio"] is None else f"{f['ratio']:.2f}"
        lines.append(
            f"| {f['figure']} | {f['numerator_us']:.1f} | {f['denominator_us']:.1f} | "
            f"{ratio} | {f['target'] or 'reported'} | {res} |"
        )
    return "\n".join(lines)


def sweep_table(rows: Iterable[dict[str, Any]], vary: str, title: str) -> str:
    """One table: a row per (op, value of `vary`), a column per implementation."""
    rows = list(rows)
    if not rows:
        return ""
    by: dict[tuple[str, int], dict[tuple[str, bool], dict[str, Any]]] = {}
    bytes_of: dict[tuple[str, int], int] = {}
    for r in rows:
        k = (r["op"], r[vary])
        by.setdefault(k, {})[(r["impl"], r["debug"])] = r
        bytes_of[k] = r["bytes"]
    cols = [c for c in COLUMNS if any(c in v for v in by.values())]
    head = f"| op | {vary} | " + " | ".join(column_name(*c) for c in cols) + " | min bytes |"
    sep = "| --- | ---: | " + " | ".join("---:" for _ in cols) + " | ---: |"
    lines = [f"### {title}", "", "median µs (p10–p90)", "", head, sep]
    ops_order = list(dict.fromkeys(r["op"] for r in rows))
    for op in ops_order:
        for v in sorted({k[1] for k in by if k[0] == op}):
            cells = by[(op, v)]
            lines.append(
                f"| {op} | {v} | "
                + " | ".join(_cell(cells.get(c)) for c in cols)
                + f" | {bytes_of[(op, v)]} |"
            )
    return "\n".join(lines)


def markdown(doc: dict[str, Any], sections: Sequence[tuple[str, str, list[dict[str, Any]]]]) -> str:
    """The whole report: device, load, headline figures, sweep tables."""
    meta = doc["meta"]
    parts = [
        f"# fm-bench ({meta['plan']} run)",
        "",
        f"- device: {doc['device']}",
        f"- torch device: {meta['torch_device']}, torch threads: {meta['torch_threads']}",
        f"- fm_jax compiler options (class ops and fused step): "
        f"{meta.get('fm_jax_compiler_options') or 'none'}",
        f"- load average (1/5/15 min) at start: {meta['load_start']}, at end: {meta['load_end']}",
        f"- wall time: {meta['wall_s']:.0f} s",
        "",
        "## Headline figures (one interleaved group, medians)",
        "",
        headline_table(doc["headline"]),
        "",
        "`fm_jax_fused` is the marginal cost: the jitted engine step with the FutureMap ops",
        "minus the same step without them, per repetition. `floor` is one jitted no-op dispatch",
        "on the same arrays. `min bytes` is what the op must move at the least (batch-sized).",
        "",
    ]
    if doc.get("inplace_check"):
        parts += [
            "## In place: whole-buffer rewrites in the compiled HLO",
            "",
            "Instructions that copy or convert a whole [R, ...] buffer (an in-place scatter",
            "is not one). 0 means the op moves batch-sized data only. 'Split over threads'",
            "counts instructions XLA:CPU hands to its thread pool (compiled with",
            "`fm_jax.compiler_options()`; 0: the op runs on the calling thread).",
            "",
            doc["inplace_check"],
            "",
        ]
    for title, vary, rows in sections:
        t = sweep_table(rows, vary, title)
        if t:
            parts += [t, ""]
    return "\n".join(parts)
