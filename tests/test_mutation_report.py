"""scripts/mutation_report.py's summary: what counts as killed, a rerun of the survivors
included, and which mutants it lists as left."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "mutation_report", Path(__file__).parent.parent / "scripts" / "mutation_report.py"
)
assert _spec is not None and _spec.loader is not None
report = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("mutation_report", report)  # its dataclasses look themselves up
_spec.loader.exec_module(report)


def _m(name: str, status: str, rerun: str | None = None, why: str | None = None):  # noqa: ANN202
    return report.Mutant(name, "m.py", status, 1, f"a_{name}", f"b_{name}", why=why, rerun=rerun)


def test_a_survivor_the_rerun_kills_counts_as_killed_and_is_listed_apart():
    """Of four mutants: one killed by the run, one timed out (killed), one survivor the
    rerun kills, one it does not: 3/4 killed, 1 of them by the rerun; only the last is
    left, the rerun's kill in its own section."""
    ms = [
        _m("k", "killed"),
        _m("t", "timeout"),
        _m("r", "survived", rerun="killed", why="Killed by `t.py::x`"),
        _m("s", "survived", rerun="survived", why="equivalent"),
    ]
    text = report.render(ms, [], {}, {})
    assert "**Score: 3/4 mutants killed (75.0%) (1 of them survived the run" in text
    assert "| `m.py` | 4 | 2 | 1 | 1 | 1 | 0 |" in text
    left = text.split("## Mutants no test killed")[1].split("##")[0]
    assert "a_s" in left and "a_r" not in left
    assert "a_r" in text.split("## Survivors of the run killed by the rerun")[1]


def test_without_a_rerun_the_score_is_the_runs_own():
    ms = [_m("k", "killed"), _m("s", "survived")]
    text = report.render(ms, [], {}, {})
    assert "**Score: 1/2 mutants killed (50.0%).**" in text
    assert "killed by the rerun" not in text.split("##")[0].split("| file")[0]
