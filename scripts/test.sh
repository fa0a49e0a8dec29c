#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on two worker
# processes (pytest-xdist; one file per worker at a time, so a file's module fixtures, the
# Gemma engines among them, are built once). FM_TEST_WORKERS=0 runs it in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -n "${FM_TEST_WORKERS:-2}" --dist loadfile "$@"
