"""Run SGLang 0.5.23's REAL server on CPU as a prefill/decode disaggregated pair.

Backend-agnostic: ``start_pair(model_dir, backend)`` passes ``backend`` to both
servers as ``--disaggregation-transfer-backend``; anything a backend needs
beyond that (``SGLANG_PLUGINS=...`` for an entry-point plugin, Mooncake knobs)
goes in ``extra_env`` / ``extra_args``.

Each server is ``python -m sglang.launch_server`` in its own process group
(``start_new_session``), logging to a file; ``Pair.stop()`` kills both groups
(SIGTERM, then SIGKILL). ``tests/sgl_shim`` (a pure-Python ``sgl_kernel``) is
put on ``PYTHONPATH`` of the servers only.

A request goes through the pair without a router: the same JSON (with
``bootstrap_host``/``bootstrap_port``/``bootstrap_room``) is POSTed to both
servers' ``/generate`` at once; prefill answers with one token, decode with the
whole output.

The machine has 2 cores and 24 GiB: ``shared_pair`` keeps at most one pair
alive (``KVBRIDGE_SGLANG_MAX_PAIRS``), starting a different one stops the old.
"""

from __future__ import annotations

import atexit
import collections
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import requests

HERE = Path(__file__).resolve().parent
SHIM_DIR = HERE / "sgl_shim"
# A test-only SGLang plugin that lets torch_native serve MLA models (see its docstring).
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


def _tail(path: Path, n: int = 60) -> str:
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
        return f"http://{HOST}:{self.port}"

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None  # leader of its own session

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        return _tail(self.log_path, n)

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


@dataclass
class GenerateResult:
    output_ids: list[int]
    decode_json: dict
    prefill_json: dict | None
    seconds: float


@dataclass(eq=False)
class Pair:
    """A started prefill server + decode server. Use ``start_pair`` to make one."""

    model_dir: Path
    backend: str
    page_size: int
    bootstrap_port: int
    prefill: Server
    decode: Server
    log_dir: Path
    start_seconds: float | None = None
    stopped: bool = False
    timings: list[tuple[str, float]] = field(default_factory=list)
    _envs: dict = field(default_factory=dict, repr=False)

    # ---- lifecycle -------------------------------------------------------------------
    def alive(self) -> bool:
        return not self.stopped and self.prefill.alive() and self.decode.alive()

    def stop(self) -> None:
        """Kill both process groups (SIGTERM, then SIGKILL). Idempotent."""
        self.stopped = True
        # Kill both concurrently: each may take its SIGTERM grace.
        threads = [threading.Thread(target=s.kill) for s in (self.prefill, self.decode)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def kill_prefill(self, *, hard: bool = True) -> None:
        """For failure tests: kill the prefill server's process group (SIGKILL now, or SIGTERM first)."""
        self.prefill.kill(hard=hard)

    def kill_decode(self, *, hard: bool = True) -> None:
        """For failure tests: kill the decode server's process group."""
        self.decode.kill(hard=hard)

    def __enter__(self) -> "Pair":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tails(self, n: int = 40) -> str:
        return (
            f"--- prefill log ({self.prefill.log_path}) ---\n{self.prefill.log_tail(n)}\n"
            f"--- decode log ({self.decode.log_path}) ---\n{self.decode.log_tail(n)}"
        )

    def describe(self) -> str:
        return (
            f"prefill: {self.prefill.command_line()}\n"
            f"decode:  {self.decode.command_line()}"
        )

    # ---- requests --------------------------------------------------------------------
    def request_body(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        *,
        room: int | None = None,
        sampling_params: Mapping[str, Any] | None = None,
    ) -> dict:
        sp = {"temperature": 0.0, "max_new_tokens": int(max_new_tokens), "ignore_eos": True}
        if sampling_params:
            sp.update(sampling_params)
        return {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": sp,
            "bootstrap_host": HOST,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": int(room) if room is not None else new_room(),
        }

    def generate_full(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        *,
        room: int | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float = 120.0,
    ) -> GenerateResult:
        """POST the same request to both servers at once; raise ServerError on any failure."""
        if self.stopped:
            raise ServerError("pair was stopped")
        body = self.request_body(input_ids, max_new_tokens, room=room, sampling_params=sampling_params)
        t0 = time.monotonic()
        with ThreadPoolExecutor(2, thread_name_prefix="sglang-pair") as ex:
            fut_p = ex.submit(_post, self.prefill.url + "/generate", body, timeout)
            fut_d = ex.submit(_post, self.decode.url + "/generate", body, timeout)
            res_p, res_d = fut_p.result(), fut_d.result()
        dt = time.monotonic() - t0
        self.timings.append((f"generate len={len(body['input_ids'])} new={max_new_tokens}", dt))
        problems = []
        for role, res in (("prefill", res_p), ("decode", res_d)):
            if isinstance(res, BaseException):
                problems.append(f"{role}: {type(res).__name__}: {res}")
            elif res.status_code != 200:
                problems.append(f"{role}: HTTP {res.status_code}: {res.text[:2000]}")
        if not problems:
            dj = res_d.json()
            fr = (dj.get("meta_info") or {}).get("finish_reason") or {}
            if isinstance(fr, dict) and fr.get("type") == "abort":
                problems.append(f"decode aborted: {json.dumps(fr)[:2000]}")
            elif "output_ids" not in dj:
                problems.append(f"decode answer has no output_ids: {json.dumps(dj)[:2000]}")
        if problems:
            raise ServerError(
                f"request (room {body['bootstrap_room']}, {len(body['input_ids'])} prompt tokens) "
                f"failed after {dt:.1f}s:\n  " + "\n  ".join(problems) + "\n" + self.log_tails()
            )
        pj = res_p.json() if not isinstance(res_p, BaseException) else None
        return GenerateResult(output_ids=list(dj["output_ids"]), decode_json=dj, prefill_json=pj, seconds=dt)

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        *,
        room: int | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float = 120.0,
    ) -> list[int]:
        """Greedy (temperature 0, ignore_eos) generation through the pair: the decode server's output ids."""
        return self.generate_full(
            input_ids, max_new_tokens, room=room, sampling_params=sampling_params, timeout=timeout
        ).output_ids


def new_room() -> int:
    """A random non-zero 62-bit bootstrap room (0 is SGLang's warm-up room)."""
    return secrets.randbits(62) or 1


def _session() -> requests.Session:
    http = requests.Session()
    http.trust_env = False  # never a proxy for 127.0.0.1
    return http


def _post(url: str, body: dict, timeout: float):
    try:
        with _session() as http:
            return http.post(url, json=body, timeout=timeout)
    except BaseException as e:  # returned, so both halves are always collected
        return e


def _server_argv(
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


def _server_env(
    backend: str, extra_env: Mapping[str, str] | None, *, mla: bool = False
) -> tuple[dict[str, str], dict[str, str]]:
    """(full environment, the part that differs from os.environ) for a server process."""
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


def start_pair(
    model_dir: str | os.PathLike,
    backend: str,
    *,
    page_size: int = 1,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    prefill_env: Mapping[str, str] | None = None,
    decode_env: Mapping[str, str] | None = None,
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS,
    log_dir: str | os.PathLike | None = None,
    timeout: float = DEFAULT_START_TIMEOUT,
    python: str | None = None,
    port_retries: int = 2,
) -> Pair:
    """Start a prefill and a decode server for ``model_dir`` and wait until both are healthy.

    ``backend`` is passed as ``--disaggregation-transfer-backend`` to both.
    ``extra_env``/``extra_args`` go to both servers, ``prefill_*``/``decode_*`` to one.
    Raises ServerError (with both log tails) if a server dies or is not healthy
    within ``timeout`` seconds; nothing is left running then. A start that lost a
    port race ("address already in use") is retried with new ports
    (``port_retries`` times).
    """
    model_dir = Path(model_dir).resolve()
    python = python or sys.executable
    if log_dir is None:
        log_dir = Path(tempfile.mkdtemp(prefix=f"sglang-{backend}-"))
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(port_retries + 1):
        pair = _make_pair(
            model_dir, backend, page_size, extra_env, extra_args, prefill_args, decode_args,
            prefill_env, decode_env, max_total_tokens, log_dir, python,
        )  # fmt: skip
        t0 = time.monotonic()
        try:
            for srv in (pair.prefill, pair.decode):
                srv.start(pair._envs[srv.role])
            _wait_healthy(pair, timeout)
        except _PortInUse:
            pair.stop()
            if attempt == port_retries:
                raise
            continue
        except BaseException:
            pair.stop()
            raise
        pair.start_seconds = time.monotonic() - t0
        return pair
    raise AssertionError("unreachable")


def _make_pair(
    model_dir, backend, page_size, extra_env, extra_args, prefill_args, decode_args,
    prefill_env, decode_env, max_total_tokens, log_dir, python,
) -> Pair:  # fmt: skip
    p_port, p_nccl, d_port, d_nccl, boot = free_ports(5)
    mla = is_mla_model(model_dir)
    servers, envs = [], {}
    for role, port, nccl, role_args, role_env in (
        ("prefill", p_port, p_nccl, prefill_args, prefill_env),
        ("decode", d_port, d_nccl, decode_args, decode_env),
    ):
        env, delta = _server_env(backend, {**(extra_env or {}), **(role_env or {})}, mla=mla)
        argv = _server_argv(
            python, model_dir, role, backend, port, nccl, boot, page_size, max_total_tokens,
            [*extra_args, *role_args],
        )  # fmt: skip
        servers.append(Server(role=role, port=port, argv=argv, env_delta=delta, log_path=log_dir / f"{role}.log"))
        envs[role] = env
    pair = Pair(
        model_dir=model_dir,
        backend=backend,
        page_size=page_size,
        bootstrap_port=boot,
        prefill=servers[0],
        decode=servers[1],
        log_dir=log_dir,
    )
    pair._envs = envs
    return pair


class _PortInUse(ServerError):
    pass


# Lines after which a starting server never becomes healthy (uvicorn, for one, logs a
# failed bind and then hangs in shutdown instead of exiting).
_FATAL_LOG_MARKERS = (
    "address already in use",
    "Scheduler hit an exception",
    "Initialization failed",
)


def _fatal_line(srv: Server) -> str | None:
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


def _wait_healthy(pair: Pair, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = [pair.prefill, pair.decode]
    while pending:
        for srv in list(pending):
            fatal = _fatal_line(srv)
            if fatal is not None:
                time.sleep(1.0)  # let the traceback reach the log
                cls = _PortInUse if "address already in use" in fatal else ServerError
                raise cls(
                    f"{srv.role} server failed while starting (backend {pair.backend}): {fatal}\n"
                    f"{pair.describe()}\n{pair.log_tails()}"
                )
            if not srv.alive():
                rc = srv.proc.poll() if srv.proc else None
                raise ServerError(
                    f"{srv.role} server exited with code {rc} before it was healthy "
                    f"(backend {pair.backend}).\n{pair.describe()}\n{pair.log_tails()}"
                )
            if srv.health(timeout=2.0):
                srv.ready_after_s = time.monotonic() - srv.started_at
                pending.remove(srv)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise ServerError(
                f"{', '.join(s.role for s in pending)} server(s) not healthy after {timeout:.0f}s "
                f"(backend {pair.backend}).\n{pair.describe()}\n{pair.log_tails()}"
            )
        time.sleep(0.5)


# ---- one shared pair per configuration, for session-wide reuse -----------------------

_SHARED: "collections.OrderedDict[tuple, Pair]" = collections.OrderedDict()
_SHARED_LOCK = threading.Lock()


def _key(model_dir, backend, kw) -> tuple:
    def freeze(v):
        if isinstance(v, Mapping):
            return tuple(sorted((k, freeze(x)) for k, x in v.items()))
        if isinstance(v, (list, tuple)):
            return tuple(freeze(x) for x in v)
        return v

    return (str(Path(model_dir).resolve()), backend, freeze({k: v for k, v in kw.items() if k not in ("timeout", "log_dir")}))


def shared_pair(model_dir: str | os.PathLike, backend: str, *, fresh: bool = False, **kw) -> Pair:
    """The session's pair for this configuration, started on first use.

    A pair that died or was killed (failure tests) is restarted; ``fresh=True``
    forces a restart. At most ``KVBRIDGE_SGLANG_MAX_PAIRS`` (default 1) pairs
    live at once: starting another stops the least recently used.
    """
    max_live = int(os.environ.get("KVBRIDGE_SGLANG_MAX_PAIRS", "1"))
    key = _key(model_dir, backend, kw)
    with _SHARED_LOCK:
        pair = _SHARED.get(key)
        if pair is not None and (fresh or not pair.alive()):
            pair.stop()
            del _SHARED[key]
            pair = None
        if pair is not None:
            _SHARED.move_to_end(key)
            return pair
        while len(_SHARED) >= max_live:
            _, old = _SHARED.popitem(last=False)
            old.stop()
        pair = start_pair(model_dir, backend, **kw)
        _SHARED[key] = pair
        return pair


def stop_shared() -> None:
    with _SHARED_LOCK:
        while _SHARED:
            _, pair = _SHARED.popitem()
            pair.stop()


@atexit.register
def _stop_everything() -> None:
    stop_shared()
    for srv in list(_LIVE_SERVERS):
        srv.kill(term_grace_s=2.0)
