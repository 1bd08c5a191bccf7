"""A TensorRT-LLM "server" of the stand-in: one OS process per rank, driven in lockstep.

Each rank process puts the chosen version's ``tensorrt_llm`` import tree first on
``sys.path`` (``versions.site_dir``), so the plugin under test imports its base classes
from the module path that version has, then builds its executor with
``create_py_executor`` from LLM args as ``trtllm-serve`` would. The parent plays MPI
(every broadcast and allgather of the ranks is relayed through it, in the order the
ranks reach them) and rank 0's request queue (``submit``, ``cancel``).

Pools live in shared memory files, one per rank, so the ranks of one server can read each
other's heads (the model's tensor-parallel attention) and a test can read every rank's
pool as the engine lays it out (``pool``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener
from typing import Any, Callable, Iterable, Sequence

import torch

from .versions import VERSIONS, site_dir

__all__ = ["StandInServer", "StandInError", "run_until"]

logger = logging.getLogger(__name__)

_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class StandInError(RuntimeError):
    """A rank raised (the message carries its traceback), or did not answer in time."""


def _accept(listener: Listener, proc: subprocess.Popen, timeout: float):
    """The connection of the rank process ``proc`` (StandInError if it exits or does not
    connect within ``timeout`` s).

    A connection that fails the listener's handshake is dropped and the wait goes on: on a
    busy host another process can reach the port (a client still reconnecting to a port the
    OS has since handed out again), and the rank's own connection queues behind it."""
    import threading

    box: list = []
    stop = threading.Event()

    def accept() -> None:
        while not box and not stop.is_set():
            try:
                box.append(listener.accept())
            except (AuthenticationError, EOFError, OSError) as e:
                if not stop.is_set():
                    logger.warning("stand-in: dropped a connection that failed the handshake (%s: %s)",
                                   type(e).__name__, e)

    t = threading.Thread(target=accept, daemon=True, name="standin-accept")
    t.start()
    end = time.monotonic() + timeout
    try:
        while not box:
            t.join(0.2)
            if box:
                break
            if proc.poll() is not None:
                raise StandInError(f"rank process exited with {proc.returncode} before connecting")
            if time.monotonic() > end:
                proc.kill()
                raise StandInError(f"rank process did not connect within {timeout:.0f} s")
        return box[0]
    finally:
        stop.set()


def _rank_env(env: dict, mode: str, rank: int) -> dict:
    """Rank ``rank``'s environment under ``StandInServer``'s ``rank_env`` ``mode``."""
    if mode == "inherit" or (mode == "rank0" and rank == 0):
        return env
    return {k: v for k, v in env.items() if not k.startswith("KVBRIDGE_")}


class StandInServer:
    """The ranks of one stand-in TensorRT-LLM server.

    ``version``: "1.2" or "main". ``model``: a tiny model folder (Llama or DeepSeek-MLA).
    ``plugin``: kvbridge settings (``BridgeConfig`` names, given to every rank as
    ``KVBRIDGE_<NAME>``). Other keywords are LLM args (``make_llm_args``: ``tp``,
    ``tokens_per_block``, ``kv_dtype``, ``enable_block_reuse``, ``disable_overlap_scheduler``,
    ``attn_backend``, ``enable_flash_mla``, ``enable_chunked_prefill``, ``max_num_tokens``,
    ``capacity_scheduler_policy``, ``connector``...). ``setup``: ("module:function", arg)
    run first in every rank process (tests' fault hooks). ``kv_scales``: per layer, the fp8
    KV scale the model's attention backends hold (a checkpoint with calibrated scales;
    1.0 otherwise, as TensorRT-LLM keeps it). ``rank_env``: how the ranks get
    the ``KVBRIDGE_*`` variables of this process and ``plugin``: "inherit" (every rank, as
    under trtllm-serve on one host), "filtered" (none, as from an MPI pool that forwards
    only ``TRTLLM*``/``TLLM*`` variables), "rank0" (rank 0 only, as ranks ``mpirun``
    starts on other hosts without ``-x``)."""

    def __init__(self, version: str, model: str | os.PathLike, *, num_blocks: int = 64, plugin: dict | None = None,
                 setup: tuple | None = None, start_timeout: float = 120.0, rank_env: str = "inherit",
                 kv_scales: list[float] | None = None, **llm_kw: Any):
        if version not in VERSIONS:
            raise ValueError(f"unknown TensorRT-LLM version {version!r}; modelled: {sorted(VERSIONS)}")
        if rank_env not in ("inherit", "filtered", "rank0"):
            raise ValueError(f"rank_env must be 'inherit', 'filtered' or 'rank0', got {rank_env!r}")
        self.version = version
        tp = int(llm_kw.get("tp", 1))
        llm_kw = dict(llm_kw, model=str(model))
        tag = uuid.uuid4().hex[:12]
        self.pool_files = [os.path.join(_SHM, f"kvbridge-trt-{tag}-r{r}") for r in range(tp)]
        env = dict(os.environ, **{"KVBRIDGE_" + k.upper(): str(v) for k, v in (plugin or {}).items()})
        env.setdefault("MC_LOG_LEVEL", "WARNING")
        path = [str(site_dir(version))] + [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(path)
        authkey = secrets.token_bytes(16)
        self.ranks: list[tuple[Any, Any]] = []
        self.responses: dict[int, dict] = {}
        self.last: list[dict] | None = None
        try:
            # every rank started at once, each calling back on a listener of its own (its rank)
            with contextlib.ExitStack() as stack:
                procs = []
                try:
                    for r in range(tp):
                        listener = stack.enter_context(Listener(("127.0.0.1", 0), authkey=authkey))
                        host, port = listener.address
                        spec = {"rank": r, "world": tp, "version": version, "llm_kw": llm_kw,
                                "pool_files": self.pool_files, "num_blocks": num_blocks,
                                "setup": list(setup) if setup else None,
                                "kv_scales": list(kv_scales) if kv_scales else None}
                        proc = subprocess.Popen([sys.executable, "-m", "kvbridge.demo.trtllm.rank", f"{host}:{port}",
                                                 authkey.hex(), json.dumps(spec)], env=_rank_env(env, rank_env, r))
                        procs.append((listener, proc))
                    for listener, proc in procs:
                        self.ranks.append((_accept(listener, proc, start_timeout), proc))
                except BaseException:
                    for _, proc in procs[len(self.ranks):]:  # started, never connected
                        proc.kill()
                        proc.wait(5)
                    raise
            infos = self._relay(lambda m: m[0] == "ready", start_timeout)
        except BaseException:
            self.stop()
            raise
        self.info = infos[0][1]
        self.bus = self.info["bus"]
        self.bootstrap_address = self.info["bootstrap"]
        self.sender_endpoints = [i[1]["sender"] for i in infos]
        self.tokens_per_block = self.info["tokens_per_block"]
        self.free0 = self.info["free"]
        self._pools: list[torch.Tensor] | None = None

    # -- the MPI relay ---------------------------------------------------------------------
    def _recv(self, conn, timeout: float):
        try:
            if not conn.poll(timeout):
                raise StandInError(f"a rank did not answer within {timeout:.0f} s")
            msg = conn.recv()
        except (EOFError, OSError) as e:
            raise StandInError(f"a rank process is gone ({type(e).__name__})") from None
        if msg[0] == "error":
            raise StandInError(msg[1])
        return msg

    def _relay(self, finished: Callable[[tuple], bool], timeout: float) -> list:
        """Relay the ranks' collectives until every rank sends a ``finished`` message."""
        while True:
            msgs = [self._recv(conn, timeout) for conn, _ in self.ranks]
            if all(finished(m) for m in msgs):
                return msgs
            if not all(m[0] == "coll" for m in msgs) or len({m[1] for m in msgs}) != 1:
                raise StandInError(f"ranks diverged at a collective: {[m[:2] for m in msgs]}")
            kind, root = msgs[0][1], msgs[0][2]
            val = msgs[root][3] if kind == "bcast" else [m[3] for m in msgs]
            for conn, _ in self.ranks:
                conn.send(("val", val))

    # -- requests --------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_tokens: int, *, request_type: str | None = None,
               cache_salt: str | None = None) -> int:
        """A request into rank 0's queue (as ``trtllm-serve`` does); its request id.
        ``request_type``: a ``disaggregated_params.request_type``, or None for none."""
        return self._ask(0, "submit", list(map(int, prompt)), int(max_tokens), request_type, cache_salt)

    def cancel(self, request_id: int) -> None:
        self._ask(0, "cancel", int(request_id))

    def _ask(self, rank: int, *cmd):
        conn = self.ranks[rank][0]
        conn.send(cmd)
        return self._recv(conn, 60)[1]

    def step(self) -> list[dict]:
        """One executor iteration on every rank."""
        for conn, _ in self.ranks:
            conn.send(("step",))
        msgs = self._relay(lambda m: m[0] == "done", 60)
        self.last = [m[1] for m in msgs]
        self.responses.update(self.last[0]["responses"])
        return self.last

    def blocks(self, request_id: int, rank: int = 0) -> list[int] | None:
        """The request's block ids on ``rank`` (None once freed)."""
        return self._ask(rank, "blocks", int(request_id))

    def state(self, rank: int = 0) -> dict:
        """Blocks, pins and the connector's records on ``rank``."""
        return self._ask(rank, "state")

    def pool(self, rank: int = 0) -> torch.Tensor:
        """Rank ``rank``'s primary pool (shared memory, live)."""
        if self._pools is None:
            shape = self.info["pool_shape"]
            dtype = torch.uint8 if "uint8" in self.info["pool_dtype"] else torch.float32
            pools = []
            for r, path in enumerate(self.pool_files):
                n = os.path.getsize(path) // torch.empty(0, dtype=dtype).element_size()
                t = torch.from_file(path, shared=True, size=n, dtype=dtype)
                pools.append(t.view(shape[0], shape[1], shape[2], -1))
            self._pools = pools
        return self._pools[rank]

    def pid(self, rank: int = 0) -> int:
        return self.ranks[rank][1].pid

    def alive(self) -> bool:
        return all(p.poll() is None for _, p in self.ranks)

    def drained(self) -> bool:
        """Nothing active and every block back, on every rank (after the last step)."""
        return self.last is not None and all(r["active"] == 0 and r["free"] == self.free0 for r in self.last)

    def stop(self) -> None:
        """Stop every rank (killed if it does not stop) and remove the pool files."""
        for conn, proc in self.ranks:
            if proc.poll() is None:
                try:
                    conn.send(("stop",))
                    conn.poll(5)
                except (BrokenPipeError, EOFError, OSError):
                    pass
        for conn, proc in self.ranks:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            conn.close()
        self.ranks = []
        self._pools = None
        for path in getattr(self, "pool_files", ()):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "StandInServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_until(servers: Iterable[StandInServer], done: Callable[[], bool], timeout_s: float = 60.0,
              pause_s: float = 0.002) -> int:
    """Step every server until ``done()`` holds; returns the iterations it took."""
    servers = list(servers)
    end, n = time.monotonic() + timeout_s, 0
    while not done():
        if time.monotonic() > end:
            raise TimeoutError(f"not done after {n} iterations ({timeout_s:.0f} s): {[s.last for s in servers]}")
        for s in servers:
            s.step()
        n += 1
        if pause_s:
            time.sleep(pause_s)
    return n
