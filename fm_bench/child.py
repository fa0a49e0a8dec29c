"""Run a Python child process and read the JSON report it prints on a marked stdout line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
"""The directory holding the fm_bench package (a checkout's root in a source tree): the
child's working directory, so that `python -c` and `-m` import the packages found beside
fm_bench, as this process does."""


class ChildFailed(RuntimeError):
    """A child process exited non-zero or printed no report line."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        super().__init__(f"child process failed (exit {returncode}):\n{stdout}\n{stderr}")
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def child_report(
    args: Sequence[str], env: Mapping[str, str], timeout: float, marker: str = "REPORT"
) -> Any:
    """Run `python ARGS` (this interpreter) in `ROOT` with environment `env`, and return the
    JSON that follows `marker` and a space on the last stdout line starting with them.

    Raises ChildFailed when the child exits non-zero or prints no such line, and
    subprocess.TimeoutExpired when it runs past `timeout` seconds.
    """
    p = subprocess.run(
        [sys.executable, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    prefix = marker + " "
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(prefix)]
    if p.returncode != 0 or not lines:
        raise ChildFailed(p.returncode, p.stdout, p.stderr)
    return json.loads(lines[-1][len(prefix) :])


def call_in_child(
    path: str | Path, fn: str, env: Mapping[str, str], timeout: float, args: Sequence[Any] = ()
) -> Any:
    """`fn(*args)` of the Python file `path`, called in a child as `child_report` runs it:
    the file is run with `runpy.run_path` (it need not be importable), `args` and the result
    travel as JSON."""
    code = (
        "import json, runpy; "
        f"out = runpy.run_path({str(path)!r})[{fn!r}](*json.loads({json.dumps(list(args))!r})); "
        "print('REPORT', json.dumps(out))"
    )
    return child_report(["-c", code], env, timeout)
