#!/usr/bin/env bash
# The GPU-host checks in one go, one JSON line per check on stdout (what each checks:
# scripts/gpu_check.py). Within 10 minutes on one GPU. On a host without CUDA, or without an
# engine's GPU build, each check says why it was skipped; the exit status is non-zero only
# when a check that ran failed. Logs, env.json and results.jsonl go to --out (out/gpu_check).
# Usage: scripts/gpu_check.sh [--out DIR] [--only NAME,...]
#   PY                    the interpreter with kvbridge and SGLang (default .venv/bin/python)
#   KVBRIDGE_VLLM_PYTHON  the one with vLLM and kvbridge (default .venv-vllm/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "gpu_check: $PY not found: run 'make install' first (or set PY)" >&2; exit 2; }
export KVBRIDGE_VLLM_PYTHON=${KVBRIDGE_VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}
export PYTHONUNBUFFERED=1
exec timeout --kill-after=15 600 "$PY" scripts/gpu_check.py "$@"
