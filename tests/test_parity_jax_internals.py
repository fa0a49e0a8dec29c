"""fm_parity's JAX internals: present on the installed JAX, and a clear error naming the
internal and the JAX version when one is missing (not a failure deep inside a run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fm_parity
from fm_parity import jax_internals
from fm_parity.transfers import no_device_to_host


def test_the_internals_are_present_on_this_jax() -> None:
    """The array class holds each read entry point the detector patches."""
    impl = jax_internals.array_impl()
    assert all(k in impl.__dict__ for k in jax_internals.ARRAY_READS)


def test_a_missing_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """An array class without one of the patched methods: JaxInternalsChanged names what is
    missing, the installed JAX version and the tested ones, also from the detector."""
    import jax

    class Plain:
        pass

    jax_internals.array_impl.cache_clear()
    monkeypatch.setattr(jax_internals.jnp, "zeros", lambda n: Plain())
    with pytest.raises(jax_internals.JaxInternalsChanged, match="copy_to_host_async") as err:
        jax_internals.array_impl()
    assert f"jax {jax.__version__}" in str(err.value) and jax_internals.TESTED in str(err.value)
    with (
        pytest.raises(jax_internals.JaxInternalsChanged, match="copy_to_host_async"),
        no_device_to_host(),
    ):
        pass
    monkeypatch.undo()
    jax_internals.array_impl.cache_clear()


def test_no_other_module_imports_jax_internals() -> None:
    """Pins: a `jax._src` import anywhere in fm_parity outside jax_internals.py, where a JAX
    upgrade that moves it would fail without naming it."""
    root = Path(fm_parity.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.name}: {n}" for n in names if n.split(".")[:2] == ["jax", "_src"]]
    assert all(f.startswith("jax_internals.py:") for f in found), found
