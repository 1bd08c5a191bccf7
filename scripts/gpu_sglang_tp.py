"""GPU host: SGLang's REAL servers, prefill TP 2 -> decode TP 1, on kvbridge, pages 16 -> 64.

What this CPU-only machine cannot run: SGLang's CPU engine does not start a TP > 1 server
(NUMA binding assert; with SGLANG_CPU_OMP_THREADS_BIND set, a PyNccl communicator that
needs CUDA). kvbridge's head slicing between TP sizes is covered here by the two-process
tests with real pools (tests/sglang/test_sglang_backend.py); this script is the real-server run.

It builds the tiny Llama (2 layers, 2 KV heads: one per prefill rank), starts a prefill
server with --tp-size 2 --page-size 16 on GPUs 0 and 1 and a decode server with
--tp-size 1 --page-size 64 (GPU 2 if there is one, else GPU 0), both
--disaggregation-transfer-backend kvbridge, float32 with torch_native attention (the
numerics of the CPU tests), sends 8 concurrent requests whose prompts fill no page and
compares every greedy output with transformers' generate() on the CPU. Needs 2 GPUs,
SGLang's CUDA kernels (sgl_kernel) and a Mooncake transfer engine built with CUDA (it
reads and writes device memory); without 2 GPUs it says so and exits 0.

Usage: python scripts/gpu_sglang_tp.py [OUT_DIR]   (server logs and a JSON summary go there)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main(out: Path) -> int:
    import torch

    n_gpu = torch.cuda.device_count()
    if n_gpu < 2:
        print(f"gpu_sglang_tp: skipped: prefill TP 2 needs 2 GPUs, this host has {n_gpu}")
        return 0
    from kvbridge.demo.models import build_tiny_llama, random_prompt, reference_generate
    from kvbridge.demo.sglang_server import HOST, Server, ServerError, free_ports, generate_body, new_room, post_json, \
        wait_healthy

    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_llama(Path(tempfile.mkdtemp(prefix="kvbridge-tp-")) / "tiny_llama")
    p_port, p_nccl, d_port, d_nccl, boot = free_ports(5)
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update({"SGLANG_PLUGINS": "kvbridge", "SGLANG_HOST_IP": HOST, "MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "WARNING",
                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})

    def argv(role: str, port: int, nccl: int, tp: int, page: int) -> list[str]:
        a = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", HOST, "--port",
             str(port), "--nccl-port", str(nccl), "--tp-size", str(tp), "--page-size", str(page), "--dtype", "float32",
             "--attention-backend", "torch_native", "--disable-cuda-graph", "--max-total-tokens", "8192",
             "--mem-fraction-static", "0.2", "--disaggregation-mode", role, "--disaggregation-transfer-backend",
             "kvbridge"]
        return a + (["--disaggregation-bootstrap-port", str(boot)] if role == "prefill" else [])

    servers = [
        (Server("prefill", p_port, argv("prefill", p_port, p_nccl, 2, 16), {}, out / "prefill.log"), "0,1"),
        (Server("decode", d_port, argv("decode", d_port, d_nccl, 1, 64), {}, out / "decode.log"),
         "2" if n_gpu > 2 else "0"),
    ]
    try:
        for srv, gpus in servers:
            srv.env_delta = {"CUDA_VISIBLE_DEVICES": gpus, "SGLANG_PLUGINS": "kvbridge"}
            srv.start({**env, "CUDA_VISIBLE_DEVICES": gpus})
        wait_healthy([s for s, _ in servers], 600, lambda: "\n".join(s.log_tail(40) for s, _ in servers))
        prefill, decode = (s for s, _ in servers)
        prompts = [random_prompt(n, seed=2000 + n) for n in (5, 17, 37, 63, 90, 129, 200, 333)]
        refs = [reference_generate(model, p, 16).token_ids for p in prompts]

        def one(p):
            body = generate_body(p, 16, boot, new_room())
            with ThreadPoolExecutor(2) as ex:
                rp, rd = ex.map(lambda url: post_json(url + "/generate", body, 120), (prefill.url, decode.url))
            for role, r in (("prefill", rp), ("decode", rd)):
                if isinstance(r, BaseException) or r.status_code != 200:
                    raise ServerError(f"{len(p)}-token prompt: {role}: {getattr(r, 'text', r)!s:.500}")
            return rd.json()["output_ids"]

        t0 = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(one, prompts))
        dt = time.monotonic() - t0
        bad = [(len(p), o, r) for p, o, r in zip(prompts, outs, refs) if o != r]
        summary = {"case": "sglang prefill tp2 page16 -> decode tp1 page64, kvbridge", "requests": len(prompts),
                   "seconds": round(dt, 3), "mismatches": [{"prompt_len": n, "got": o, "want": r} for n, o, r in bad]}
        (out / "gpu_sglang_tp.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary))
        return 1 if bad else 0
    finally:
        for srv, _ in servers:
            srv.kill()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_check_out")))
