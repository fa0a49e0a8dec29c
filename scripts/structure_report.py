"""Print fm_jax's structure figures: lines, modules, import edges and the longest import
chain among its modules (`__init__`s left out of the chain), read with `ast`.

    .venv/bin/python scripts/structure_report.py
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fm_jax"


def _graph() -> tuple[dict[str, set[str]], dict[str, int]]:
    trees, lines = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        text = path.read_text()
        lines[name] = len(text.splitlines())
        trees[name] = ast.parse(text)
    names = set(trees)
    graph = {}
    for name, tree in trees.items():
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    out.add(full if full in names else node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[name] = {m for m in out if m in names and m != name and m.count(".") > 1}
    return graph, lines


def main() -> None:
    graph, lines = _graph()
    code = {n: d for n, d in graph.items() if n.count(".") > 1}

    @functools.cache
    def chain(m: str) -> tuple[str, ...]:
        deps = [chain(d) for d in sorted(code.get(m, ()))]
        return (m, *max(deps, key=len, default=()))

    longest = max((chain(m) for m in code), key=len)
    print(f"lines (all .py): {sum(lines.values())}")
    print(f"code modules: {len(code)}; import edges among them: {sum(map(len, code.values()))}")
    route = " -> ".join(m.split(".", 1)[1] for m in longest)
    print(f"longest chain ({len(longest)} modules): {route}")
    for name in sorted(code, key=lambda n: -lines[n]):
        print(f"  {lines[name]:5d}  {name}")


if __name__ == "__main__":
    main()
