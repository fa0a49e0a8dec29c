"""The README's Python examples run as written and print what their comments promise."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    """Pins README drift: an example that no longer runs against the current API."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
    # Every '# a b c' trailing comment on a print line is the expected output.
    for line in BLOCKS[index].splitlines():
        m = re.match(r"\s*print\(.*\)\s+#\s*(\[.*)$", line)
        if m:
            assert m.group(1).strip() in out.getvalue(), (m.group(1), out.getvalue())


def test_readme_has_examples() -> None:
    """Pins losing the examples: the README must show fm_jax (pure ops and class) and fm_torch."""
    assert len(BLOCKS) >= 3
