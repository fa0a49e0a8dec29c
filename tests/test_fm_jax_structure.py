"""fm_jax's structure, held: no import circle among its modules, and no module reading
another class's private members (docs/CONTRACT.md's layering: placement, registry and
runtime are used through their public methods). Its tests follow the layers: a test file
tests the public API or one module, named after it.

Read from the source with `ast`; nothing is imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fm_jax"
TESTS = Path(__file__).resolve().parent
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The fm_jax modules `name` imports (a name imported from a package: its module)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules and m != name}


def test_no_import_circle_among_fm_jax_modules() -> None:
    """Pins a circle of imports (engine_step and future_map imported each other): every
    module below the package's face imports only modules that do not import it back."""
    modules = _modules()
    graph = {n: _imports(n, t, set(modules)) - {"fm_jax"} for n, t in modules.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circles.append(path[path.index(n) :] + [n])
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m != "fm_jax" and m not in state:
            visit(m)
    assert circles == []


def _own_privates(cls: ast.ClassDef) -> set[str]:
    """The private members a class defines: its methods, slots and `self._x` attributes."""
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ast.Store)
        ):
            names.add(node.attr)
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return {n for n in names if n.startswith("_")}


def _private_reads(tree: ast.Module) -> list[str]:
    """`x._name` reads where `x` is not self or cls, outside a class of its own defining
    `_name` (an instance reading another of its class, as `__eq__` does), NamedTuple's
    API aside."""
    found = []

    def walk(node: ast.AST, own: set[str]) -> None:
        if isinstance(node, ast.ClassDef):
            own = own | _own_privates(node)
        if isinstance(node, ast.Attribute):
            name = node.attr
            base = node.value
            private = name.startswith("_") and not name.startswith("__")
            mine = isinstance(base, ast.Name) and base.id in ("self", "cls")
            if private and not mine and name not in NAMEDTUPLE_API and name not in own:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            walk(child, own)

    walk(tree, set())
    return found


@pytest.mark.parametrize("module", sorted(_modules()))
def test_no_module_reads_another_class_private_members(module: str) -> None:
    """Pins a class reaching into another's private members (EngineStep read nine of
    FutureMap's): what crosses a class goes through public methods and attributes."""
    assert _private_reads(_modules()[module]) == []


MAX_LINES = 400


def test_no_fm_jax_module_over_400_lines() -> None:
    """Pins a module grown past one job (future_map.py held the ops, the host reads of
    lengths, MIXED tails and confidence, the state, the warm-up and the engine step in
    716 lines): each fm_jax module stays within MAX_LINES."""
    lines = {
        str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")
    }
    assert {m: n for m, n in sorted(lines.items()) if n > MAX_LINES} == {}


MAX_PACKAGE_LINES = 5707
"""A ratchet, lowered as the package shrinks; the target is 5,000 lines."""
MAX_IMPORT_CHAIN = 6
"""A ratchet on the longest chain of fm_jax modules importing one another (`__init__`s left
out); the target is 6."""


def test_the_package_stays_within_its_lines() -> None:
    """Pins fm_jax growing back: all its .py files together within MAX_PACKAGE_LINES."""
    total = sum(len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py"))
    assert total <= MAX_PACKAGE_LINES


def _longest_chain() -> list[str]:
    modules = _modules()
    graph = {n: _imports(n, t, set(modules)) for n, t in modules.items() if n.count(".") > 1}
    chains: dict[str, list[str]] = {}

    def chain(m: str) -> list[str]:
        if m not in chains:
            below = [chain(d) for d in sorted(graph[m]) if d in graph]
            chains[m] = [m, *max(below, key=len, default=[])]
        return chains[m]

    return max((chain(m) for m in sorted(graph)), key=len)


def test_imports_stay_within_their_depth() -> None:
    """Pins a new level of imports: the longest chain of modules importing one another
    holds at most MAX_IMPORT_CHAIN modules (a chain is what a reader follows to see what
    one call does)."""
    chain = _longest_chain()
    assert len(chain) <= MAX_IMPORT_CHAIN, " -> ".join(chain)


def _depths(modules: dict[str, ast.Module], prefix: str) -> dict[str, int]:
    """Each module under `prefix`'s depth among its own: 1 imports no other, else one more
    than the deepest it imports."""
    names = set(modules)
    inner = {
        n: {d for d in _imports(n, t, names) if d.startswith(prefix)} for n, t in modules.items()
    }
    depth: dict[str, int] = {}

    def of(m: str) -> int:
        if m not in depth:
            depth[m] = 1 + max((of(d) for d in inner[m]), default=0)
        return depth[m]

    return {n.removeprefix(prefix): of(n) for n in inner if n.startswith(prefix)}


OPS_DEPTH = {
    "errors": 1,
    "types": 1,
    "checks": 2,
    "protocol": 2,
    "relay_fields": 2,
    "rows": 2,
    "sharding": 2,
    "resolve": 3,
    "ops": 4,
}
"""A ratchet on the ops layer's inner depth: the exceptions and the declarations are leaves,
what the host path imports lies on them (depth 2), resolve above, the ops factory on top."""


def test_the_ops_layer_stays_within_its_depth() -> None:
    """Pins the ops layer deepening again (protocol -> relay_fields -> errors put three ops
    levels under the host path): each ops module within its depth in OPS_DEPTH, and every
    ops module the host path imports at most 2 deep."""
    modules = _modules()
    depth = _depths(modules, "fm_jax.ops.")
    depth.pop("", None)  # the sub-package's __init__
    assert {m: d for m, d in depth.items() if d > OPS_DEPTH.get(m, 0)} == {}
    host = {n: t for n, t in modules.items() if n.startswith("fm_jax.host.")}
    used = {d for n, t in host.items() for d in _imports(n, t, set(modules))}
    deep = {d: depth[d.removeprefix("fm_jax.ops.")] for d in used if d.startswith("fm_jax.ops.")}
    assert {d: n for d, n in deep.items() if n > 2} == {}


def test_the_ops_depth_ratchet_sees_a_new_level() -> None:
    """The control for the test above: a leaf importing a module above it is seen, and so
    is every module it deepens (types importing sharding: relay_fields then 3 deep)."""
    modules = dict(_modules())
    modules["fm_jax.ops.types"] = ast.parse("from fm_jax.ops.sharding import MeshLayout\n")
    depth = _depths(modules, "fm_jax.ops.")
    assert (depth["types"], depth["relay_fields"]) == (3, 4)
    assert depth["types"] > OPS_DEPTH["types"]


MAX_LAYER_DEPTH = {"host": 2, "map": 2}
"""Ratchets on the longest chain inside one layer: one module of host/ (map/) on top of
modules that import no other of their layer."""


@pytest.mark.parametrize("layer", sorted(MAX_LAYER_DEPTH))
def test_each_layer_stays_within_its_depth(layer: str) -> None:
    """Pins chains inside a layer (map.future_map -> map.runtime -> map.host_reads, and
    host.place -> host.host_inputs -> host.validate, were three deep): the modules of a
    layer a module imports are objects and functions passed in instead, so that the
    package's chain stays within MAX_IMPORT_CHAIN."""
    depth = _depths(_modules(), f"fm_jax.{layer}.")
    assert {m: d for m, d in sorted(depth.items()) if d > MAX_LAYER_DEPTH[layer]} == {}


LAYERS = ("ops", "host", "map")
"""fm_jax's sub-packages, lowest first: a module imports only from its own layer or below."""


def test_layers_import_one_way() -> None:
    """Pins an import that runs back up the layers (the pure ops reaching into the host path,
    or the host path into the map): map -> host -> ops, never the other way."""
    modules = _modules()
    back = []
    for name, tree in modules.items():
        parts = name.split(".")
        if len(parts) < 3:
            continue
        mine = LAYERS.index(parts[1])
        for dep in _imports(name, tree, set(modules)):
            dparts = dep.split(".")
            if len(dparts) >= 2 and dparts[1] in LAYERS and LAYERS.index(dparts[1]) > mine:
                back.append(f"{name} -> {dep}")
    assert back == []


def test_every_module_lives_in_a_layer() -> None:
    """Pins a module added beside the layers: below the package's face, every module is in
    ops/, host/ or map/."""
    names = [n for n in _modules() if n != "fm_jax"]
    assert [n for n in names if n.split(".")[1] not in LAYERS] == []


def _tests_internal_imports() -> dict[str, set[str]]:
    """Each tests/*.py file's imports of fm_jax modules below the package's face (anywhere
    in the file, a function's own imports included; `fm_jax` itself is the face)."""
    modules = set(_modules())
    return {
        path.name: _imports("fm_jax", ast.parse(path.read_text(), str(path)), modules)
        for path in sorted(TESTS.glob("*.py"))
    }


def test_a_test_file_imports_at_most_one_module_below_the_face() -> None:
    """Pins tests reaching past the module they test into its neighbours (a debug channel
    test building its layout with `ops.sharding`, a warm-up test asking `host.keys` and
    `ops.protocol`): a test file imports the public package and at most one internal
    module, the one it tests; what else it needs comes through the public API."""
    many = {f: sorted(m) for f, m in _tests_internal_imports().items() if len(m) > 1}
    assert many == {}


def test_a_test_file_of_an_internal_module_is_named_after_it() -> None:
    """Pins a module's tests scattered among files named for something else (`pack` tested
    in the engine step's file, `resolve_sizes` in the gather protocol's): a test file that
    imports one module below the face is tests/test_fm_jax_<module>.py."""
    misnamed = {
        f: f"test_fm_jax_{m.rsplit('.', 1)[-1]}.py"
        for f, ms in _tests_internal_imports().items()
        for m in ms
        if len(ms) == 1 and f != f"test_fm_jax_{m.rsplit('.', 1)[-1]}.py"
    }
    assert misnamed == {}


ROOT = PACKAGE.parent
FACE_USERS = ("fm_bench", "fm_serve", "fm_parity", "integrations/easydel")
"""The repository's packages built on fm_jax: each uses fm_jax through its public API only."""


def _public_names() -> set[str]:
    """The names fm_jax/__init__.py lists in `__all__`: the package's face."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    raise AssertionError("fm_jax/__init__.py has no __all__")


def _below_the_face(tree: ast.Module, public: set[str]) -> list[str]:
    """What `tree` takes from fm_jax past its face: an import of a module below it, a name
    imported from `fm_jax` that `__all__` does not list, or such a name read as an attribute
    of the imported package (`fj.ops.x`)."""
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fm_jax."):
                    found.append(f"line {node.lineno}: import {a.name}")
                elif a.name == "fm_jax":
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("fm_jax."):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            elif node.module == "fm_jax":
                found += [
                    f"line {node.lineno}: from fm_jax import {a.name}"
                    for a in node.names
                    if a.name not in public
                ]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr not in public
            and not node.attr.startswith("__")
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_below_the_face_finds_internal_imports() -> None:
    """The control for the test below: each way past the face is found, the face is not."""
    src = (
        "import fm_jax as fj\nimport fm_jax.ops.ops\nfrom fm_jax.host.packing import pack\n"
        "from fm_jax import FutureMap, host\nfj.FutureMap\nfj.map.future_map\n"
    )
    found = _below_the_face(ast.parse(src), _public_names())
    assert [f.split(":")[0] for f in found] == ["line 2", "line 3", "line 4", "line 6"]


@pytest.mark.parametrize("package", FACE_USERS)
def test_packages_use_fm_jax_through_its_face_only(package: str) -> None:
    """Pins a benchmark, the serving loop or parity reaching into fm_jax's internals
    (fm_bench's engine-step baseline packed with `fm_jax.host.packing`): they measure, serve
    and check the package a user installs, through the names `fm_jax.__all__` lists."""
    public = _public_names()
    found = {
        str(path.relative_to(ROOT)): hits
        for path in sorted((ROOT / package).rglob("*.py"))
        if (hits := _below_the_face(ast.parse(path.read_text(), str(path)), public))
    }
    assert found == {}
