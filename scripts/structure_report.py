"""Print fm_jax's structure figures: lines, modules, import edges and the longest import
chain among its modules (`__init__`s left out of the chain), as the structure test reads
them (`tests/test_fm_jax_structure.py`: one import walk, used by both).

    .venv/bin/python scripts/structure_report.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

TEST = Path(__file__).resolve().parents[1] / "tests" / "test_fm_jax_structure.py"


def main() -> None:
    spec = importlib.util.spec_from_file_location("fm_jax_structure", TEST)
    assert spec is not None and spec.loader is not None
    structure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(structure)
    modules = structure._modules()
    code = {n: t for n, t in modules.items() if n.count(".") > 1}
    edges = sum(len(structure._imports(n, t, set(code))) for n, t in code.items())
    lines = {
        n: len(p.read_text().splitlines())
        for p in sorted(structure.PACKAGE.rglob("*.py"))
        for n in [".".join(p.relative_to(structure.PACKAGE.parent).with_suffix("").parts)]
    }
    longest = structure._longest_chain()
    print(f"lines (all .py): {sum(lines.values())}")
    print(f"code modules: {len(code)}; import edges among them: {edges}")
    route = " -> ".join(m.split(".", 1)[1] for m in longest)
    print(f"longest chain ({len(longest)} modules): {route}")
    for name in sorted(code, key=lambda n: -lines[n]):
        print(f"  {lines[name]:5d}  {name}")


if __name__ == "__main__":
    main()
