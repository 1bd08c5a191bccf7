"""Where the vLLM venv is, and the marker for tests that need it.

vLLM runs from a venv of its own (``.venv-vllm``, built by ``make``; its torch differs
from SGLang's), always in subprocesses: this test process never imports vLLM.
``KVBRIDGE_VLLM_PYTHON`` names another interpreter that has vLLM and kvbridge.
"""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "vllm_scripts"


def vllm_python() -> str | None:
    """The vLLM venv's interpreter, or None when there is none."""
    cand = os.environ.get("KVBRIDGE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return cand if os.access(cand, os.X_OK) else None


requires_vllm = pytest.mark.skipif(
    vllm_python() is None,
    reason=f"no vLLM venv ({ROOT / '.venv-vllm'} is absent; `make test` builds it, or set KVBRIDGE_VLLM_PYTHON)")


def run_script(name: str, *args: str, timeout: float = 300.0) -> dict:
    """Run tests/helpers/vllm_scripts/``name`` in the vLLM venv; its last stdout line is JSON."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    if os.environ.get("KVBRIDGE_VLLM_PYTHONPATH"):  # another copy of kvbridge to import there (the mutation harness's)
        env["PYTHONPATH"] = os.environ["KVBRIDGE_VLLM_PYTHONPATH"]
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING", MC_LOG_LEVEL="WARNING",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    out = subprocess.run([vllm_python(), str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=str(ROOT))
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise AssertionError(f"{name} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    return json.loads(lines[-1])


@contextmanager
def vllm_pair(model_dir: Path, log_dir: Path, **kwargs):
    """Two REAL vLLM servers of ``model_dir``, each prefill and decode (``kv_both``),
    started together (``start_vllm_server``'s ``kwargs``); killed on exit."""
    from kvbridge.demo.sglang_server import wait_healthy
    from kvbridge.demo.vllm_server import start_vllm_server

    servers = [start_vllm_server(model_dir, "kv_both", log_dir=log_dir, wait=False, **kwargs) for _ in range(2)]
    try:
        wait_healthy(servers, 400, lambda: "\n".join(f"--- {s.log_path} ---\n{s.log_tail(40)}" for s in servers))
        yield servers
    finally:
        for s in servers:
            s.kill()
