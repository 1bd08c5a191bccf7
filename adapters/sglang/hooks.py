"""The hooks a kvbridge KV manager puts on SGLang when it is built, through SGLang's own
``HookRegistry`` (SGLang's files are not touched), each side its own:

- prefill, with ``layerwise`` on (``install_prefill_hooks``): around ``Scheduler.run_batch``
  and the pools' ``set_kv_buffer``, feeding the rank's ``layerwise.LayerStreamer``;
- decode (``install_decode_hooks``, only in decode scheduler processes): around
  ``DecodePreallocQueue._send_kv_metadata``, to tell its receiver how many tokens the
  pages it is given hold, and around ``DecodeTransferQueue.resolve_deferred_releases``, so
  that a failed kvbridge request's pages are held until kvbridge proves no sender can
  write into them, never released by SGLang's own timer
  (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from .layerwise import (RUN_BATCH, SET_KV_BUFFER, SET_MLA_KV_BUFFER, SET_MLA_LATENT, LayerStreamer, activate,
                        active_streamer)

__all__ = ["install_prefill_hooks", "install_decode_hooks"]

log = logging.getLogger(__name__)

_lock = threading.Lock()


def _apply_around(registry: Any, hooks: tuple[tuple[str, Callable], ...]) -> None:
    """Register each (target, hook) AROUND once per process and apply every hook not
    applied yet (these, and any that failed before). Call under ``_lock``."""
    from sglang.srt.plugins.hook_registry import HookType

    for target, hook in hooks:
        if not any(h is hook for _, h, _ in registry._hooks.get(target, ())):
            registry.register(target, hook, HookType.AROUND)
    registry.apply_hooks()


# -- prefill: layer-wise sends ----------------------------------------------------------
def kvbridge_run_batch(original, *args, **kwargs):
    """AROUND hook on ``Scheduler.run_batch`` (prefill rank with ``layerwise`` on): arm the
    batch's streaming rooms before the forward, hand over what is left and disarm after.
    Other modes and batches pass through; a failure to arm never fails the batch."""
    st = active_streamer()
    sched = args[0] if args else kwargs.get("self")
    batch = args[1] if len(args) > 1 else kwargs.get("batch")
    if st is None or batch is None or getattr(sched, "disaggregation_mode", None) is None \
            or getattr(sched.disaggregation_mode, "value", "") != "prefill":
        return original(*args, **kwargs)
    try:
        st.arm_batch(sched, batch)
    except Exception:
        log.exception("kvbridge: arming a batch for layer-wise sends failed; its requests go whole")
        st.armed, st.pool = [], None
    try:
        return original(*args, **kwargs)
    finally:
        if st.armed:
            st.disarm(getattr(sched, "forward_stream", None))


def kvbridge_set_kv_buffer(original, *args, **kwargs):
    """AROUND hook on ``MHATokenToKVPool.set_kv_buffer(self, layer, loc, k, v, ...,
    layer_id_override=None)`` (and MLA's ``set_kv_buffer`` / ``set_mla_kv_buffer``, the same
    ``(self, layer, ...)`` shape): after the write, a streaming forward's layer goes to the
    sender. Any other pool or call passes through untouched; this hook never raises
    after the write."""
    out = original(*args, **kwargs)
    st = active_streamer()
    if st is not None and st.armed and args:
        try:
            pool = args[0]
            layer = args[1] if len(args) > 1 else kwargs.get("layer")
            lid = kwargs.get("layer_id_override")
            if lid is None:
                lid = getattr(layer, "layer_id", None)
            if lid is not None:
                st.on_layer(pool, int(lid) - int(getattr(pool, "start_layer", 0) or 0))
        except Exception:
            log.exception("kvbridge: layer-wise hook failed; the forward's remaining layers go after it")
    return out


def install_prefill_hooks(mgr: Any, owns: Callable[[Any], bool]) -> "LayerStreamer | None":
    """Prefill rank, from ``KVBridgeKVManager.__init__`` when ``layerwise`` is on: register and
    apply both hooks once per process and make ``mgr``'s streamer the active one (``owns``:
    whether a request's sender is one of ``mgr``'s). Returns it, or None (logged once) when
    a hook point is missing: requests then go whole."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry
    except ImportError as e:
        log.warning("kvbridge: layerwise is on but SGLang has no plugin hook registry (%s): requests go whole", e)
        return None
    with _lock:
        _apply_around(HookRegistry, ((RUN_BATCH, kvbridge_run_batch), (SET_KV_BUFFER, kvbridge_set_kv_buffer),
                                     (SET_MLA_KV_BUFFER, kvbridge_set_kv_buffer),
                                     (SET_MLA_LATENT, kvbridge_set_kv_buffer)))
        missing = [t for t in (RUN_BATCH, SET_KV_BUFFER) if t not in HookRegistry._patched]
        if missing:
            log.warning("kvbridge: layerwise is on but %s cannot be hooked in this SGLang version: requests go whole",
                        " and ".join(missing))
            return None
        st = activate(LayerStreamer(mgr, owns))
    log.info("kvbridge: layer-wise sends on (hooks on Scheduler.run_batch and MHATokenToKVPool.set_kv_buffer%s)",
             "" if SET_MLA_LATENT in HookRegistry._patched else "; MLA pools not hooked: their requests go whole")
    return st


# -- decode: token counts and the deferred release --------------------------------------
SEND_KV_METADATA = "sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata"


def kvbridge_send_kv_metadata(original, *args, **kwargs):
    """AROUND hook on ``DecodePreallocQueue._send_kv_metadata`` (decode.py): the decode
    scheduler, on its event loop, once a request's pages are allocated, with the token
    slots ``kv_indices`` of its prompt past ``decode_prefix_len`` (before turning them into
    page ids for ``send_metadata``). A kvbridge receiver is told that token count first
    (``note_transfer_tokens``): page ids alone do not say how much of the last page the
    prompt fills, and the prefill's pages may be another size. Other backends' requests
    pass through untouched; this hook never raises."""
    try:  # (self, decode_req, kv_indices, page_size, state_indices=None, **metadata_kwargs)
        decode_req = args[1] if len(args) > 1 else kwargs.get("decode_req")
        kv_indices = args[2] if len(args) > 2 else kwargs.get("kv_indices")
        note = getattr(getattr(decode_req, "kv_receiver", None), "note_transfer_tokens", None)
        if note is not None and kv_indices is not None:
            note(len(kv_indices))
    except Exception:  # the receiver then counts whole pages
        log.exception("kvbridge: cannot count the tokens a decode request's pages are for")
    return original(*args, **kwargs)


RESOLVE_DEFERRED = "sglang.srt.disaggregation.decode.DecodeTransferQueue.resolve_deferred_releases"


def kvbridge_resolve_deferred_releases(original, *args, **kwargs):
    """AROUND hook on ``DecodeTransferQueue.resolve_deferred_releases`` (decode.py): the
    decode scheduler, each pass, releases failed requests whose pages it held once their
    manager's ``is_abort_release_safe`` says so *or their deadline passed*. A timer is no
    proof that no sender still writes: for kvbridge's requests the deadline is lifted
    (they go back on kvbridge's proof alone, and ``kvbridge_quarantined_blocks`` counts
    them meanwhile); other backends' keep SGLang's timer. Never raises."""
    try:
        queue = args[0] if args else kwargs.get("self")
        held = getattr(queue, "_deferred_releases", None) or []
        for i, entry in enumerate(held):
            recv = getattr(entry[0], "kv_receiver", None)
            if entry[2] != float("inf") and getattr(recv, "kvb_release_rule", False):
                held[i] = (entry[0], entry[1], float("inf"), *entry[3:])
    except Exception:  # SGLang's timer then applies
        log.exception("kvbridge: cannot lift SGLang's deferred-release timer")
    return original(*args, **kwargs)


_DECODE_HOOKS = ((SEND_KV_METADATA, kvbridge_send_kv_metadata), (RESOLVE_DEFERRED, kvbridge_resolve_deferred_releases))


def install_decode_hooks() -> bool:
    """Decode rank, from ``KVBridgeKVManager.__init__`` (inside the decode scheduler's
    process, where decode.py is already imported; no other process needs it): register
    and apply the hooks on ``_send_kv_metadata`` and ``resolve_deferred_releases`` once.
    Returns whether both are in place."""
    from sglang.srt.disaggregation import decode
    from sglang.srt.plugins.hook_registry import HookRegistry

    with _lock:
        _apply_around(HookRegistry, _DECODE_HOOKS)
    ok = True
    for target, _ in _DECODE_HOOKS:
        cls, name = target.rsplit(".", 2)[1:]
        if target not in HookRegistry._patched or not hasattr(getattr(decode, cls), name):
            log.error("kvbridge: the hook on %s is not in place (%s)", target,
                      "prompts that do not fill their last page fail" if target == SEND_KV_METADATA else
                      "SGLang's timer may release a failed request's pages while a sender still writes")
            ok = False
    return ok
