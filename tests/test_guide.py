"""docs/guide.md's examples run as written, and print what their comments say.

Every ```python block of the guide runs in one child process (8 host CPU devices, for the
mesh example), each block in a fresh namespace. A `print(...)  # value` line is checked:
what it prints must equal the comment, so an example whose API or result drifts fails
here. A comment that is prose (it does not look like a printed value) is not checked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
PRINT = re.compile(r"^(\s*)print\((.*)\)\s*#\s*(.+?)\s*$")
VALUE = re.compile(r"^(\[|\(|-?\d|None\b|True\b|False\b)")

RUNNER = r"""
import contextlib, io, json, sys, traceback

def expect(want, *args):
    got = " ".join(str(a) for a in args)
    if got != want:
        raise AssertionError(f"printed {got!r}, the guide says {want!r}")

out = []
for source in json.loads(sys.stdin.read()):
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(source, "guide-block", "exec"), {"__name__": "guide", "expect": expect})
        out.append(None)
    except BaseException:
        out.append(traceback.format_exc(limit=3))
print(json.dumps(out))
"""


def checked(source: str) -> tuple[str, int]:
    """`source` with each `print(...)  # value` line made a check; and how many."""
    lines, n = [], 0
    for line in source.splitlines():
        m = PRINT.match(line)
        if m and VALUE.match(m.group(3)):
            line = f"{m.group(1)}expect({m.group(3)!r}, {m.group(2)})"
            n += 1
        lines.append(line)
    return "\n".join(lines) + "\n", n


BLOCKS = [checked(b) for b in BLOCK.findall(GUIDE.read_text())]


@pytest.fixture(scope="module")
def failures() -> list[str | None]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([src for src, _ in BLOCKS]),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_guide_checks_printed_values() -> None:
    """The checks exist: most examples print a value their comment states."""
    assert len(BLOCKS) >= 10
    assert sum(n for _, n in BLOCKS) >= 15


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_guide_example_runs_and_prints_what_it_says(failures: list[str | None], i: int) -> None:
    """Block i of docs/guide.md runs, and each commented print gives its comment."""
    assert failures[i] is None, f"block {i}:\n{BLOCKS[i][0][:400]}\n{failures[i]}"


def test_a_wrong_comment_fails() -> None:
    """The check can fail: a print whose comment disagrees raises, naming both."""
    src, n = checked("print(1 + 1)  # 3\n")
    assert n == 1
    with pytest.raises(AssertionError, match="printed '2', the guide says '3'"):
        exec(compile(src, "t", "exec"), {"expect": _expect()})


def _expect():  # the runner's check, for the in-process test above
    ns: dict = {}
    exec(RUNNER.split("out = []")[0], ns)
    return ns["expect"]
