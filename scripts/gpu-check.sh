#!/usr/bin/env bash
# make gpu-check: steadfast's GPU checks in one command (scripts/gpu_check.py says which).
#
# On a machine with no NVIDIA GPU it says so in one line and exits 0 (CI never needs it).
# On a bare GPU machine it sets up from the working tree what it needs, then checks:
#   - the Python whose torch uses the GPU: $GPU_PYTHON, else python3, else .venv's;
#   - steadfast from this tree (an editable install, no build isolation: nothing fetched);
#   - what that Python lacks of steadfast's dependencies and the tests': from .whl/ where
#     it is there (`make gpu-wheels` fills it here, for a machine that reaches no index),
#     else from the package index.
# Then it runs the checks (8 minutes at most on one GPU), prints one table and writes
# $GPU_CHECK_OUT (default gpu-check.json); its exit status is the checks'.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none): nothing to check"
  exit 0
fi

py=""
for candidate in "${GPU_PYTHON:-}" python3 .venv/bin/python; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 &&
    "$candidate" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    py=$candidate
    break
  fi
done
if [ -z "$py" ]; then
  echo "gpu-check: a GPU, but no Python here whose torch uses it: set GPU_PYTHON" >&2
  exit 1
fi

# what this Python lacks: module -> the package that brings it
missing=$("$py" - <<'PY'
import importlib.util
need = {"yaml": "pyyaml", "isal": "isal", "pynvml": "nvidia-ml-py",
        "prometheus_client": "prometheus-client", "pytest": "pytest",
        "pytest_timeout": "pytest-timeout", "numpy": "numpy", "setuptools": "setuptools"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
from_index=()
if [ -d .whl ]; then
  from_index=(--no-index --find-links .whl)
fi
if [ -n "$missing" ]; then
  echo "gpu-check: installing $missing"
  # shellcheck disable=SC2086  # one word per package
  "$py" -m pip install -q "${from_index[@]}" $missing
fi
if ! "$py" -c 'import steadfast, sys; sys.exit(not steadfast.__file__.startswith(sys.argv[1]))' \
  "$PWD/src" 2>/dev/null; then
  echo "gpu-check: installing steadfast from $PWD"
  "$py" -m pip install -q --no-deps --no-build-isolation "${from_index[@]}" -e .
fi

export GPU_CHECK_REV="${GPU_CHECK_REV:-$(git describe --always --dirty 2>/dev/null || echo unknown)}"
exec "$py" scripts/gpu_check.py --out "${GPU_CHECK_OUT:-gpu-check.json}" "$@"
