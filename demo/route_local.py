"""A mixed deployment on this machine behind ``kvbridge route``, for the router's demo,
benchmark and tests.

SGLang's REAL server on CPU (``kvbridge.demo.sglang_server``): prefills and a decode on
the kvbridge backend, and an aggregated server (``--disaggregation-mode null``); the
TensorRT-LLM stand-in behind trtllm-serve's HTTP shape (``python -m
kvbridge.demo.trtllm.http``, its own process group) as a second decode; the router
(``kvbridge route --config route.yaml``, its own process, or in this process). Every
server can be killed and restarted by name; ``stop()`` ends them all, whatever happened.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LocalDeployment", "TrtProcess", "RouterProcess", "route_yaml"]

log = logging.getLogger(__name__)

# short peer timeouts: a dead prefill is noticed in seconds
SGLANG_ENV = {"KVBRIDGE_PEER_TIMEOUT_S": "3"}
TRT_PLUGIN = {"host": "127.0.0.1", "peer_timeout_s": 3.0, "discovery_timeout_s": 5.0, "deadline_s": 30.0,
              "on_failure": "fail"}


def _kill_group(proc: subprocess.Popen, grace_s: float = 3.0, hard: bool = False) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ([(signal.SIGKILL, 10.0)] if hard else [(signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)]):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass(eq=False)
class TrtProcess:
    """The TensorRT-LLM stand-in behind trtllm-serve's HTTP shape, in its own process group."""

    version: str
    model_dir: Path
    log_path: Path
    plugin: dict = field(default_factory=lambda: dict(TRT_PLUGIN))
    tokens_per_block: int = 32
    num_blocks: int = 128
    proc: subprocess.Popen | None = None
    url: str = ""
    bus: str = ""
    bootstrap: str = ""

    def start(self, timeout_s: float = 180.0) -> "TrtProcess":
        argv = [sys.executable, "-m", "kvbridge.demo.trtllm.http", "--version", self.version, "--model",
                str(self.model_dir), "--num-blocks", str(self.num_blocks), "--plugin", json.dumps(self.plugin),
                "--llm", json.dumps({"tokens_per_block": self.tokens_per_block})]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_f = open(self.log_path, "ab")
        env = dict(os.environ, MC_LOG_LEVEL="WARNING", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log_f, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        log_f.close()
        box: list = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout_s)
        if not box or not box[0]:
            self.kill()
            raise RuntimeError(f"TensorRT-LLM stand-in did not start in {timeout_s:.0f} s; log {self.log_path}:\n"
                               f"{_tail(self.log_path)}")
        info = json.loads(box[0])
        self.url, self.bus, self.bootstrap = info["url"], info["bus"], info["bootstrap"]
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, hard: bool = False) -> None:
        if self.proc is not None:
            _kill_group(self.proc, hard=hard)


@dataclass(eq=False)
class RouterProcess:
    """``kvbridge route --config FILE`` in its own process group."""

    config_path: Path
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> "RouterProcess":
        import urllib.error
        import urllib.request

        log_f = open(self.log_path, "ab")
        env = dict(os.environ, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli", "route", "--config", str(self.config_path),
                                      "--port", str(self.port)], stdout=log_f, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log_f.close()
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvbridge route exited with {self.proc.returncode}:\n{_tail(self.log_path)}")
            try:
                opener.open(self.url + "/health", timeout=2).read()
                return self
            except urllib.error.HTTPError:  # 503: up, some server not (yet) healthy
                return self
            except OSError:
                time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"kvbridge route did not answer within {timeout_s:.0f} s:\n{_tail(self.log_path)}")

    def kill(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)


def _tail(path: Path, n: int = 40) -> str:
    from .sglang_server import log_tail

    return log_tail(path, n)


def route_yaml(cfg: dict) -> str:
    """A configuration dict as route.yaml text."""
    import yaml

    return yaml.safe_dump(cfg, sort_keys=False)


class LocalDeployment:
    """``prefills`` SGLang prefills, an SGLang decode (``decode``), an SGLang aggregated
    server (``aggregated``) and a TensorRT-LLM decode stand-in (``trtllm``), started
    together; ``config`` is the route.yaml dict for them (``route`` entries override its
    sections). Servers are named p0, p1..., d0, t0 and a0."""

    def __init__(self, model_dir: str | os.PathLike, *, prefills: int = 2, decode: bool = True, aggregated: bool = True,
                 trtllm: bool = True, trtllm_version: str = "1.2", route: dict | None = None,
                 log_dir: str | os.PathLike | None = None, start_timeout: float | None = None,
                 sglang_env: dict | None = None, max_total_tokens: int = 4096):
        from .sglang_server import DEFAULT_START_TIMEOUT

        self.model_dir = Path(model_dir).resolve()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvbridge-route-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.timeout = start_timeout or DEFAULT_START_TIMEOUT
        self.env = {**SGLANG_ENV, **(sglang_env or {})}
        self.max_total_tokens = max_total_tokens
        self.roles = {f"p{i}": "prefill" for i in range(prefills)}
        if decode:
            self.roles["d0"] = "decode"
        if aggregated:
            self.roles["a0"] = "null"
        self.sglang: dict[str, Any] = {}  # name -> (Server, bootstrap port)
        self.trt: dict[str, TrtProcess] = {}
        self.router: RouterProcess | None = None
        self._route_overrides = route or {}
        self.started_s = 0.0
        t0 = time.monotonic()
        try:
            with ThreadPoolExecutor(len(self.roles) + 1) as ex:
                futs = {name: ex.submit(self._start_sglang, name) for name in self.roles}
                trt_fut = ex.submit(self._start_trt, "t0", trtllm_version) if trtllm else None
                for name, f in futs.items():
                    self.sglang[name] = f.result()
                if trt_fut is not None:
                    self.trt["t0"] = trt_fut.result()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0

    # -- servers ------------------------------------------------------------------------
    def _start_sglang(self, name: str):
        from .sglang_server import start_server

        return start_server(self.model_dir, self.roles[name], extra_env=self.env, log_dir=self.log_dir / name,
                            timeout=self.timeout, max_total_tokens=self.max_total_tokens)

    def _start_trt(self, name: str, version: str) -> TrtProcess:
        return TrtProcess(version, self.model_dir, self.log_dir / f"{name}.log").start()

    def kill(self, name: str, hard: bool = True) -> None:
        """Kill one server (SIGKILL by default: a crash)."""
        if name in self.sglang:
            self.sglang[name][0].kill(hard=hard)
        else:
            self.trt[name].kill(hard=hard)

    def restart(self, name: str) -> None:
        """Start a killed SGLang server again on the same ports (the router's file names them)."""
        from .sglang_server import wait_healthy

        srv = self.sglang[name][0]
        srv.kill()
        from .sglang_server import server_env

        env, _ = server_env("kvbridge", {"SGLANG_PLUGINS": "kvbridge", **self.env})
        srv.start(env)
        wait_healthy([srv], self.timeout, lambda: srv.log_tail(40))

    def alive(self) -> bool:
        return all(s.alive() for s, _ in self.sglang.values()) and all(t.alive() for t in self.trt.values())

    # -- the router ---------------------------------------------------------------------
    def config(self) -> dict:
        """route.yaml for these servers (as a dict)."""
        servers = []
        for name, (srv, boot) in self.sglang.items():
            role = {"prefill": "prefill", "decode": "decode", "null": "aggregated"}[self.roles[name]]
            s = {"name": name, "engine": "sglang", "role": role, "url": srv.url}
            if role == "prefill":
                s["bootstrap"] = f"127.0.0.1:{boot}"
            servers.append(s)
        for name, t in self.trt.items():
            servers.append({"name": name, "engine": "trtllm", "role": "decode", "url": t.url, "bus": t.bus})
        cfg: dict[str, Any] = {
            "model": {"name": "tiny-llama", "tokenizer": str(self.model_dir),
                      "chat_template": ("{% for m in messages %}{{ m['content'] }} {% endfor %}")},
            "listen": {"host": "127.0.0.1", "port": 0},
            "servers": servers,
            "links": {"default": "tcp"},
            # tokens/s given, not from FLOPs (a tiny model's FLOPs say "always recompute"): from 32 prompt
            # tokens on, moving wins on the tcp preset (kvbridge plan shows the numbers)
            "cost": {"prefill_tps": 20000.0, "decode_prefill_tps": 10000.0},
            "deadlines": {"request_s": 60.0, "prefill_s": 20.0},
            "retry": {"prefill_attempts": 2, "recompute": True},
            "limits": {"max_inflight": 64, "max_queue": 256, "retry_after_s": 1.0},
            "health": {"interval_s": 1.0, "timeout_s": 5.0, "fail_after": 2, "pass_after": 1},
        }
        for k, v in self._route_overrides.items():
            cfg[k] = {**cfg[k], **v} if isinstance(cfg.get(k), dict) and isinstance(v, dict) else v
        return cfg

    def write_config(self, cfg: dict | None = None, name: str = "route.yaml") -> Path:
        path = self.log_dir / name
        path.write_text(route_yaml(cfg or self.config()))
        return path

    def start_router(self, cfg: dict | None = None) -> RouterProcess:
        """``kvbridge route --config`` for these servers, in its own process."""
        from .sglang_server import free_port

        path = self.write_config(cfg)
        self.router = RouterProcess(path, free_port(), self.log_dir / "route.log").start()
        return self.router

    def stop(self) -> None:
        """Every process this deployment started, killed (idempotent)."""
        if self.router is not None:
            self.router.kill()
        for t in self.trt.values():
            t.kill()
        for srv, _ in self.sglang.values():
            srv.kill()

    def __enter__(self) -> "LocalDeployment":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
