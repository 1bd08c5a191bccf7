"""Run SGLang 0.5.23's REAL server (``python -m sglang.launch_server``) on CPU.

One server per call of ``start_server`` / ``sglang_server`` (the demo runs one; the
tests' ``Pair`` runs two from the same pieces): argv and environment for SGLang's CPU
path, free ports, health polling, the log tail, and a process-group kill.

Each server runs in its own process group (``start_new_session``) and logs to a file;
``Server.kill()`` ends the whole group (SIGTERM, then SIGKILL), and every server still
alive when the interpreter exits is killed too. The pure-Python ``sgl_kernel``
stand-in shipped beside this module (``sgl_shim/``) is put on the server's
``PYTHONPATH`` only (this process never imports it); for DeepSeek-style MLA models so
is ``sgl_shim/mla_torch_native``, an SGLang plugin that lets ``torch_native`` serve MLA.

A request reaches a disaggregated pair without a router: the same JSON (with
``bootstrap_host``/``bootstrap_port``/``bootstrap_room``) goes to the prefill's and the
decode's ``/generate`` at once; prefill answers with one token, decode with all.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import requests

from .secret import ensure_secret

HERE = Path(__file__).resolve().parent
SHIM_DIR = HERE / "sgl_shim"
# An SGLang plugin that lets torch_native serve MLA models (see its docstring).
MLA_PLUGIN_DIR = SHIM_DIR / "mla_torch_native"
MLA_PLUGIN_NAME = "kvbridge_tests_mla_torch_native"
HOST = "127.0.0.1"

# Environment every server gets (extra_env may override any of it).
BASE_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",  # else the scheduler imports vllm's rotary op
    "SGLANG_HOST_IP": HOST,  # else SGLang advertises the NIC address (ZMQ, bootstrap, Mooncake session)
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "false",  # else a CUDA event on a radix hit
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30",  # default 300 s: bad pairings fail in seconds
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "MC_FORCE_TCP": "1",  # Mooncake: TCP transport on 127.0.0.1 (no RDMA here)
    "MC_LOG_LEVEL": "WARNING",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# Per-backend additions to BASE_ENV (extra_env may override them).
BACKEND_ENV: dict[str, dict[str, str]] = {
    # Mooncake's sender sets supports_host_tensor_indices, and then SGLang's prefill
    # scheduler copies page ids into pinned memory and records a torch.cuda.Event
    # (prefill.py _send_kv_chunk): "Found no NVIDIA driver". With this switch it takes
    # the plain host path; at attention CP size 1 it changes nothing else.
    "mooncake": {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"},
}
# Variables of the test process that must not leak into a server.
DROP_ENV = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy")

DEFAULT_MAX_TOTAL_TOKENS = 4096
DEFAULT_START_TIMEOUT = float(os.environ.get("KVBRIDGE_SGLANG_START_TIMEOUT", "240"))


class ServerError(RuntimeError):
    """A server died, did not come up, or answered a request with an error."""


# Ports we hand to servers must not be ones somebody else picks while the servers
# start (~20-40 s): the kernel's ephemeral range (bind(0), ZMQ random ports, 32768+
# here), SGLang's own late-bound ports (get_free_port_below_ephemeral: 22000-29999)
# and Mooncake's listeners (15000-17000). So we draw from 17100-21999.
PORT_RANGE = tuple(int(x) for x in os.environ.get("KVBRIDGE_SGLANG_PORT_RANGE", "17100-21999").split("-"))


def _bindable(port: int) -> bool:
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port(exclude: Iterable[int] = ()) -> int:
    """A TCP port in PORT_RANGE that is free right now (not in ``exclude``)."""
    exclude = set(exclude)
    lo, hi = PORT_RANGE
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(lo, hi)
        if port not in exclude and _bindable(port):
            return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


def free_ports(n: int) -> list[int]:
    ports: list[int] = []
    for _ in range(n):
        ports.append(free_port(ports))
    return ports


def log_tail(path: Path, n: int = 60) -> str:
    """The last ``n`` lines of a log file (from its last 64 KiB)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError as e:
        return f"<no log: {e}>"
    return "\n".join(lines[-n:])


@dataclass(eq=False)
class Server:
    """One ``sglang.launch_server`` process group."""

    role: str  # "prefill" | "decode"
    port: int
    argv: list[str]
    env_delta: dict[str, str]  # what differs from the test process's environment
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None
    _log_start: int = 0  # where this start's lines begin in log_path (logs append)

    @property
    def url(self) -> str:
        """The server's HTTP address."""
        return f"http://{HOST}:{self.port}"

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None  # leader of its own session

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        return log_tail(self.log_path, n)

    def command_line(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env_delta.items()))
        return f"{env} {' '.join(self.argv)}"

    def start(self, env: Mapping[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self._log_start = log.tell()
        try:
            log.write(f"### {time.strftime('%H:%M:%S')} start: {self.command_line()}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() kills scheduler & co. too
                cwd=str(self.log_path.parent),
            )
        finally:
            log.close()
        self.started_at = time.monotonic()
        _LIVE_SERVERS.add(self)

    def kill(self, term_grace_s: float = 3.0, *, hard: bool = False) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``term_grace_s``.

        ``hard=True`` sends SIGKILL at once (a crash, for failure tests).
        """
        if self.proc is None:
            return
        pgid = self.proc.pid
        steps = [(signal.SIGKILL, 10.0)] if hard else [(signal.SIGTERM, term_grace_s), (signal.SIGKILL, 10.0)]
        for sig, wait_s in steps:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + wait_s
            while _group_alive(pgid) and time.monotonic() < deadline:
                self.proc.poll()  # reap the leader
                time.sleep(0.1)
            if not _group_alive(pgid):
                break
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)
        _LIVE_SERVERS.discard(self)

    def health(self, timeout: float = 2.0) -> bool:
        try:
            with _session() as http:
                return http.get(self.url + "/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) succeeds while zombies remain in the group; check for a live member.
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            stat = (pid_dir / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        # fields: state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


_LIVE_SERVERS: set[Server] = set()


def new_room() -> int:
    """A random non-zero 62-bit bootstrap room (0 is SGLang's warm-up room)."""
    return secrets.randbits(62) or 1


def _session() -> requests.Session:
    http = requests.Session()
    http.trust_env = False  # never a proxy for 127.0.0.1
    return http


def post_json(url: str, body: dict, timeout: float):
    """POST ``body``; the response, or the exception (returned, so concurrent halves are always collected)."""
    try:
        with _session() as http:
            return http.post(url, json=body, timeout=timeout)
    except BaseException as e:  # returned, so both halves are always collected
        return e


def generate_body(input_ids: Sequence[int], max_new_tokens: int, bootstrap_port: int, room: int,
                  sampling_params: dict | None = None) -> dict:
    """A disaggregated ``/generate`` request: greedy (temperature 0, ignore_eos) unless
    ``sampling_params`` says otherwise, naming the prefill's bootstrap server and the room."""
    sp = {"temperature": 0.0, "max_new_tokens": int(max_new_tokens), "ignore_eos": True, **(sampling_params or {})}
    return {"input_ids": [int(t) for t in input_ids], "sampling_params": sp, "bootstrap_host": HOST,
            "bootstrap_port": int(bootstrap_port), "bootstrap_room": int(room)}


def generate_output(res: Any, srv: "Server", what: str) -> dict:
    """The JSON of a ``/generate`` answer (``post_json``'s result) that has ``output_ids``;
    ServerError naming ``what``, with the server's log tail, for an exception, a non-200
    status, an abort or an answer without output."""
    where = f"\n--- {srv.log_path} ---\n{srv.log_tail(40)}"
    if isinstance(res, BaseException):
        raise ServerError(f"{what}: request failed: {type(res).__name__}: {res}{where}")
    if res.status_code != 200:
        raise ServerError(f"{what}: HTTP {res.status_code}: {res.text[:500]}{where}")
    out = res.json()
    fr = (out.get("meta_info") or {}).get("finish_reason")
    if "output_ids" not in out or (isinstance(fr, dict) and fr.get("type") == "abort"):
        raise ServerError(f"{what}: no output ({json.dumps(out)[:500]}){where}")
    return out


def server_argv(
    python: str,
    model_dir: Path,
    role: str,
    backend: str,
    port: int,
    nccl_port: int,
    bootstrap_port: int,
    page_size: int,
    max_total_tokens: int,
    extra_args: Sequence[str],
) -> list[str]:
    """The ``sglang.launch_server`` command line for one disaggregated server on CPU."""
    argv = [
        python, "-m", "sglang.launch_server",
        "--model-path", str(model_dir),
        "--host", HOST,
        "--port", str(port),
        "--nccl-port", str(nccl_port),
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--disable-cuda-graph",
        # An idle scheduler otherwise spins a core at 100%: two servers would take
        # both cores of this machine from the test process. It only sleeps when it
        # has no request at all (zmq poll, woken at once by a new one).
        "--sleep-on-idle",
        "--dtype", "float32",
        "--max-total-tokens", str(max_total_tokens),
        "--page-size", str(page_size),
        "--disaggregation-mode", role,
        "--disaggregation-transfer-backend", backend,
    ]  # fmt: skip
    if role == "prefill":
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    else:
        # The default pinned host pool for retraction backup calls CUDA.
        argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    argv += list(extra_args)
    return argv


def is_mla_model(model_dir: str | os.PathLike) -> bool:
    """Whether SGLang serves this model with multi-head latent attention (DeepSeek-style)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(cfg.get("kv_lora_rank")) and any("Deepseek" in a for a in cfg.get("architectures") or [])


def server_env(
    backend: str, extra_env: Mapping[str, str] | None, *, mla: bool = False
) -> tuple[dict[str, str], dict[str, str]]:
    """(full environment, the part that differs from os.environ) for a server process;
    every server started from this process shares its ``KVBRIDGE_SECRET`` (``ensure_secret``)."""
    ensure_secret()
    delta = dict(BASE_ENV)
    delta.update(BACKEND_ENV.get(backend, {}))
    if extra_env:
        delta.update({k: str(v) for k, v in extra_env.items()})
    # The sgl_kernel shim always comes first; a PYTHONPATH in extra_env is kept after it.
    pp = delta.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    front = [str(SHIM_DIR)] + ([str(MLA_PLUGIN_DIR)] if mla else [])
    delta["PYTHONPATH"] = os.pathsep.join(front + ([pp] if pp else []))
    if mla and delta.get("SGLANG_PLUGINS"):  # a whitelist must name our plugin too
        delta["SGLANG_PLUGINS"] += "," + MLA_PLUGIN_NAME
    env = {k: v for k, v in os.environ.items() if k not in DROP_ENV}
    env.update(delta)
    return env, delta


# Lines after which a starting server never becomes healthy (uvicorn, for one, logs a
# failed bind and then hangs in shutdown instead of exiting).
_FATAL_LOG_MARKERS = (
    "address already in use",
    "Scheduler hit an exception",
    "Initialization failed",
)


def fatal_line(srv: Server) -> str | None:
    """The first log line of this start after which the server never becomes healthy, if any."""
    try:
        with open(srv.log_path, "rb") as f:
            f.seek(srv._log_start)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        if any(m in line for m in _FATAL_LOG_MARKERS):
            return line.strip()
    return None


class PortInUse(ServerError):
    """A server lost a race for one of its ports (start again with new ports)."""


def wait_healthy(servers: Sequence[Server], timeout: float, details: Callable[[], str] = lambda: "") -> None:
    """Poll every server's ``/health`` until all answer 200. Raises ``PortInUse`` or
    ``ServerError`` (with ``details()``, e.g. the log tails) when one fails while
    starting, exits, or is not healthy within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for srv in list(pending):
            fatal = fatal_line(srv)
            if fatal is not None:
                time.sleep(1.0)  # let the traceback reach the log
                cls = PortInUse if "address already in use" in fatal else ServerError
                raise cls(f"{srv.role} server failed while starting: {fatal}\n{details()}")
            if not srv.alive():
                rc = srv.proc.poll() if srv.proc else None
                raise ServerError(f"{srv.role} server exited with code {rc} before it was healthy.\n{details()}")
            if srv.health(timeout=2.0):
                srv.ready_after_s = time.monotonic() - srv.started_at
                pending.remove(srv)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise ServerError(f"{', '.join(s.role for s in pending)} server(s) not healthy after {timeout:.0f}s.\n"
                              f"{details()}")
        time.sleep(0.5)


def healthy_or_retry(srv: Server, timeout: float, *, last_attempt: bool) -> bool:
    """Wait for a started ``srv`` to be healthy: True when it is; False (killed) when it
    lost a race for a port and another attempt with new ports may follow; any other
    failure (or a lost race on the last attempt) kills it and raises."""
    try:
        wait_healthy([srv], timeout, lambda: f"{srv.command_line()}\n--- {srv.log_path} ---\n{srv.log_tail(60)}")
    except PortInUse:
        srv.kill()
        if last_attempt:
            raise
        return False
    except BaseException:
        srv.kill()
        raise
    return True


def start_server(model_dir: str | os.PathLike, role: str, *, backend: str = "kvbridge",
                 extra_env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (), page_size: int = 1,
                 max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS, log_dir: str | os.PathLike | None = None,
                 timeout: float = DEFAULT_START_TIMEOUT, port_retries: int = 2) -> tuple[Server, int]:
    """Start one ``role`` ("prefill" | "decode" | "null": aggregated) server for ``model_dir`` with transfer
    backend ``backend`` and wait until it is healthy; returns (server, bootstrap port:
    the prefill's own bootstrap server, unused by a decode). On failure nothing is left
    running and ``ServerError`` carries the command line and the log tail; a lost port
    race is retried with new ports (``port_retries`` times)."""
    if role not in ("prefill", "decode", "null"):
        raise ValueError(f"role must be 'prefill', 'decode' or 'null' (aggregated), got {role!r}")
    model_dir = Path(model_dir).resolve()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"kvbridge-sglang-{role}-"))
    env_extra = {"SGLANG_PLUGINS": "kvbridge"} if backend == "kvbridge" else {}
    env_extra.update(extra_env or {})
    for attempt in range(port_retries + 1):
        port, nccl, boot = free_ports(3)
        env, delta = server_env(backend, env_extra, mla=is_mla_model(model_dir))
        argv = server_argv(sys.executable, model_dir, role, backend, port, nccl, boot, page_size, max_total_tokens,
                           list(extra_args))
        srv = Server(role=role, port=port, argv=argv, env_delta=delta, log_path=log_dir / f"{role}.log")
        srv.start(env)
        if healthy_or_retry(srv, timeout, last_attempt=attempt == port_retries):
            return srv, boot
    raise AssertionError("unreachable")


@contextlib.contextmanager
def sglang_server(model_dir, role: str, **kw) -> Iterator[tuple[Server, int]]:
    """``start_server`` as a context manager: yields (server, bootstrap port); the
    server's process group is killed on exit, whatever ends the block (Ctrl-C too)."""
    srv, boot = start_server(model_dir, role, **kw)
    try:
        yield srv, boot
    finally:
        srv.kill()


@atexit.register
def _kill_live_servers() -> None:
    for srv in list(_LIVE_SERVERS):
        srv.kill(term_grace_s=2.0)
