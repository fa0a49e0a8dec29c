#!/usr/bin/env bash
# The EasyDeL integration's tests (integrations/easydel/tests), in .venv-easydel, apart from
# the main suite: sets the environment up if it is missing, runs pytest there, and writes
# the result to integrations/easydel/results/test_last.txt. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-easydel/bin/python ] || ! .venv-easydel/bin/python -c 'import fm_easydel' 2>/dev/null; then
  bash scripts/setup_easydel.sh
fi
export EASYDEL_AUTO=0 ENABLE_DISTRIBUTED_INIT=0
out=integrations/easydel/results/test_last.txt
mkdir -p "$(dirname "$out")"
start=$(date +%s)
set +e
(cd integrations/easydel && ../../.venv-easydel/bin/python -m pytest -p no:cacheprovider -rA "$@") 2>&1 \
  | grep -v 'Casting key/value\|Compiling \[' | tee "$out.tmp"
rc=${PIPESTATUS[0]}
set -e
# before "$out" is rewritten (the redirection below truncates it, which git would count)
dirty=$(git diff --quiet HEAD -- integrations scripts ':!'"$out" || echo ' + uncommitted changes')
{
  echo "# scripts/test_easydel.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD)$dirty, exit $rc, $(( $(date +%s) - start )) s"
  .venv-easydel/bin/python -c 'import importlib.metadata as m; print("# easydel", m.version("easydel"), "ejkernel", m.version("ejkernel"), "jax", m.version("jax"))'
  tail -n 40 "$out.tmp"
} > "$out"
rm -f "$out.tmp"
exit "$rc"
