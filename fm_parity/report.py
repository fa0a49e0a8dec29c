"""The run's report: a summary table for people, a JSON document for machines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fm_parity.suite import MutationResult, ScenarioResult

SCENARIO_COLUMNS = (
    "scenario",
    "protocol",
    "kernel",
    "dtype",
    "debug",
    "steps",
    "ops compared",
    "divergences",
    "oracle",
)
MESH_COLUMNS = ("mesh", "HLO check")
"""Added to the table when some runs are on a mesh: 'DPxTP' (and the processes it spans),
and the sharded map's recompiles and collectives ('-' for runs on one device)."""


def _table(header: Sequence[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _hlo_check(r: ScenarioResult) -> str:
    if "recompiles" not in r.extra:
        return "-"
    moved = sum(r.extra["collectives"].values())
    return f"{r.extra['recompiles']} recompiles, {moved} collectives"


def scenario_table(results: Sequence[ScenarioResult]) -> str:
    """One line per run: scenario, relay protocol, spec kernel, dtype, debug, steps, ops compared,
    divergences, oracle (mesh runs: also the mesh shape and the HLO check; FAIL marks a
    failed check)."""
    rows = [
        [
            r.name,
            r.protocol,
            r.spec_kernel,
            r.dtype,
            "on" if r.debug else "off",
            str(r.steps),
            str(r.ops_compared),
            str(r.divergences),
            "ok" if r.oracle_ok else "FAIL",
        ]
        for r in results
    ]
    if any(r.dp is not None for r in results):
        for row, r in zip(rows, results, strict=True):
            procs = f" ({r.processes} processes)" if r.processes > 1 else ""
            row += ["-" if r.dp is None else f"{r.dp}x{r.tp}{procs}", _hlo_check(r)]
            row[-1] += " FAIL" if r.failures else ""
        return _table(SCENARIO_COLUMNS + MESH_COLUMNS, rows)
    return _table(SCENARIO_COLUMNS, rows)


def failure_details(results: Sequence[ScenarioResult]) -> str:
    """The first divergence, errors and oracle mismatches of every failing run."""
    out = []
    for r in results:
        if r.ok:
            continue
        mesh = "" if r.dp is None else f", DP={r.dp} x TP={r.tp}"
        mesh += f", {r.processes} processes" if r.processes > 1 else ""
        debug = "on" if r.debug else "off"
        out.append(f"{r.name} ({r.protocol}, {r.spec_kernel}, {r.dtype}, debug {debug}{mesh}):")
        if r.first_divergence:
            out.append(f"  first divergence: {r.first_divergence}")
        out += [f"  {twin} stopped: {err}" for twin, err in r.errors.items()]
        out += [f"  oracle: {m}" for m in r.oracle_failures]
        out += [f"  {f}" for f in r.failures]
    return "\n".join(out)


def mutation_table(results: Sequence[MutationResult]) -> str:
    """One line per mutation: the protocol it runs under, which detectors caught it, in
    which scenario."""
    rows = [[m.name, m.protocol, m.caught_by or "MISSED", m.where or "-"] for m in results]
    return _table(("mutation", "protocol", "caught by", "first caught in"), rows)


def report_json(
    device: str, scenarios: Sequence[ScenarioResult], mutations: Sequence[MutationResult]
) -> dict[str, Any]:
    """The report document: {"device", "scenarios": [...], "mutations": [...]}."""
    return {
        "device": device,
        "scenarios": [r.to_json() for r in scenarios],
        "mutations": [m.to_json() for m in mutations],
    }


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    """Write the report document to `path` (parent directories must exist)."""
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
