"""The README's Python examples run as written and print what their comments promise."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from host_devices import cpu_devices_env

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
MESH_DEVICES = 8  # the scale-out example builds a 4 x 2 mesh


def _run(block: str, index: int) -> str:
    """Run one block: in-process, or in a child (with 8 virtual CPU devices) if it needs a
    mesh or turns on the process-wide persistent compilation cache."""
    if "make_mesh" not in block and "use_persistent_cache" not in block:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"README.md[python block {index}]", "exec"), {})
        return out.getvalue()
    env = cpu_devices_env(MESH_DEVICES)
    proc = subprocess.run(
        [sys.executable, "-c", block], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    """Pins README drift: an example that no longer runs against the current API."""
    out = _run(BLOCKS[index], index)
    # A trailing '# [...]' comment on a print line is the expected output.
    for line in BLOCKS[index].splitlines():
        m = re.match(r"\s*print\(.*\)\s+#\s*(\[.*)$", line)
        if m:
            assert m.group(1).strip() in out, (m.group(1), out)


def test_readme_has_examples() -> None:
    """Pins losing the examples: fm_jax (pure ops, class, mesh) and fm_torch must be shown."""
    assert len(BLOCKS) >= 4
