#!/usr/bin/env bash
# Builds fm-jax's sdist and wheel (`python -m build`: the wheel is built from the sdist), installs
# the wheel into a fresh virtual environment with its runtime dependencies only, checks that
# torch is absent there, and runs scripts/smoke_wheel.py in it from outside the checkout.
#
#   scripts/check_wheel.sh [--python PYTHON] [--with REQUIREMENT]...
#
# --python: the interpreter for the fresh environment (default python3).
# --with:   an extra requirement installed beside the wheel, e.g. --with 'jax==0.12.0.1'.
# The build runs with .venv's python (scripts/setup.sh installs `build`); pip reuses its cache.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
python=python3
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python=$2; shift 2 ;;
    --with) extra+=("$2"); shift 2 ;;
    *) echo "check_wheel.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

.venv/bin/python -m build --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 || {
  cat "$tmp/build.log" >&2
  exit 1
}
sdists=("$tmp"/dist/fm_jax-*.tar.gz)
wheels=("$tmp"/dist/fm_jax-*-py3-none-any.whl)
[ ${#sdists[@]} -eq 1 ] && [ -f "${sdists[0]}" ] || { echo "no single sdist built" >&2; exit 1; }
[ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || { echo "no single wheel built" >&2; exit 1; }
echo "built $(basename "${sdists[0]}") and $(basename "${wheels[0]}")"

# Every top-level name the wheel installs starts with fm_: nothing to shadow another
# distribution's import package (a `bench` or `parity` would).
.venv/bin/python - "${wheels[0]}" <<'PY'
import sys, zipfile
names = {n.split("/")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()}
bad = sorted(n for n in names if not n.startswith("fm_"))
if bad:
    sys.exit(f"the wheel installs top-level names that do not start with fm_: {bad}")
print("wheel top-level names:", sorted(names))
PY

"$python" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q "${wheels[0]}" ${extra[@]+"${extra[@]}"}
if "$tmp/venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "torch is importable in the wheel's environment; fm_jax must run without it" >&2
  exit 1
fi
cd "$tmp"  # so that the checkout's fm_jax cannot shadow the installed one
"$tmp/venv/bin/python" "$repo/scripts/smoke_wheel.py"
