"""What SGLang's own KV pool and allocator hold, read inside a real SGLang server (tests only).

A server started with ``probe=True`` (``sglang_servers.start_pair``) runs
``tests/helpers/server_hooks/sitecustomize.py`` in every process; in its scheduler
process that calls ``install(folder)``, which patches SGLang after it is imported:

- every pass of the scheduler's loop (``Scheduler.ingest_requests``) reads the
  allocator's free pages (``get_all_free_pages`` / ``free_pages`` + ``release_pages``):
  a page listed twice is a **double free** in SGLang's own free list; on a decode, every
  page free since the last pass and not handed out by the allocator meanwhile must
  still hold ``SENTINEL`` in every layer of the pool: a byte that changed there is a
  **stray write** (into memory no request owns). Pages that became free are filled with
  ``SENTINEL`` (free memory is never read by SGLang: writing it changes no output);
- a decode's ``DecodePreallocQueue._pre_alloc`` fills the slots it just allocated for a
  request (whole pages, its prefix from the radix cache excepted) with ``SENTINEL``
  before its KV receiver is started, so anything that lands there shows;
- a decode's ``DecodeTransferQueue.pop_transferred``: for each request whose KV arrived
  (before SGLang runs a step on it), the pool rows of its prompt tokens, read by SGLang's
  own indexing (``req_to_token[req_pool_idx, t]`` -> ``k_buffer[layer][slot]``), go to
  ``landed-<n>.npz``, with how many slots of the request's pages outside its prompt no
  longer hold ``SENTINEL`` (bytes written beyond the prompt: whole pages moved);
- a parent's ``ask`` file is answered with the allocator's state (``PoolProbe.state``).

The parent's side is ``PoolProbe``. Nothing here imports kvbridge: what it reports is
SGLang's own memory, not the plugin's account of it.
"""

from __future__ import annotations

import glob
import importlib.abc
import json
import os
import sys
import time

import numpy as np

SENTINEL = 0x7F  # a byte free and freshly allocated pool memory holds (float32 3.4e38)


# -- inside the server --------------------------------------------------------------------


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` once module ``name`` has been executed."""

    def __init__(self, hooks: dict):
        self.hooks = hooks

    def find_spec(self, name, path, target=None):
        if name not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        hook, run = self.hooks.pop(name), spec.loader.exec_module

        def exec_module(module):
            run(module)
            hook(module)

        spec.loader.exec_module = exec_module
        return spec


def install(folder: str) -> None:
    """Patch SGLang (when its modules load) to report to ``folder``."""
    os.makedirs(folder, exist_ok=True)
    sys.meta_path.insert(0, _AfterImport({
        "sglang.srt.managers.scheduler": lambda m: _patch_scheduler(m, folder),
        "sglang.srt.disaggregation.decode": _patch_decode,
    }))


def _patch_scheduler(mod, folder: str) -> None:
    ingest = mod.Scheduler.ingest_requests

    def ingest_requests(self, *a, **kw):
        out = ingest(self, *a, **kw)
        probe = self.__dict__.get("_kvb_probe")
        if probe is None:
            probe = self.__dict__["_kvb_probe"] = _Probe(self, folder)
        probe.tick()
        return out

    mod.Scheduler.ingest_requests = ingest_requests


def _patch_decode(mod) -> None:
    pre_alloc, pop = mod.DecodePreallocQueue._pre_alloc, mod.DecodeTransferQueue.pop_transferred

    def _pre_alloc(self, req, prefix_indices=None, prefix_len=None, *a, **kw):
        out = pre_alloc(self, req, prefix_indices, prefix_len, *a, **kw)
        probe = self.scheduler.__dict__.get("_kvb_probe")
        if probe is not None:  # slots [0, prefix_len) are the decode's cached prefix
            probe.allocated(req, int(prefix_len or 0))
        return out

    def pop_transferred(self, *a, **kw):
        reqs = pop(self, *a, **kw)
        probe = self.scheduler.__dict__.get("_kvb_probe")
        if probe is not None:
            for req in reqs:
                probe.landed(req)
        return reqs

    mod.DecodePreallocQueue._pre_alloc = _pre_alloc
    mod.DecodeTransferQueue.pop_transferred = pop_transferred


class _Probe:
    """One scheduler's view of its pool (see the module docstring)."""

    def __init__(self, sched, folder: str):
        import torch

        self.torch, self.sched = torch, sched
        self.alloc = sched.token_to_kv_pool_allocator
        self.ps = int(self.alloc.page_size)
        pool = self.alloc.get_kvcache()
        names = ("k_buffer", "v_buffer") if getattr(pool, "k_buffer", None) is not None else ("kv_buffer",)
        # every layer's buffer as bytes per slot: [slots, row bytes]; K of every layer, then V
        self.bufs = [b.view(torch.uint8).reshape(b.shape[0], -1) for n in names for b in getattr(pool, n)]
        self.row_shape, self.dtype = list(getattr(pool, names[0])[0].shape[1:]), str(getattr(pool, names[0])[0].dtype)
        self.kv_factor = len(names)
        self.role = str(getattr(sched.disaggregation_mode, "value", sched.disaggregation_mode))
        self.decode = self.role == "decode"
        self.dir, self.pid = folder, os.getpid()
        self.pages = int(self.alloc.size) // self.ps
        self.known_free = None  # pages free (and SENTINEL) at the last pass, not handed out since
        self.handed_out = np.zeros(self.pages + 2, dtype=bool)
        self.counts = {"double_free": 0, "stray": 0, "landed": 0, "tail_written": 0}
        self._wrap_allocs()

    # - the allocator ----------------------------------------------------------------
    def _wrap_allocs(self) -> None:
        """Mark the pages every allocation hands out (written legitimately before the next pass)."""
        for name in ("alloc", "alloc_extend", "alloc_decode"):
            fn = getattr(self.alloc, name, None)
            if fn is None:
                continue

            def wrapped(*a, _fn=fn, **kw):
                out = _fn(*a, **kw)
                if out is not None:
                    got = out[0] if isinstance(out, tuple) else out
                    self.handed_out[np.unique(got.cpu().numpy() // self.ps)] = True
                return out

            setattr(self.alloc, name, wrapped)

    def _free_pages(self) -> np.ndarray:
        a = self.alloc
        if hasattr(a, "get_all_free_pages"):
            pages = a.get_all_free_pages()
        else:
            pages = self.torch.cat((a.free_pages, getattr(a, "release_pages", a.free_pages[:0])))
        return pages.cpu().numpy().astype(np.int64)

    def _slots(self, pages: np.ndarray) -> np.ndarray:
        return (pages[:, None] * self.ps + np.arange(self.ps)).reshape(-1)

    def _not_sentinel(self, slots: np.ndarray) -> np.ndarray:
        """The slots among ``slots`` where any layer's bytes differ from SENTINEL."""
        if slots.size == 0:
            return slots
        idx = self.torch.from_numpy(slots)
        bad = self.torch.zeros(slots.size, dtype=self.torch.bool)
        for b in self.bufs:
            bad |= (b[idx] != SENTINEL).any(dim=1)
        return slots[bad.numpy()]

    def _fill(self, slots: np.ndarray) -> None:
        if slots.size:
            idx = self.torch.from_numpy(slots)
            for b in self.bufs:
                b[idx] = SENTINEL

    def _record(self, row: dict) -> None:
        with open(os.path.join(self.dir, f"events-{self.pid}.jsonl"), "a") as f:
            f.write(json.dumps(dict(row, t=time.monotonic(), role=self.role)) + "\n")

    # - each pass of the scheduler's loop ----------------------------------------------
    def tick(self) -> None:
        pages = self._free_pages()
        uniq, n = np.unique(pages, return_counts=True)
        if (n > 1).any():
            self.counts["double_free"] += 1
            self._record({"event": "double_free", "pages": uniq[n > 1][:32].tolist()})
        if self.decode:
            free = np.zeros(self.pages + 2, dtype=bool)
            free[uniq] = True
            if self.known_free is not None:
                kept = free & self.known_free & ~self.handed_out
                bad = self._not_sentinel(self._slots(np.flatnonzero(kept)))
                if bad.size:
                    self.counts["stray"] += int(bad.size)
                    self._record({"event": "stray", "slots": bad[:64].tolist(), "n": int(bad.size)})
                fresh = free & ~kept
            else:
                fresh = free
            self._fill(self._slots(np.flatnonzero(fresh)))
            self.known_free, self.handed_out[:] = free, False
        self._answer()

    def _answer(self) -> None:
        ask = os.path.join(self.dir, "ask")
        if not os.path.exists(ask):
            return
        tree = getattr(self.sched, "tree_cache", None)
        state = {
            "pid": self.pid, "role": self.role, "t": time.monotonic(),
            "size": int(self.alloc.size), "available": int(self.alloc.available_size()),
            "evictable": int(tree.evictable_size()) if hasattr(tree, "evictable_size") else 0,
            "protected": int(tree.protected_size()) if hasattr(tree, "protected_size") else 0,
            **self.counts,
        }
        tmp = os.path.join(self.dir, f"state-{self.pid}.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, os.path.join(self.dir, f"state-{self.pid}.json"))
        try:
            os.unlink(ask)
        except FileNotFoundError:
            pass

    # - a decode's requests --------------------------------------------------------------
    def _req_slots(self, req, end: int) -> np.ndarray:
        idx = req.kv.req_pool_idx
        return self.sched.req_to_token_pool.req_to_token[idx, :end].cpu().numpy().astype(np.int64)

    def _outside(self, slots: np.ndarray, start: int) -> np.ndarray:
        """Slots of the pages holding ``slots[start:]`` that are not among ``slots``."""
        pages = np.unique(slots[start:] // self.ps)
        return np.setdiff1d(self._slots(pages), slots)

    def allocated(self, req, prefix: int) -> None:
        """``_pre_alloc`` gave ``req`` its slots: SENTINEL into them, its ``prefix`` (slots
        the decode's radix cache holds) excepted."""
        fill_len = int(req.kv.kv_committed_len)
        slots = self._req_slots(req, fill_len)
        self._fill(np.union1d(slots[prefix:], self._outside(slots, prefix)))
        self._record({"event": "allocated", "rid": req.rid, "prefix": prefix, "fill_len": fill_len,
                      "pages": np.unique(slots[prefix:] // self.ps).tolist()})

    def landed(self, req) -> None:
        """``req``'s KV arrived: its prompt rows as SGLang indexes them, and what was written
        beyond them in its pages."""
        n = len(req.origin_input_ids)
        prefix = int(req.kv.cache_protected_len or 0)
        slots = self._req_slots(req, n)
        tail = self._not_sentinel(self._outside(slots, prefix))
        idx = self.torch.from_numpy(slots)
        rows = np.stack([b[idx].numpy() for b in self.bufs])  # [buffers, n, row bytes]
        k = self.counts["landed"] = self.counts["landed"] + 1
        self.counts["tail_written"] += int(tail.size)
        np.savez(os.path.join(self.dir, f"landed-{self.pid}-{k}.npz"), rows=rows, slots=slots,
                 input_ids=np.asarray(req.origin_input_ids, dtype=np.int64), prefix=prefix,
                 tail_written=tail, row_shape=np.asarray(self.row_shape), dtype=self.dtype,
                 kv_factor=self.kv_factor)
        self._record({"event": "landed", "rid": req.rid, "n": n, "prefix": prefix, "tail_written": int(tail.size)})


# -- the parent's side -----------------------------------------------------------------------


class PoolProbe:
    """The reports of one server's probe (``folder``: ``Pair.probes[role]``)."""

    def __init__(self, folder: str):
        self.dir = str(folder)

    def state(self, timeout_s: float = 60.0) -> dict:
        """The allocator's state now, as the scheduler reads it on its next pass: ``size``,
        ``available``, ``evictable`` and ``protected`` (its radix cache), and the counts of
        ``double_free`` passes, ``stray`` slots, ``landed`` requests, ``tail_written`` slots."""
        from tests.helpers.kvhelpers import wait_until

        since, got = time.monotonic(), []
        open(os.path.join(self.dir, "ask"), "w").close()

        def answered() -> bool:
            for p in glob.glob(os.path.join(self.dir, "state-*.json")):
                try:
                    with open(p) as f:
                        st = json.load(f)
                except (OSError, ValueError):
                    continue
                if st["t"] >= since:
                    got.append(st)
                    return True
            return False

        wait_until(answered, timeout_s, f"the SGLang scheduler's answer to its probe in {self.dir}", poll_s=0.01)
        return got[-1]

    def settled(self, timeout_s: float = 60.0, cached: bool = False) -> dict:
        """The state once every page is back in the free list (``cached``: or held, evictable,
        by the radix cache), nothing protected; TimeoutError with the last state otherwise."""
        from tests.helpers.kvhelpers import wait_until

        last = []

        def back() -> bool:
            last.append(self.state(timeout_s))
            st = last[-1]
            return st["available"] + (st["evictable"] if cached else 0) == st["size"] and st["protected"] == 0

        try:
            wait_until(back, timeout_s, "SGLang's pool back", poll_s=0.05)
        except TimeoutError as e:
            raise TimeoutError(f"{e}: {last[-1]}") from None
        return last[-1]

    def events(self, kind: str | None = None) -> list[dict]:
        out = []
        for p in glob.glob(os.path.join(self.dir, "events-*.jsonl")):
            with open(p) as f:
                out += [json.loads(line) for line in f if line.strip()]
        return sorted((e for e in out if kind is None or e["event"] == kind), key=lambda e: e["t"])

    def landed(self, prompt) -> dict:
        """The last request whose prompt is ``prompt``, as it landed: ``kv`` float32
        ``[layers, kv_factor, T, heads, head_dim]`` (MLA: kv_factor 1, one latent row),
        ``prefix`` (tokens from the decode's own cache), ``tail_written`` (slots beyond
        the prompt in its pages that changed)."""
        import torch

        want = np.asarray(list(prompt), dtype=np.int64)
        found = None
        for p in sorted(glob.glob(os.path.join(self.dir, "landed-*.npz")), key=os.path.getmtime):
            z = np.load(p)
            if np.array_equal(z["input_ids"], want):
                found = z
        if found is None:
            raise AssertionError(f"no request with this {want.size}-token prompt landed on the decode ({self.dir})")
        dtype = getattr(torch, str(found["dtype"]).replace("torch.", ""))
        rows = torch.from_numpy(np.ascontiguousarray(found["rows"]))  # [buffers, T, bytes]
        per = rows.view(dtype).reshape(rows.shape[0], rows.shape[1], *found["row_shape"].tolist())
        kvf = int(found["kv_factor"])
        kv = per.reshape(kvf, rows.shape[0] // kvf, *per.shape[1:]).transpose(0, 1).float()
        return {"kv": kv, "prefix": int(found["prefix"]), "tail_written": found["tail_written"].tolist(),
                "slots": found["slots"].tolist()}

    def assert_landed(self, model_dir, prompt, *, prefix: int | None = None, atol: float = 1e-5) -> dict:
        """``prompt``'s KV as it landed in SGLang's decode pool equals transformers' for every
        prompt token (``prefix``: that many came from the decode's own cache), and nothing was
        written in its pages beyond the prompt."""
        from tests.helpers.engine_kv import assert_kv_close, transformers_kv

        got = self.landed(prompt)
        n = len(list(prompt))
        assert_kv_close(got["kv"], transformers_kv(model_dir, prompt), f"{n}-token prompt in SGLang's decode pool",
                        atol=atol)
        assert not got["tail_written"], (f"{n}-token prompt: slots {got['tail_written'][:16]} of its pages beyond "
                                         f"the prompt were written before SGLang ran a step")
        if prefix is not None:
            assert got["prefix"] == prefix, f"{n}-token prompt: {got['prefix']} tokens from the decode's cache, not {prefix}"
        return got

    def assert_clean(self, *, cached: bool = False, timeout_s: float = 60.0) -> dict:
        """Every page back in SGLang's free list (``cached``: or in its radix cache), none
        listed twice, no byte written into a free page, since the server started."""
        st = self.settled(timeout_s, cached)
        assert st["double_free"] == 0, f"SGLang's free list held a page twice: {self.events('double_free')[:3]}"
        assert st["stray"] == 0, f"bytes landed in free pages of SGLang's pool: {self.events('stray')[:3]}"
        assert st["tail_written"] == 0, f"bytes landed beyond a prompt in its pages: {self.events('landed')}"
        return st
