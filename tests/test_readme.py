"""The documentation's Python examples run as written and print what their comments promise.

Every ```python block of README.md and of every page in docs/ runs (docs/CONTRACT.md and
docs/mutation.md hold none; a block added to any page runs too). The README stays a front
door (at most 200 lines) and every relative link of these pages names a file and heading
that exist.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from host_devices import cpu_devices_env

ROOT = Path(__file__).resolve().parents[1]
README = "README.md"
PAGES = [README, *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
BLOCKS = {
    page: re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)
    for page in PAGES
}
CASES = [
    pytest.param(page, i, id=f"{page}:{i}") for page in PAGES for i in range(len(BLOCKS[page]))
]
MESH_DEVICES = 8  # the scale-out example builds a 4 x 2 mesh
README_MAX_LINES = 200


def _run(block: str, name: str) -> str:
    """Run one block: in-process, or in a child (with 8 virtual CPU devices) if it needs a
    mesh or turns on the process-wide persistent compilation cache."""
    if "make_mesh" not in block and "use_persistent_cache" not in block:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, name, "exec"), {})
        return out.getvalue()
    env = cpu_devices_env(MESH_DEVICES)
    proc = subprocess.run(
        [sys.executable, "-c", block], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize(("page", "index"), CASES)
def test_example_runs(page: str, index: int) -> None:
    """Pins documentation drift: an example that no longer runs against the current API."""
    block = BLOCKS[page][index]
    out = _run(block, f"{page}[python block {index}]")
    # A trailing '# [...]' comment on a print line is the expected output.
    for line in block.splitlines():
        m = re.match(r"\s*print\(.*\)\s+#\s*(\[.*)$", line)
        if m:
            assert m.group(1).strip() in out, (m.group(1), out)


def test_readme_has_examples() -> None:
    """Pins losing the front door's examples: the engine step and the class."""
    blocks = BLOCKS[README]
    assert len(blocks) >= 2
    assert any(".engine_step(" in b for b in blocks)
    assert any("fm_jax.FutureMap(" in b and ".finish(" in b for b in blocks)


def test_docs_have_examples() -> None:
    """Pins losing an entry point's example from docs/: the pure ops, the class, a mesh and
    fm_torch must each be shown."""
    blocks = [b for page in PAGES if page != README for b in BLOCKS[page]]
    for marker in ("fm_jax.future_map(", "fm_jax.FutureMap(", "make_mesh", "from fm_torch"):
        assert any(marker in b for b in blocks), marker


def test_readme_is_short() -> None:
    """Pins the README growing back into a notebook: measurements and guides live in docs/."""
    lines = len((ROOT / README).read_text().splitlines())
    assert lines <= README_MAX_LINES, lines


def _prose(text: str) -> str:
    """The page without its fenced blocks (code may hold '#' lines and brackets)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces '-'."""
    heads = re.findall(r"^#+\s+(.*)$", _prose(page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page: str) -> None:
    """Pins a broken link: a relative link must name a file that exists and, into a page, a
    heading it has."""
    here = ROOT / page
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(here.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        path, _, anchor = target.partition("#")
        dest = (here.parent / path).resolve() if path else here
        missing_heading = anchor and dest.suffix == ".md" and anchor not in _anchors(dest)
        if not dest.exists() or missing_heading:
            bad.append(target)
    assert not bad, bad
