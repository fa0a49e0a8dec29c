#!/usr/bin/env bash
# Builds .venv-easydel: EasyDeL 0.3.0 with fm-jax and the integration (integrations/easydel),
# apart from .venv so that nothing in the main suite depends on EasyDeL. Idempotent.
#
# easydel 0.3.0 pins ejkernel==0.0.78, which needs jax 0.9; on this Python/JAX its declared
# requirements are installed with ejkernel==0.0.80.3 in its place, then easydel itself with
# --no-deps. It also imports pillow and torch without declaring them; torch is pinned to the
# CPU build (2.13.0 is a local CPU wheel here; unpinned, pip would fetch a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=.venv-easydel
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip >/dev/null
pip install -q packaging
pip install -q --no-deps easydel==0.3.0
# easydel's declared requirements, read from its installed metadata, ejkernel swapped.
reqs=$("$VENV/bin/python" - <<'PYEOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
out = []
for line in requires("easydel") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue  # an extra's requirement
    if r.name == "ejkernel":
        out.append("ejkernel==0.0.80.3")
    else:
        r.marker = None
        out.append(str(r))
print("\n".join(out))
PYEOF
)
echo "$reqs" > "$VENV/easydel-requirements.txt"
pip install -q -r "$VENV/easydel-requirements.txt" pillow torch==2.13.0
pip install -q -e . pytest
# the integration itself: --no-deps, as its easydel==0.3.0 requirement would pull ejkernel 0.0.78
pip install -q --no-deps -e integrations/easydel
"$VENV/bin/python" -c 'import importlib.metadata as m; print("easydel", m.version("easydel"), "ejkernel", m.version("ejkernel"), "jax", m.version("jax"), "torch", m.version("torch"))'
