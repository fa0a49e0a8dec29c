"""Summarise mutmut runs (scripts/mutation.sh) as markdown: score per file, and every mutant
that no test killed with its file:line, the mutation and, when it is a known equivalent
mutant (listed in the survivors file), why no test can kill it.

Usage: mutation_report.py --survivors FILE.toml --output FILE.md [--rerun DIR]... RUN_DIR...
Each RUN_DIR is a snapshot in which `mutmut run` ran (it holds pyproject.toml and mutants/).
A --rerun DIR is a copy of one, with today's tests, in which mutmut ran again on that run's
survivors only (`bash scripts/mutation.sh --rerun GROUP`): the survivors it kills count as
killed, and the report says which. A RUN_DIR holding a file `since` (a git revision REV,
written by `bash scripts/mutation.sh --since REV GROUP`, which runs only those mutants)
counts only the mutants on lines changed since REV; --list-changed prints their names
instead of a report.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date
from pathlib import Path

DETECTED = ("killed", "timeout", "caught by type check")
TIMED_OUT = "timed out, equivalent"  # a listed equivalent mutant whose tests ran out of time


@dataclass
class Mutant:
    name: str
    file: str
    status: str
    line: int
    before: str
    after: str
    why: str | None = None
    rerun: str | None = None  # the status a rerun of the survivors gave it, if one ran

    @property
    def killed(self) -> bool:
        """Killed by the run, or (a survivor) by the rerun with today's tests."""
        return self.status in DETECTED or self.rerun in DETECTED


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _changed_lines(diff: str) -> tuple[int, list[str], list[str]]:
    """(1-based line in the function of the first removed line, removed, added) of a diff."""
    removed: list[str] = []
    added: list[str] = []
    first = 0
    old = 0
    for text in diff.splitlines():
        if text.startswith(("---", "+++")):
            continue
        if text.startswith("@@"):
            old = int(text.split()[1].lstrip("-").split(",")[0]) - 1
            continue
        if text.startswith("-"):
            old += 1
            first = first or old
            removed.append(text[1:])
        elif text.startswith("+"):
            added.append(text[1:])
        else:
            old += 1
    return first, removed, added


def _line_of(source: list[str], guess: int, text: str) -> int:
    """The 1-based line of `source` holding `text` (stripped): `guess` where it does, else
    the nearest that does (`guess` if none). The generated copy keeps the function's
    formatting, so `guess` (its def's line plus the offset in the copy) is usually right;
    comments above the def, or lines the copy lost, shift it (even past the file's end)."""
    want = text.strip()
    if 1 <= guess <= len(source) and source[guess - 1].strip() == want:
        return guess
    hits = [i + 1 for i, t in enumerate(source) if t.strip() == want]
    return min(hits, key=lambda h: abs(h - guess)) if hits else guess


def _function_start(source: list[str], tree: ast.Module, func: str, cls: str | None) -> int:
    """0-based index of the first line of the top-level function (or method) `func`."""
    body = tree.body
    if cls is not None:
        body = next(n.body for n in body if isinstance(n, ast.ClassDef) and n.name == cls)
    node = next(
        n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == func
    )
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return first - 1


def _mutants_of(run_dir: Path, every_line: bool = False) -> list[Mutant]:
    """Every mutant of one run, with where and what it changed (read with mutmut's own API;
    a killed mutant's only with `every_line`)."""
    with _cwd(run_dir):
        from mutmut.configuration import reset_config
        from mutmut.mutation.data import SourceFileMutationData
        from mutmut.mutation.diff_apply import get_diff_for_mutant
        from mutmut.stats import status_by_exit_code
        from mutmut.utils.file_utils import walk_mutatable_files
        from mutmut.utils.format_utils import orig_function_and_class_names_from_key

        reset_config()
        out = []
        for path in sorted(walk_mutatable_files()):
            data = SourceFileMutationData(path=path)
            data.load()
            source = path.read_text().splitlines()
            tree = ast.parse("\n".join(source))
            for name, code in data.exit_code_by_key.items():
                status = status_by_exit_code[code]
                if status == "killed" and not every_line:
                    out.append(Mutant(name, str(path), status, 0, "", ""))
                    continue
                diff = get_diff_for_mutant(name, path=path)
                offset, removed, added = _changed_lines(diff)
                func, cls = orig_function_and_class_names_from_key(name)
                line = _function_start(source, tree, func, cls) + offset
                if removed:
                    line = _line_of(source, line, removed[0])
                before = " / ".join(t.strip() for t in removed)
                after = " / ".join(t.strip() for t in added)
                out.append(Mutant(name, str(path), status, line, before, after))
        reset_config()
    return out


def changed_since(rev: str, run_dir: Path, file: str) -> set[int]:
    """The 1-based lines of the snapshot's `file` that differ from `file` at git revision
    `rev` of the checkout this script runs in (a new file: every line)."""
    old = subprocess.run(["git", "show", f"{rev}:{file}"], capture_output=True, text=True)
    before = old.stdout.splitlines() if old.returncode == 0 else []
    after = (run_dir / file).read_text().splitlines()
    lines: set[int] = set()
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag in ("replace", "insert"):
            lines.update(range(j1 + 1, j2 + 1))
    return lines


def _explain(mutants: list[Mutant], survivors_file: Path) -> list[dict[str, str]]:
    """Attach each listed explanation to the survivors it matches (by file and the line
    before and after the mutation; the first entry for a key wins); return the entries that
    matched no survivor. `[[equivalent]]` entries say why no test can kill the mutant;
    `[[killed]]` entries name the test added after the run that kills it."""
    table = tomllib.loads(survivors_file.read_text())
    listed = table.get("equivalent", []) + table.get("killed", [])
    key = lambda e: (e["file"], e["before"].strip(), e["after"].strip())  # noqa: E731
    why: dict[tuple[str, str, str], str] = {}
    for e in listed:
        text = e.get("why") or (
            f"Killed by `{e['test']}`, added after this run (checked against this mutant by "
            "hand; the next run counts it)."
        )
        why.setdefault(key(e), text.strip())
    equivalent = {key(e) for e in table.get("equivalent", [])}
    matched = set()
    for m in mutants:
        k = (m.file, m.before, m.after)
        if m.status == "timeout" and k in equivalent:
            # A mutant known to change nothing that ran out of time (a loaded machine) was
            # not killed by a test: it counts as a survivor, with its explanation.
            m.status = TIMED_OUT
        if m.status not in DETECTED and k in why:
            m.why = why[k]
            matched.add(k)
    files = {m.file for m in mutants}
    return [e for e in listed if key(e) not in matched and e["file"] in files]


def _md(text: str) -> str:
    return "`" + text.replace("`", "'") + "`" if text else "(nothing)"


def _uncovered(run_dir: Path) -> dict[str, list[int]]:
    """The lines of the mutated file that no test of the group executed (coverage.json)."""
    path = run_dir / "coverage.json"
    if not path.is_file():
        return {}
    files = json.loads(path.read_text())["files"]
    return {f: sorted(d["missing_lines"]) for f, d in files.items()}


def _ranges(lines: list[int]) -> str:
    out: list[str] = []
    for n in lines:
        if out and int(out[-1].split("-")[-1]) == n - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def render(
    mutants: list[Mutant],
    stale: list[dict[str, str]],
    seconds: dict[str, int],
    uncovered: dict[str, list[int]],
    selections: dict[str, list[str]] | None = None,
    since: dict[str, tuple[str, int]] | None = None,
) -> str:
    files = sorted({m.file for m in mutants})
    total = len(mutants)
    done = sum(m.killed for m in mutants)
    by_rerun = sum(m.killed and m.status not in DETECTED for m in mutants)
    rerun_note = (
        f" ({by_rerun} of them survived the run and were killed by a rerun of its survivors "
        "with the tests added since)"
        if any(m.rerun is not None for m in mutants)
        else ""
    )
    lines = [
        "# Mutation testing",
        "",
        f"Generated by `bash scripts/mutation.sh` (mutmut) on {date.today().isoformat()}; "
        "do not edit by hand. The score is mutants killed over mutants generated; mutmut "
        "mutates only the lines a group's tests execute (the last section lists the others). "
        "Each mutant no test kills is listed with why, from "
        "`scripts/mutation_survivors.toml`: an equivalent mutant (no observable change), "
        "one whose change shows only on a CUDA device or on a map of 2 or more DP ranks, "
        "which the in-process suite does not build, or one a test added after the run kills.",
        "",
        f"**Score: {done}/{total} mutants killed ({100 * done / max(total, 1):.1f}%)"
        f"{rerun_note}.**",
        "",
    ]
    if since:
        of = "; ".join(
            f"`{f}` since `{rev}` ({n} generated)" for f, (rev, n) in sorted(since.items())
        )
        lines += [
            "Incremental files: only the mutants on lines changed since their last full run's "
            f"revision ran and count here ({of}); their lines unchanged since keep that "
            "revision's report.",
            "",
        ]
    lines += [
        "| file | mutants | killed | killed by the rerun | survived | explained | other |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for f in files:
        ms = [m for m in mutants if m.file == f]
        killed = sum(m.status in DETECTED for m in ms)
        later = sum(m.killed for m in ms) - killed
        survived = sum(not m.killed and m.status in ("survived", TIMED_OUT) for m in ms)
        why = sum(m.why is not None and not m.killed for m in ms)
        other = len(ms) - killed - later - survived
        lines.append(f"| `{f}` | {len(ms)} | {killed} | {later} | {survived} | {why} | {other} |")
    if seconds:
        lines += ["", "Run time: " + ", ".join(f"{g} {s}s" for g, s in seconds.items()) + "."]
    if selections:
        lines += [
            "",
            "Test selection per group: an fm_jax mutant runs all of its group's, until the first "
            "failure; an fm_torch mutant, those of its group's that call the mutated method.",
            "",
            "| group | tests |",
            "| --- | --- |",
        ]
        lines += [f"| {g} | {', '.join(f'`{t}`' for t in ts)} |" for g, ts in selections.items()]
    left = [m for m in mutants if not m.killed]
    lines += ["", "## Mutants no test killed", ""]
    if not left:
        lines.append("None.")
    for m in sorted(left, key=lambda m: (m.file, m.line)):
        lines.append(f"- `{m.file}:{m.line}` ({m.status}): {_md(m.before)} -> {_md(m.after)}")
        lines.append(f"  - {m.why}" if m.why else "  - **not explained**")
    later = [m for m in mutants if m.killed and m.status not in DETECTED]
    if later:
        lines += [
            "",
            "## Survivors of the run killed by the rerun",
            "",
            "mutmut ran these again, in a copy of the run with today's tests, and the tests "
            "failed on each. Each with the test added for it (`[[killed]]` in the survivors "
            "file), where one is listed.",
            "",
        ]
        for m in sorted(later, key=lambda m: (m.file, m.line)):
            lines.append(f"- `{m.file}:{m.line}`: {_md(m.before)} -> {_md(m.after)}")
            if m.why and m.why.startswith("Killed by"):
                lines.append(f"  - {m.why}")
            elif m.why:  # entries match by text: the same mutation of a twin line elsewhere
                lines.append(
                    "  - its text matches an `[[equivalent]]` entry, written for the same "
                    "mutation of a line with the same text elsewhere; here a test kills it"
                )
    slow = [m for m in mutants if m.status == "timeout"]
    if slow:
        lines += [
            "",
            "## Mutants killed by a timeout (counted as killed)",
            "",
            "mutmut stopped their test run at its time limit and counts them as killed; run "
            "by hand (MUTANT_UNDER_TEST set, pytest in the snapshot's mutants/), the group's "
            "tests fail on them (those seen so far break every map, at collection).",
            "",
        ]
        lines += [
            f"- `{m.file}:{m.line}`: {_md(m.before)} -> {_md(m.after)}"
            for m in sorted(slow, key=lambda m: (m.file, m.line))
        ]
    if uncovered:
        lines += [
            "",
            "## Lines no test of the group executes (not mutated)",
            "",
            "mutmut mutates only the lines that the group's tests run. These are the others: "
            "accelerator-only branches (this suite runs on CPU) and paths that only a map of "
            "2 or more DP ranks takes (the 8-device subprocess tests reach them; mutmut cannot "
            "see into a subprocess).",
            "",
        ]
        lines += [f"- `{f}`: {_ranges(ls) or 'none'}" for f, ls in sorted(uncovered.items())]
    if stale:
        lines += ["", "## Listed explanations that matched no survivor (stale)", ""]
        lines += [f"- `{e['file']}`: {_md(e['before'])} -> {_md(e['after'])}" for e in stale]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--survivors", type=Path, required=True)
    p.add_argument("--output", type=Path, help="the report (required unless --list-changed)")
    p.add_argument(
        "--rerun",
        type=Path,
        action="append",
        default=[],
        help="a copy of RUN_DIR/GROUP in which mutmut reran the survivors (GROUP-rerun)",
    )
    p.add_argument(
        "--list-changed",
        action="store_true",
        help="print the names of the mutants on changed lines of runs with a `since` file",
    )
    p.add_argument("runs", type=Path, nargs="+")
    args = p.parse_args(argv)
    mutants: list[Mutant] = []
    seconds: dict[str, int] = {}
    since: dict[str, tuple[str, int]] = {}  # incremental files: revision, mutants generated
    changed: dict[str, tuple[set[int], set[str]]] = {}  # and their changed lines and texts
    for run in args.runs:
        run = run.resolve()
        if not (run / "mutants").is_dir():
            print(f"{run}: no mutmut results", file=sys.stderr)
            return 1
        rev = (run / "since").read_text().strip() if (run / "since").is_file() else None
        of_run = _mutants_of(run, every_line=rev is not None)
        if rev is not None:
            for f in {m.file for m in of_run} | set(_uncovered(run)):
                lines = changed_since(rev, run, f)
                text = (run / f).read_text().splitlines()
                changed[f] = (lines, {text[i - 1].strip() for i in lines})
                since[f] = (rev, sum(m.file == f for m in of_run))
            of_run = [m for m in of_run if m.line in changed[m.file][0]]
        mutants += of_run
        if (run / "seconds").is_file():
            seconds[run.name] = int((run / "seconds").read_text())
    if args.list_changed:
        print("\n".join(m.name for m in mutants))
        return 0
    if args.output is None:
        p.error("--output is required")
    stale = _explain(mutants, args.survivors)
    # An entry for a line of an incremental file unchanged since is not stale.
    stale = [
        e for e in stale if e["file"] not in changed or e["before"].strip() in changed[e["file"]][1]
    ]
    survivors = {m.name: m for m in mutants if m.status not in DETECTED}
    for rerun in args.rerun:
        for r in _mutants_of(rerun.resolve()):  # those it did not run read 'not checked'
            if r.name in survivors and r.status in (*DETECTED, "survived"):
                survivors[r.name].rerun = r.status
    uncovered: dict[str, list[int]] = {}
    selections: dict[str, list[str]] = {}
    for run in args.runs:
        run = run.resolve()
        for f, lines in _uncovered(run).items():
            keep = changed[f][0] if f in changed else set(lines)
            uncovered[f] = [n for n in lines if n in keep]
        config = tomllib.loads((run / "pyproject.toml").read_text())["tool"]["mutmut"]
        selections[run.name] = config["pytest_add_cli_args_test_selection"]
    args.output.write_text(render(mutants, stale, seconds, uncovered, selections, since))
    return 0


if __name__ == "__main__":
    sys.exit(main())
