"""SGLang's REAL server on CPU as a prefill/decode disaggregated pair, for the tests.

The one-server pieces (argv, environment, ports, health, log tail, process-group kill)
are the library's: ``kvbridge.demo.sglang_server``, re-exported here. This module adds
the test harness: ``Pair`` (a prefill and a decode server), ``start_pair`` and the
session-wide ``shared_pair`` registry.

Backend-agnostic: ``start_pair(model_dir, backend)`` passes ``backend`` to both
servers as ``--disaggregation-transfer-backend``; anything a backend needs
beyond that (``SGLANG_PLUGINS=...`` for an entry-point plugin, Mooncake knobs)
goes in ``extra_env`` / ``extra_args``.

The machine has 2 cores and 24 GiB: ``shared_pair`` keeps at most one pair
alive (``KVBRIDGE_SGLANG_MAX_PAIRS``), starting a different one stops the old.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvbridge.demo.sglang_server import (  # noqa: F401  (re-exported for the tests)
    BACKEND_ENV,
    BASE_ENV,
    DEFAULT_MAX_TOTAL_TOKENS,
    DEFAULT_START_TIMEOUT,
    HOST,
    MLA_PLUGIN_DIR,
    MLA_PLUGIN_NAME,
    SHIM_DIR,
    PortInUse,
    Server,
    ServerError,
    fatal_line,
    generate_body,
    free_port,
    free_ports,
    is_mla_model,
    log_tail,
    new_room,
    post_json,
    server_argv,
    server_env,
    wait_healthy,
)

# the names these helpers had before they moved into the library
_post, _server_argv, _server_env, _fatal_line, _tail = post_json, server_argv, server_env, fatal_line, log_tail


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
        return generate_body(input_ids, max_new_tokens, self.bootstrap_port, room if room is not None else new_room(),
                             dict(sampling_params or {}))

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
            fut_p = ex.submit(post_json, self.prefill.url + "/generate", body, timeout)
            fut_d = ex.submit(post_json, self.decode.url + "/generate", body, timeout)
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
            wait_healthy([pair.prefill, pair.decode], timeout,
                         lambda: f"backend {pair.backend}\n{pair.describe()}\n{pair.log_tails()}")
        except PortInUse:
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
        env, delta = server_env(backend, {**(extra_env or {}), **(role_env or {})}, mla=mla)
        argv = server_argv(
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


atexit.register(stop_shared)
