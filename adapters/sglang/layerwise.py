"""Layer-wise sends on an SGLang prefill rank (``layerwise`` on).

Two AROUND hooks (``hooks.py``), registered and applied by the prefill rank's manager
(``hooks.install_prefill_hooks``, from ``KVBridgeKVManager.__init__``, in the scheduler
process only) through SGLang's own ``HookRegistry``, feed this module's ``LayerStreamer``;
SGLang's files are not touched:

- ``Scheduler.run_batch`` (managers/scheduler.py:4614 in 0.5.23): the prefill scheduler,
  on its event loop, for every batch it launches. Before the forward: every request of an
  extend batch whose kvbridge room is open and bootstrapped (its decode asked; not an
  optimistic ``pending_bootstrap`` prefill) is armed with the tokens this forward computes,
  ``[req.prefix_len, req.extend_end)``, and the page ids that hold them (``req_to_token``,
  filled by ``prepare_for_extend`` before ``run_batch``). After it: layers whose hook did
  not fire are handed over (said once in the log), and the requests are disarmed.
- ``MHATokenToKVPool.set_kv_buffer`` (mem_cache/memory_pool.py:2891): called by the
  attention backend inside ``RadixAttention.forward`` (e.g. torch_native_backend.py:299,
  flashinfer_backend.py:1400) once per layer with the K and V of every token of the batch.
  For MLA models, the same hook on ``MLATokenToKVPool.set_kv_buffer`` (:4942, the latent
  row the torch_native backend writes) and ``set_mla_kv_buffer`` (:5026, the nope and rope
  parts the MLA backends write); a layer written twice is handed over once.
  When it returns for the armed pool, layer ``layer_id - start_layer`` of the armed tokens
  is in the pool: it is handed to the sender (``send_chunk(..., layers=(i, i + 1))``), which
  writes it while later layers compute (queued pieces of one range coalesce in the sender).
  It runs in the eager part of the forward even under SGLang's breakable prefill graphs
  (``_eager_attention``), unlike a hook on the decoder layer modules.

``KVBridgeKVSender.send`` (the disaggregation path's ``send_kv_chunk``) then sends only
tokens no forward streamed, and the last chunk ends the room with the first token
(``KVSender.finish``) once every layer went.

On CUDA the hook runs when the forward is enqueued, not when it ran: each piece is ordered
after an event recorded on the current (forward) stream and handed to the sender by one
dispatcher thread that waits for it; the forward stream never waits on the network. CPU
pools (and the tests here) hand pieces over directly.

Where the hook point is missing (no ``Scheduler.run_batch`` / ``set_kv_buffer`` to wrap, or
a pool type whose writes do not go through those methods as SGLang defines them: FP4,
MXFP8, page-major, hybrid pools, subclasses that override them) requests go whole, said
once in the log.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvbridge.common.ordered_calls import OrderedCalls, stream_event

log = logging.getLogger(__name__)

__all__ = ["LayerStreamer", "activate", "layerwise_wanted", "active_streamer"]

RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
SET_KV_BUFFER = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer"
# MLA pools (optional: without them an MLA server's requests go whole)
SET_MLA_KV_BUFFER = "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool.set_kv_buffer"
SET_MLA_LATENT = "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool.set_mla_kv_buffer"

_lock = threading.Lock()
_ACTIVE: list["LayerStreamer"] = []  # the prefill rank's streamer (one per scheduler process)


def layerwise_wanted(settings: Any, prompt_tokens: int | None = None, chooser: Any = None) -> bool:
    """Does this request (of ``prompt_tokens``; None: may any request?) go layer by layer?
    ``BridgeSettings.sends_layerwise``, the decision the TensorRT-LLM plugin asks too."""
    go, why = settings.sends_layerwise(prompt_tokens, chooser)
    if prompt_tokens is not None:
        log.debug("kvbridge: %d-token prompt: %s", prompt_tokens, why)
    return go


def active_streamer() -> "LayerStreamer | None":
    """This process's prefill streamer, if layer-wise sends are on."""
    return _ACTIVE[-1] if _ACTIVE else None


@dataclass
class _Armed:
    """One request's tokens ``[start, stop)`` computed by the forward in progress; entry 0 of
    its pages holds token ``first_token``; ``next_layer``: the first layer not handed over."""

    sender: Any  # KVBridgeKVSender
    room: int
    slots: Any  # torch int tensor: token slots of tokens [first_token, stop) (pinned host memory on CUDA)
    first_token: int
    start: int
    stop: int
    page_size: int
    next_layer: int = 0
    gap: bool = False  # a layer's hook fired out of order: the rest go after the forward
    _blocks: np.ndarray | None = None

    def blocks(self) -> np.ndarray:
        """Page ids of tokens ``[first_token, stop)``, int64 [pages] (read once; on CUDA from
        the pinned copy, after the event that follows it)."""
        if self._blocks is None:
            self._blocks = (self.slots[:: self.page_size] // self.page_size).numpy().astype(np.int64)
        return self._blocks


class LayerStreamer:
    """A prefill rank's layer-wise sends: armed requests of the forward in progress, fed
    by the two hooks. Built by the prefill manager when ``layerwise`` is on."""

    def __init__(self, mgr: Any, owns: Callable[[Any], bool]):
        self.mgr = mgr
        self.owns = owns  # whether a request's ``disagg_kv_sender`` is one of this rank's kvbridge senders
        self.num_layers = int(mgr.layout.num_layers)
        self.pool: Any = None  # the pool armed for the forward in progress
        self.armed: list[_Armed] = []
        self.dispatch = OrderedCalls("kvbridge-sglang-layers")
        self._said: set[str] = set()

    def say_once(self, key: str, msg: str, *args) -> None:
        """A warning logged once per process and kind."""
        if key not in self._said:
            self._said.add(key)
            log.warning(msg, *args)

    # -- the forward's bracket (run_batch hook) ---------------------------------------------
    def arm_batch(self, scheduler: Any, batch: Any) -> None:
        """Before the forward of ``batch`` (a ScheduleBatch): arm its requests."""
        fm = getattr(batch, "forward_mode", None)
        if fm is None or not fm.is_extend() or not getattr(batch, "reqs", None):
            return
        alloc = scheduler.token_to_kv_pool_allocator
        pool = alloc.get_kvcache()
        if not _supported_pool(pool):
            self.say_once("pool", "kvbridge: layer-wise sends need SGLang's MHATokenToKVPool or MLATokenToKVPool "
                          "(their set_kv_buffer is the per-layer hook); this server's %s is not supported: "
                          "requests go whole", type(pool).__name__)
            return
        dev = str(getattr(self.mgr.layout, "device", "") or "cpu")
        if not dev.startswith(("cpu", "cuda")):
            self.say_once("device", "kvbridge: layer-wise sends order pieces after CUDA events; pools on %s are not "
                          "supported: requests go whole", dev)
            return
        ps = int(alloc.page_size)
        req_to_token = scheduler.req_to_token_pool.req_to_token
        # a prefix cached here goes whole before the forward: on CUDA after what the forward
        # stream has queued (earlier forwards may still write it) and the slot copies
        fwd = getattr(scheduler, "forward_stream", None)
        pre_event = (stream_event(fwd), None) if dev.startswith("cuda") else None
        armed = []
        for req in batch.reqs:
            s = getattr(req, "disagg_kv_sender", None)
            if s is None or not self.owns(s) or getattr(req, "pending_bootstrap", False):
                continue
            n_in = len(req.origin_input_ids)
            start, stop = int(req.prefix_len), min(int(req.extend_end or 0), n_in)
            a = self.arm_request(s, start, stop, ps, lambda lo, hi, req=req: _slots(alloc, req_to_token, req, lo, hi),
                                 n_in, pre_event)
            if a is not None:
                armed.append(a)
        if armed:
            self.begin_forward(pool, armed)

    def arm_request(self, sender: Any, start: int, stop: int, page_size: int,
                    slots_of: Callable[[int, int], Any], prompt_tokens: int, pre_event: Any = None) -> "_Armed | None":
        """Arm ``sender``'s room for tokens ``[start, stop)`` of this forward (``slots_of(lo,
        hi)``: the token slots of tokens ``[lo, hi)``, torch int [hi - lo]); a prefix cached
        here that was not sent yet goes first, whole (after ``pre_event``: on CUDA, events
        on the forward stream and, recorded here, on the current one). None when the room
        does not stream."""
        if not sender.kvb_streamable() or not layerwise_wanted(self.mgr.kvb_settings, prompt_tokens, self.mgr.kvb_layerwise_chooser):
            return None
        covered = sender.kvb_covered()
        s0 = max(start, covered)
        if stop <= s0:
            return None
        if covered < start:  # cached on this prefill (radix hit), computed by earlier forwards: whole, now
            lo = covered - covered % page_size
            pre = _Armed(sender, sender.bootstrap_room, slots_of(lo, start), lo, covered, start, page_size)
            if pre_event is not None:
                pre_event = (pre_event[0], stream_event())
            self._send(pre, None, event=pre_event)
            sender.kvb_note_whole(start)
        first = s0 - s0 % page_size
        return _Armed(sender, sender.bootstrap_room, slots_of(first, stop), first, s0, stop, page_size)

    def begin_forward(self, pool: Any, armed: list[_Armed]) -> None:
        """The forward about to run writes ``armed``'s tokens into ``pool``."""
        self.pool, self.armed = pool, list(armed)

    def disarm(self, stream: Any = None) -> None:
        """After the forward: layers whose hook did not fire go now (on CUDA after events on
        the current stream and ``stream``, the one the forward ran on); the requests are done."""
        armed, self.armed, self.pool = self.armed, [], None
        event = _event(armed)
        if event is not None and stream is not None:
            event = (event, stream_event(stream))
        for a in armed:
            if a.next_layer < self.num_layers:
                if a.next_layer == 0 and not a.gap:
                    self.say_once("nohook", "kvbridge: set_kv_buffer did not fire for this forward's layers (a fused "
                                  "KV write?); their KV goes once the forward is done")
                self._send(a, (a.next_layer, self.num_layers), event=event)
            a.sender.kvb_note_streamed(a.stop)

    # -- one layer (set_kv_buffer hook) -----------------------------------------------------
    def on_layer(self, pool: Any, layer: int) -> None:
        """``pool`` holds layer ``layer`` (pool-local index) of the batch's tokens now."""
        if pool is not self.pool or not self.armed:
            return
        event = None
        for a in self.armed:
            if a.gap or layer < a.next_layer:
                continue  # a layer written again after it went (no 0.5.23 backend does): not sent twice
            if layer > a.next_layer:
                a.gap = True  # a layer out of order (an earlier one not written yet): the rest go after the forward
                self.say_once("gap", "kvbridge: layer %d's KV was written before layer %d's; the layers from %d go "
                              "after the forward", layer, a.next_layer, a.next_layer)
                continue
            if event is None:
                event = _event([a])
            self._send(a, (layer, layer + 1), event=event)
            a.next_layer = layer + 1

    # -- sends --------------------------------------------------------------------------------
    def _send(self, a: _Armed, layers: tuple[int, int] | None, *, last: bool = False, event: Any = None) -> None:
        mgr = self.mgr

        def go(a=a, layers=layers):
            try:
                mgr.kv_sender.send_chunk(a.room, a.blocks(), a.start, a.stop, last=last, first_token=a.first_token,
                                         layers=layers)
            except (KeyError, ValueError) as e:  # the room ended, or a bookkeeping bug: the room fails
                log.error("kvbridge: room %s: layer-wise send of tokens [%d, %d) layers %s failed: %s", a.room,
                          a.start, a.stop, layers, e)
                mgr.kv_sender.abort(a.room, f"layer-wise send failed: {e}")
                return
            if layers is not None:
                a.sender.kvb_layer_pieces += 1

        self.dispatch.call(go, event)

    def call(self, fn: Callable[[], None], on_cuda: bool) -> None:
        """Run a sender call behind every piece handed over before it (on CUDA, through the
        dispatcher: it must not overtake a queued piece)."""
        self.dispatch.call(fn, stream_event() if on_cuda else None)

    def close(self) -> None:
        self.dispatch.close()
        with _lock:
            if self in _ACTIVE:
                _ACTIVE.remove(self)


def _supported_pool(pool: Any) -> bool:
    """Whether ``pool``'s KV writes go through a hooked method as SGLang defines it:
    ``MHATokenToKVPool.set_kv_buffer``, or (once hooked) both of ``MLATokenToKVPool``'s
    (subclasses that override them, and other pool types, do not)."""
    try:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    except ImportError:
        return False
    if isinstance(pool, MHATokenToKVPool):
        return type(pool).set_kv_buffer is MHATokenToKVPool.set_kv_buffer
    if isinstance(pool, MLATokenToKVPool):
        from sglang.srt.plugins.hook_registry import HookRegistry

        return (SET_MLA_KV_BUFFER in HookRegistry._patched and SET_MLA_LATENT in HookRegistry._patched
                and type(pool).set_kv_buffer is MLATokenToKVPool.set_kv_buffer
                and type(pool).set_mla_kv_buffer is MLATokenToKVPool.set_mla_kv_buffer)
    return False


def _slots(alloc: Any, req_to_token: Any, req: Any, lo: int, hi: int):
    """Token slots of tokens ``[lo, hi)`` of ``req`` (physical ids, as ``_send_kv_chunk``
    uses), on the host: int [hi - lo]. On CUDA a non-blocking copy into pinned memory on the
    scheduler's current stream (the forward stream waits for it before the forward)."""
    import torch

    raw = req_to_token[req.kv.req_pool_idx, lo:hi]
    idx = alloc.translate_kv_indices_for_transfer(raw)
    if idx.device.type == "cpu":
        return idx.to(torch.int64)
    out = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
    out.copy_(idx, non_blocking=True)
    return out


def _event(armed: list[_Armed]):
    """An event on the current stream when the armed tokens live in CUDA pools, else None."""
    if not armed or not _on_cuda(armed[0].sender.kv_mgr):
        return None
    return stream_event()


def _on_cuda(mgr: Any) -> bool:
    dev = str(getattr(mgr.layout, "device", "") or "cpu")
    return dev.startswith("cuda")


def activate(st: "LayerStreamer") -> "LayerStreamer":
    """Make ``st`` this process's active streamer (what the hooks feed); returns it."""
    with _lock:
        _ACTIVE.append(st)
    return st
