"""scripts/mutation_report.py's summary: what counts as killed, a rerun of the survivors
included, and which mutants it lists as left."""

from __future__ import annotations

import importlib.util
import os
import subprocess
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


def test_an_incremental_run_counts_the_lines_changed_since_its_revision(tmp_path: Path) -> None:
    """A run with a `since` file (mutation.sh --since): the lines of the snapshot's file that
    differ from the file at that git revision (replaced and inserted ones; removed ones hold
    no mutant), and the report's note naming the file, the revision and what was
    generated."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "m.py").write_text("a = 1\nb = 2\nc = 3\nd = 4\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    snap = tmp_path / "snap" / "pkg"
    snap.mkdir(parents=True)
    (snap / "m.py").write_text("a = 1\nb = 20\nc = 3\nnew = 0\n")  # b changed, d -> new
    old = Path.cwd()
    try:
        os.chdir(repo)
        assert report.changed_since("HEAD", snap.parent, "pkg/m.py") == {2, 4}
    finally:
        os.chdir(old)
    ms = [report.Mutant(n, "pkg/m.py", "killed", line, "", "") for n, line in (("y", 2), ("z", 4))]
    text = report.render(ms, [], {}, {}, None, {"pkg/m.py": ("HEAD", 3)})
    assert "**Score: 2/2 mutants killed" in text
    assert "only the mutants on lines changed since their last full run's revision" in text
    assert "`pkg/m.py` since `HEAD` (3 generated)" in text


def test_a_listed_equivalent_mutant_that_timed_out_counts_as_a_survivor(tmp_path: Path) -> None:
    """mutmut counts a timeout as killed; a mutant the survivors file lists as equivalent
    (no test can kill it) that timed out on a loaded machine was not killed by a test: it
    is a survivor, listed with its explanation, and the score does not count it."""
    survivors = tmp_path / "s.toml"
    survivors.write_text(
        '[[equivalent]]\nfile = "m.py"\nbefore = "a_t"\nafter = "b_t"\nwhy = "the same sort"\n'
    )
    ms = [_m("k", "killed"), _m("t", "timeout"), _m("u", "timeout")]
    assert report._explain(ms, survivors) == []
    text = report.render(ms, [], {}, {})
    assert "**Score: 2/3 mutants killed (66.7%)" in text
    assert "| `m.py` | 3 | 2 | 0 | 1 | 1 | 0 |" in text
    left = text.split("## Mutants no test killed")[1].split("##")[0]
    assert "(timed out, equivalent): `a_t`" in left and "the same sort" in left
    assert "a_u" in text.split("## Mutants killed by a timeout")[1]


def test_a_mutated_line_is_found_where_the_guess_from_its_function_misses():
    """Pins the report failing with an IndexError (and `--since` listing no mutant) when a
    function's generated copy put the mutated line past the end of the file (the file's
    last function, a line short in the copy): the line is the nearest holding the text."""
    source = ["def f():", "    x = 1", "    return x"]
    assert report._line_of(source, 3, "  return x") == 3  # the guess holds it
    assert report._line_of(source, 4, "return x") == 3  # past the end: the nearest
    assert report._line_of(source, 1, "x = 1") == 2
    assert report._line_of(source, 4, "y = 2") == 4  # nowhere: the guess stands
