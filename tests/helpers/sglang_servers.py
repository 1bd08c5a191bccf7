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

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE_HOOKS = Path(__file__).resolve().parent / "server_hooks"  # its sitecustomize installs the probe and the hooks

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
    page_size: int  # the prefill's (and the decode's, unless decode_page_size says otherwise)
    bootstrap_port: int
    prefill: Server
    decode: Server
    log_dir: Path
    decode_page_size: int | None = None
    start_seconds: float | None = None
    stopped: bool = False
    timings: list[tuple[str, float]] = field(default_factory=list)
    extra: dict[str, Server] = field(default_factory=dict)  # more decode servers beside the pair
    _envs: dict = field(default_factory=dict, repr=False)
    _argv: tuple = field(default=(), repr=False)  # (python, extra_args, decode_args, max_total_tokens)
    probes: dict = field(default_factory=dict)  # role -> its folder, started with ``probe=True``
    _switch: Any = field(default=None, repr=False)

    def probe(self, role: str = "decode"):
        """SGLang's own pool and allocator of the ``role`` server (``sglang_probe.PoolProbe``)."""
        from tests.helpers.sglang_probe import PoolProbe

        if role not in self.probes:
            raise AssertionError(f"this pair was started without probe=True ({self.describe()})")
        return PoolProbe(self.probes[role])

    def switch(self):
        """The ``kvhelpers.FaultSwitch`` both servers' kvbridge transports obey (``probe=True``)."""
        from tests.helpers.kvhelpers import FaultSwitch

        if "faults" not in self.probes:
            raise AssertionError(f"this pair was started without probe=True ({self.describe()})")
        if self._switch is None:
            self._switch = FaultSwitch(self.probes["faults"])
        return self._switch

    # ---- lifecycle -------------------------------------------------------------------
    def alive(self) -> bool:
        return not self.stopped and self.prefill.alive() and self.decode.alive()

    def stop(self) -> None:
        """Kill every process group of the pair and of its extra decode servers (SIGKILL:
        a SIGTERM to the group makes SGLang's main process sit out a 5 s crash-diagnostics
        sleep, longer than ``Server.kill``'s grace, so it ends killed anyway). Idempotent."""
        self.stopped = True
        threads = [threading.Thread(target=s.kill, kwargs={"hard": True})
                   for s in (self.prefill, self.decode, *self.extra.values())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def kill_prefill(self, *, hard: bool = True) -> None:
        """For failure tests: kill the prefill server's process group (SIGKILL now, or SIGTERM first)."""
        self.prefill.kill(hard=hard)

    def add_decode(self, name: str, *, model_dir: str | os.PathLike | None = None, page_size: int | None = None,
                   args: Sequence[str] = (), timeout: float = DEFAULT_START_TIMEOUT) -> Server:
        """Start (once) another decode server ``name`` beside the pair: the decode's backend,
        environment and flags (``args`` added), optionally another model (of the same kind)
        or page size.
        Requests reach it through the pair's prefill with ``generate_full(..., decode=it)``.
        Stopped with the pair."""
        srv = self.extra.get(name)
        if srv is not None and srv.alive():
            return srv
        python, extra_args, decode_args, max_total = self._argv
        model = Path(model_dir).resolve() if model_dir is not None else self.model_dir
        if is_mla_model(model) != is_mla_model(self.model_dir):
            raise ValueError("an extra decode server serves a model of the pair's kind (MLA or not): same environment")
        env = dict(self._envs["decode"])
        env.pop("KVBRIDGE_TEST_SGLANG_PROBE", None)  # the pair's decode alone reports to its probe
        ps = page_size if page_size is not None else (self.decode_page_size or self.page_size)
        for attempt in range(3):
            port, nccl = free_ports(2)
            argv = server_argv(python, model, "decode", self.backend, port, nccl, self.bootstrap_port, ps, max_total,
                               [*extra_args, *decode_args, *args])
            srv = Server(role="decode", port=port, argv=argv, env_delta=self.decode.env_delta,
                         log_path=self.log_dir / f"decode-{name}.log")
            srv.start(env)
            self.extra[name] = srv
            try:
                wait_healthy([srv], timeout, lambda: f"{srv.command_line()}\n{srv.log_tail(60)}")
                return srv
            except PortInUse:
                srv.kill()
                if attempt == 2:
                    raise
            except BaseException:
                srv.kill()
                raise
        raise AssertionError("unreachable")

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
        decode: Server | None = None,
    ) -> GenerateResult:
        """POST the same request to the prefill and the decode server (the pair's, or
        ``decode``) at once; raise ServerError on any failure."""
        if self.stopped:
            raise ServerError("pair was stopped")
        body = self.request_body(input_ids, max_new_tokens, room=room, sampling_params=sampling_params)
        t0 = time.monotonic()
        res_p, res_d = self.post_both(body, timeout, decode=decode)
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

    def post_both(self, body: dict, timeout: float = 120.0, *, decode: Server | None = None) -> tuple:
        """POST ``body`` to the prefill's and a decode server's ``/generate`` at once; the two
        responses (or the exceptions), nothing checked."""
        with ThreadPoolExecutor(2, thread_name_prefix="sglang-pair") as ex:
            fut_p = ex.submit(post_json, self.prefill.url + "/generate", body, timeout)
            fut_d = ex.submit(post_json, (decode or self.decode).url + "/generate", body, timeout)
            return fut_p.result(), fut_d.result()

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        *,
        room: int | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float = 120.0,
        decode: Server | None = None,
    ) -> list[int]:
        """Greedy (temperature 0, ignore_eos) generation through the pair (or its prefill and
        ``decode``): the decode server's output ids."""
        return self.generate_full(
            input_ids, max_new_tokens, room=room, sampling_params=sampling_params, timeout=timeout, decode=decode
        ).output_ids


def start_pair(
    model_dir: str | os.PathLike,
    backend: str,
    *,
    page_size: int = 1,
    decode_page_size: int | None = None,
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
    probe: bool = False,
) -> Pair:
    """Start a prefill and a decode server for ``model_dir`` and wait until both are healthy.

    ``backend`` is passed as ``--disaggregation-transfer-backend`` to both; ``page_size``
    as ``--page-size`` to both, unless ``decode_page_size`` gives the decode its own.
    ``extra_env``/``extra_args`` go to both servers, ``prefill_*``/``decode_*`` to one.
    ``probe``: both servers report SGLang's own pool and allocator (``Pair.probe``) and their
    kvbridge transports obey one fault switch (``Pair.switch``).
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
            model_dir, backend, page_size, decode_page_size, extra_env, extra_args, prefill_args, decode_args,
            prefill_env, decode_env, max_total_tokens, log_dir, python, probe,
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
    model_dir, backend, page_size, decode_page_size, extra_env, extra_args, prefill_args, decode_args,
    prefill_env, decode_env, max_total_tokens, log_dir, python, probe=False,
) -> Pair:  # fmt: skip
    p_port, p_nccl, d_port, d_nccl, boot = free_ports(5)
    mla = is_mla_model(model_dir)
    servers, envs, probes = [], {}, {}
    for role, port, nccl, role_args, role_env, ps in (
        ("prefill", p_port, p_nccl, prefill_args, prefill_env, page_size),
        ("decode", d_port, d_nccl, decode_args, decode_env, decode_page_size or page_size),
    ):
        role_env = {**(extra_env or {}), **(role_env or {})}
        if probe:
            probes[role], probes["faults"] = str(log_dir / f"probe-{role}"), str(log_dir / "faults")
            for folder in (probes[role], probes["faults"]):
                os.makedirs(folder, exist_ok=True)
            pp = role_env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")
            role_env = {**role_env, "KVBRIDGE_TEST_SGLANG_PROBE": probes[role], "KVBRIDGE_TEST_HOOKS_DIR": probes["faults"],
                        "PYTHONPATH": os.pathsep.join([str(PROBE_HOOKS), str(REPO_ROOT)] + ([pp] if pp else []))}
        env, delta = server_env(backend, role_env, mla=mla)
        argv = server_argv(
            python, model_dir, role, backend, port, nccl, boot, ps, max_total_tokens,
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
        decode_page_size=decode_page_size,
    )
    pair._envs = envs
    pair.probes = probes
    pair._argv = (python, tuple(extra_args), tuple(decode_args), max_total_tokens)
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
