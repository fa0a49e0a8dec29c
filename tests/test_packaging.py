"""The package metadata in pyproject.toml: what `pip install fm-jax` asks of a user's environment.

scripts/check_wheel.sh checks the built wheel end to end (in .ci/run); these check the
declared ranges against released versions that users run, in the main suite.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RUNTIME = {Requirement(r).name: Requirement(r) for r in PROJECT["project"]["dependencies"]}
EXTRAS = PROJECT["project"]["optional-dependencies"]

# Released versions that users run and fm-jax must install beside without a downgrade: the CI
# machine's JAX and torch, the GPU machines' JAX 0.11.2 and torch 2.11, JAX 0.12.0.1 and
# torch 2.15 (PyPI's newest when these were written down), and torch's floor.
MUST_ADMIT = {
    "jax": ["0.10.2", "0.11.2", "0.12.0.1"],
    "jaxlib": ["0.10.2", "0.11.2", "0.12.0.1"],
    "torch": ["2.4.0", "2.11.0", "2.13.0", "2.15.0"],
}


def test_runtime_needs_only_jax_jaxlib_numpy():
    """Pins a test or tool package (chex, torch, ...) creeping into the runtime requirements."""
    assert sorted(RUNTIME) == ["jax", "jaxlib", "numpy"]
    assert all(req.marker is None for req in RUNTIME.values())


@pytest.mark.parametrize("name", sorted(MUST_ADMIT))
def test_requirements_admit_released_versions(name: str):
    """Pins an upper cap or exact pin that would make users of a current JAX or torch downgrade."""
    reqs = [RUNTIME[name]] if name in RUNTIME else [Requirement(r) for r in EXTRAS[name]]
    (req,) = [r for r in reqs if r.name == name]
    for version in MUST_ADMIT[name]:
        assert req.specifier.contains(version, prereleases=False), (str(req), version)


def test_chex_is_a_test_dependency():
    """chex is imported by tests only: it belongs to the test extra."""
    assert any(Requirement(r).name == "chex" for r in EXTRAS["test"])


@pytest.mark.parametrize("package", ["fm_jax", "fm_torch"])
def test_py_typed_is_shipped(package: str):
    """Pins losing the PEP 561 marker: type checkers would treat the package as untyped."""
    assert (ROOT / package / "py.typed").is_file()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"][package]
