#!/usr/bin/env bash
# Creates .venv (if missing) and installs fm-jax with every extra: torch CPU 2.13.0, jax, tools.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[dev]'
