"""pytest plugin for scripts/mutation.sh: every test of a group covers every mutated function.

mutmut runs a mutant only with the tests that called the mutated function through its
trampoline while it collected stats. fm_jax's ops are bound by one call to `future_map`,
often at import or in a fixture that another test set up first, and run traced inside jit:
an executable another test traced runs without calling them, so most tests that run a
mutated op never call the trampoline themselves and would be left out (a false survivor).
While mutmut collects stats (MUTANT_UNDER_TEST=stats), this plugin records a hit of every
trampolined function of the module named by FM_MUTATION_MODULE for every test: each mutant
then runs the group's whole test selection, stopping at its first failure.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

TRAMPOLINE_SUFFIX = "__mutmut_orig"


def _trampolined(module_name: str) -> list[str]:
    """The qualified names mutmut records for the mutated functions and methods of a module."""
    module = importlib.import_module(module_name)
    names = []
    for scope in [vars(module)] + [vars(c) for c in vars(module).values() if isinstance(c, type)]:
        for name in scope:
            if name.endswith(TRAMPOLINE_SUFFIX):
                names.append(f"{module_name}.{name.removesuffix(TRAMPOLINE_SUFFIX)}")
    return names


def pytest_runtest_setup(item: Any) -> None:
    from mutmut.mutation.trampoline import get_mutant_under_test
    from mutmut.stats import record_trampoline_hit

    module_name = os.environ.get("FM_MUTATION_MODULE")
    if not module_name or get_mutant_under_test() != "stats":
        return

    for name in _trampolined(module_name):
        record_trampoline_hit(name)
