#!/usr/bin/env bash
# GPU-host checks; 1-3 finish in under 5 minutes on one H100/H200, 4 needs 2 GPUs and a few minutes more:
#   1. the CUDA-marked tests (gather/scatter on device tensors, through a zero-copy alias
#      of the pool's device memory, must give the CPU's bytes);
#   2. the layout benchmark, whose "cuda" section times the repack against a device copy;
#   3. the transfer benchmark (Mooncake; TCP unless the host has RDMA and the CUDA wheel);
#   4. SGLang's real servers on kvbridge, prefill TP 2 page 16 -> decode TP 1 page 64,
#      outputs compared with transformers (scripts/gpu_sglang_tp.py: needs 2 GPUs, SGLang's
#      CUDA kernels and a CUDA build of Mooncake; skipped with fewer GPUs). TP > 1 servers
#      cannot run on the CPU-only test machine;
#   5. where the real TensorRT-LLM imports: the connector contract (tests/trtllm/test_trtllm_contract.py).
# Usage: scripts/gpu_check.sh [OUT_DIR]   (OUT_DIR gets the JSON and the log)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check_out}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "run 'make install' first (or set PY)" >&2; exit 1; }
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
export PYTHONUNBUFFERED=1
timeout 120 "$PY" -m pytest -q -m cuda -p no:cacheprovider 2>&1 | tee "$OUT/cuda_tests.log"
timeout 90 "$PY" -m kvbridge.cli bench layout --json --repack-tokens 8192 | tee "$OUT/bench_layout.json"
timeout 90 "$PY" -m kvbridge.cli bench transfer --json --reps 2 --sweep 1024,4096 | tee "$OUT/bench_transfer.json"
timeout 900 "$PY" scripts/gpu_sglang_tp.py "$OUT" 2>&1 | tee "$OUT/gpu_sglang_tp.log"
if "$PY" -c "import tensorrt_llm" 2>/dev/null; then
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/trtllm/test_trtllm_contract.py -k real 2>&1 | tee "$OUT/trtllm_contract.log"
else
  echo "gpu_check: tensorrt_llm does not import here; TensorRT-LLM contract not checked" | tee "$OUT/trtllm_contract.log"
fi
echo "gpu_check: all done; results in $OUT"
