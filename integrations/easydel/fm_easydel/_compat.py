"""Import EasyDeL 0.3.0, the one version the patches are written against.

easydel 0.3.0's `__init__` asserts that ejkernel is 0.0.78, which needs jax 0.9. On jax 0.10
the integration runs it beside ejkernel 0.0.80.3 (scripts/setup_easydel.sh): while easydel
is first imported, ejkernel reports the version easydel asks for, and its real version is
restored as soon as the import returns. Any other easydel or ejkernel is refused by name.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import sys
from types import ModuleType

EASYDEL_VERSION = "0.3.0"
EJKERNEL_PINNED = "0.0.78"  # what easydel 0.3.0's __init__ asserts
EJKERNEL_ACCEPTED = ("0.0.78", "0.0.80.3")

# easydel reads these when it is imported: EASYDEL_AUTO=1 sets GPU-only XLA flags (the CPU
# backend aborts on them) and distributed init looks for a cluster.
REQUIRED_ENV = {"EASYDEL_AUTO": "0", "ENABLE_DISTRIBUTED_INIT": "0"}


class UnsupportedEasyDeL(ImportError):
    """The installed easydel (or ejkernel) is not the version the patches target."""


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions() -> None:
    """Refuse, by name and version, an easydel or ejkernel the integration was not built for."""
    ed = _installed("easydel")
    if ed != EASYDEL_VERSION:
        raise UnsupportedEasyDeL(
            f"fm_easydel patches easydel {EASYDEL_VERSION} only; "
            f"found easydel {ed or 'not installed'}"
            " (bash scripts/setup_easydel.sh builds the environment it runs in)"
        )
    ejk = _installed("ejkernel")
    if ejk not in EJKERNEL_ACCEPTED:
        raise UnsupportedEasyDeL(
            f"fm_easydel runs easydel {EASYDEL_VERSION} with ejkernel "
            f"{' or '.join(EJKERNEL_ACCEPTED)}; found ejkernel {ejk or 'not installed'}"
        )


def import_easydel() -> ModuleType:
    """easydel, imported once with the environment it needs on CPU and the ejkernel check met."""
    check_versions()
    if "easydel" in sys.modules:
        return sys.modules["easydel"]
    for key, value in REQUIRED_ENV.items():
        if os.environ.get(key, value) != value:
            raise UnsupportedEasyDeL(f"fm_easydel needs {key}={value} (found {os.environ[key]!r})")
        os.environ[key] = value
    ejkernel = importlib.import_module("ejkernel")
    real = ejkernel.__version__
    ejkernel.__version__ = EJKERNEL_PINNED
    try:
        easydel = importlib.import_module("easydel")
    finally:
        ejkernel.__version__ = real
    return easydel
