"""The Gemma 3 270M weights for tests: skip a module, with the reason, when they are absent.

The `[model]` extra installs them (`gguf` and the weights package); `scripts/setup.sh`
installs it, so CI runs these tests. The first test run unpacks the GGUF into the cache
(`fm_serve.gemma.files`); later runs read the cache.
"""

from __future__ import annotations

import pytest

from fm_serve.gemma import files

MISSING_WEIGHTS = (
    "needs the Gemma 3 weights: the [model] extra (gguf and the weights package) is not "
    f"installed ({files.WEIGHTS_EXTRA})"
)


def require_weights() -> None:
    """Skip the calling test module unless the weights package and gguf import."""
    if not files.weights_installed():
        pytest.skip(MISSING_WEIGHTS, allow_module_level=True)
