#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the test suite on two worker
# processes (pytest-xdist; one file per worker at a time, so a file's module fixtures, the
# Gemma engines among them, are built once). FM_TEST_WORKERS=0 runs it in this process.
# The tests marked slow (end to end on the real Gemma model, the CLI's mutation sweep) are
# left out: FM_TEST_MARK= runs them too, FM_TEST_MARK=slow only them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One persistent compilation cache for the run, fresh and removed after it: the suite builds
# many maps and engines whose executables are equal, each compiled once instead of per map.
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
export JAX_COMPILATION_CACHE_DIR="$cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
mark="${FM_TEST_MARK-not slow}"
.venv/bin/python -m pytest -n "${FM_TEST_WORKERS:-2}" --dist loadfile ${mark:+-m "$mark"} "$@"
