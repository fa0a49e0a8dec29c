"""Markdown: the headline table, the protocol comparison and one table per sweep (median µs,
p10–p90)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("fm_jax", False),
    ("fm_jax", True),
    ("fm_jax_host", False),
    ("fm_jax_fused", False),
    ("fm_jax_fused", True),
    ("fm_torch", False),
    ("fm_torch", True),
    ("sglang_torch", False),
    ("sglang_torch", True),
    ("sglang_jax", False),
    ("naive_jax", False),
    ("floor", False),
    ("floor_host", False),
    ("floor_state", False),
)


def column_name(impl: str, debug: bool) -> str:
    """Header of an implementation column, e.g. 'fm_jax debug'."""
    return impl + (" debug" if debug else "")


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "–"
    return f"{r['median_us']:.1f} ({r['p10_us']:.0f}–{r['p90_us']:.0f})"


def headline_table(figs: Sequence[dict[str, Any]]) -> str:
    """The headline figures: host-time medians and ratio (what the target judges), the
    waited medians and ratio beside them, the target and pass/miss."""
    lines = [
        "| figure | host µs (num / den) | host ratio | waited µs (num / den) | waited ratio "
        "| target (judges) | result |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]

    def num(x: float | None, digits: int) -> str:
        return "n/a" if x is None else f"{x:.{digits}f}"

    for f in figs:
        res = "–" if f["pass"] is None else ("pass" if f["pass"] else "**miss**")
        host = f"{num(f.get('numerator_host_us'), 1)} / {num(f.get('denominator_host_us'), 1)}"
        lines.append(
            f"| {f['figure']} | {host} | {num(f.get('host_ratio'), 2)} | "
            f"{f['numerator_us']:.1f} / {f['denominator_us']:.1f} | "
            f"{num(f.get('waited_ratio', f['ratio']), 2)} | "
            f"{f['target'] or 'reported'} ({f.get('judged_on', 'waited')}) | {res} |"
        )
    return "\n".join(lines)


_PROTOCOL_OP_ORDER = ("step", "resolve_decode", "resolve_mixed", "resolve_spec", "stash")


def _protocol_op(c: dict[str, Any]) -> str:
    if not c["spec"]:
        return c["op"] + (" (control)" if c["op"] == "stash" else "")
    return f"{c['op']} (spec H={c['hidden']})"


def _range_cell(median: float, lo_hi: Sequence[float], digits: int) -> str:
    lo, hi = lo_hi
    return f"{median:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def protocol_table(comparisons: Iterable[dict[str, Any]], impls: Sequence[str]) -> str:
    """Gather vs sentinel, a row per (pool, op, implementation): both medians and the ratio,
    each as the median over runs (range over runs)."""
    comps = list(comparisons)
    if not comps:
        return ""

    def order(c: dict[str, Any]) -> tuple[Any, ...]:
        impl = impls.index(c["impl"]) if c["impl"] in impls else len(impls)
        return (c["pool"], c["spec"], _PROTOCOL_OP_ORDER.index(c["op"]), impl)

    lines = [
        "| R | op | impl | host µs: sentinel | gather | gather / sentinel "
        "| waited µs: sentinel | gather | gather / sentinel |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def cells(c: dict[str, Any], prefix: str) -> str:
        if c.get(prefix + "sentinel_us") is None:
            return "– | – | –"
        ratio = c[prefix + "ratio"]
        ratio_cell = "n/a" if ratio is None else _range_cell(ratio, c[prefix + "ratio_range"], 2)
        return (
            f"{_range_cell(c[prefix + 'sentinel_us'], c[prefix + 'sentinel_range_us'], 1)} | "
            f"{_range_cell(c[prefix + 'gather_us'], c[prefix + 'gather_range_us'], 1)} | "
            f"{ratio_cell}"
        )

    for c in sorted(comps, key=order):
        lines.append(
            f"| {c['pool']} | {_protocol_op(c)} | {c['impl']} | {cells(c, 'host_')} | "
            f"{cells(c, '')} |"
        )
    return "\n".join(lines)


def _protocol_section(doc: dict[str, Any]) -> list[str]:
    comps = doc.get("protocols") or []
    if not comps:
        return []
    from fm_bench.plan import PROTOCOL_IMPLS

    batch = comps[0]["batch"]
    runs = comps[0]["runs"]
    return [
        "## Protocols: gather vs sentinel (one interleaved group per R, side by side)",
        "",
        f"B = {batch}, int32 buffers, debug off. Each R is one group holding both protocols'",
        f"series of every implementation, measured {runs} times (each run shuffles its rounds",
        "with its own seed); a cell is the median over those runs of each run's median, with",
        "the range over runs; the ratio is taken per run, then its median and range. Host",
        "µs: the calls' own time with one step in flight (what an overlap engine's",
        "scheduler pays); waited µs: each step waited for (a synchronous loop's). A step",
        "is resolve + publish + stash, and in the sentinel protocol invalidate too.",
        "`fm_jax_host` is the class fed numpy arrays, as a host scheduler feeds it;",
        "`fm_jax` the class fed jax arrays; both pass a gather DECODE batch",
        "`input_ids=None`, as the class documents (no ids placed: they are gathered);",
        "`fm_jax_fused` the marginal cost of the pure ops in a jitted step.",
        "`sglang_torch` is SGLang's sentinel-era class (late May 2026) under the sentinel",
        "protocol and SGLang's current class (commit 0178132: no sentinels, spec lengths",
        "gathered on the device, no host length copy) under the gather protocol. `stash` is",
        "the control: the same code in both protocols.",
        "",
        protocol_table(comps, PROTOCOL_IMPLS),
        "",
    ]


def _config_label(r: dict[str, Any]) -> str:
    s = f"B={r['batch']} R={r['pool']}"
    return s + (f" spec H={r['hidden']} {r['hidden_dtype']}" if r["spec"] else "")


def step_table(rows: Iterable[dict[str, Any]]) -> str:
    """The headline group's step medians: a row per configuration, a column per impl."""
    by: dict[str, dict[tuple[str, bool], dict[str, Any]]] = {}
    for r in rows:
        if r["op"] == "step":
            by.setdefault(_config_label(r), {})[(r["impl"], r["debug"])] = r
    if not by:
        return ""
    cols = [c for c in COLUMNS if any(c in v for v in by.values())]
    lines = [
        "| configuration | " + " | ".join(column_name(*c) for c in cols) + " |",
        "| --- | " + " | ".join("---:" for _ in cols) + " |",
    ]
    for label, cells in by.items():
        lines.append(f"| {label} | " + " | ".join(_cell(cells.get(c)) for c in cols) + " |")
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
        *([f"- command: `{meta['command']}`"] if meta.get("command") else []),
        f"- device: {doc['device']}",
        f"- torch device: {meta['torch_device']}, torch threads: {meta['torch_threads']}",
        f"- fm_jax compiler options (class ops and fused step): "
        f"{meta.get('fm_jax_compiler_options') or 'none'}",
        f"- load average (1/5/15 min) at start: {meta['load_start']}, at end: {meta['load_end']}",
        f"- wall time: {meta['wall_s']:.0f} s",
        "",
    ]
    if doc.get("startup"):
        from fm_bench.startup import table as startup_table

        parts += [
            "## Start-up: `FutureMap.warm_up()` in a fresh process",
            "",
            "Per map: a process without JAX's persistent cache, one filling an empty cache",
            "directory (`fm_jax.use_persistent_cache`), one starting from it. Default",
            "buckets unless the plan says small; spec: K = 8, H = 4096 bf16; mesh: DP = 4 x",
            "TP = 2 (8 virtual CPU devices on a CPU machine). 'process s' adds importing",
            "jax and fm_jax and building the map.",
            "",
            startup_table(doc["startup"]),
            "",
        ]
    if doc.get("headline"):
        parts += _headline_section(doc)
    parts += _protocol_section(doc)
    if doc.get("engine_step"):
        from fm_bench.engine_step import markdown as engine_step_markdown

        page = engine_step_markdown(doc["engine_step"]).replace("# ", "## ", 1)
        parts += [page, ""]
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


def _headline_section(doc: dict[str, Any]) -> list[str]:
    parts = [
        "## Headline figures (one interleaved group, medians)",
        "",
        headline_table(doc["headline"]),
        "",
    ]
    steps = step_table(doc.get("headline_results") or [])
    if steps:
        parts += ["### Headline group: step, median µs (p10–p90)", "", steps, ""]
    parts += [
        "`fm_jax` is the FutureMap class fed jax arrays, `fm_jax_host` the class fed numpy",
        "arrays (a step is `resolve` + `finish`). `fm_jax_fused` is the marginal cost: the",
        "jitted engine step with the FutureMap ops minus the same step without them, per",
        "repetition. `sglang_torch` is SGLang's FutureMap as it runs in production (int64",
        "buffers, eager indexing, no host checks; debug: its CI-mode consume check);",
        "`sglang_jax` is sglang-jax's future token map (int32 map of R + 2 replicated on the",
        "mesh, not donated; tokens only: no lengths, spec or debug). Both keep their peer's",
        "dtype in every configuration. `floor` / `floor_host` are jitted no-op dispatches on",
        "the arrays each class call takes (jax / numpy), two for a step. `min bytes` is what",
        "the op must move at the least (batch-sized).",
        "",
    ]
    return parts


def write_result(out: Path, name: str, md: str, doc: Any, tag: str | None = None) -> None:
    """Write a probe's `<name>_<tag>.md` and `.json` into `out` (made if missing); `tag`
    defaults to JAX's platform of the default device (`cpu`, `gpu`)."""
    if tag is None:
        import jax

        tag = jax.devices()[0].platform
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}_{tag}.md").write_text(md)
    (out / f"{name}_{tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
