"""Registration of the ``kvbridge`` transfer backend with SGLang (>= 0.5.16).

SGLang loads every function registered under the entry-point group
``sglang.srt.plugins`` in every process it starts (``sglang.srt.plugins.load_plugins``,
filtered by ``SGLANG_PLUGINS``), then applies the hooks those functions registered.
``register`` is that function for kvbridge. It does four things, each idempotently:

1. adds ``"kvbridge"`` to the ``--disaggregation-transfer-backend`` choices;
2. adds ``KVBRIDGE = "kvbridge"`` to ``sglang.srt.disaggregation.utils.TransferBackend``
   (an Enum, extended in place so every module that imported it by name sees it);
3. registers an AROUND hook on ``sglang.srt.disaggregation.utils.get_kv_class`` that
   returns kvbridge's classes for that backend and defers to SGLang otherwise;
   ``HookRegistry.apply_hooks`` (run by ``load_plugins``) patches the function and every
   ``from ... import get_kv_class`` binding already made;
4. registers a BEFORE hook on ``Scheduler.init_disaggregation`` that notes the loaded
   model's fp8 KV scales for the KV manager built next (``scales.record_scales``).

A decode rank's manager adds two more hooks when it is built (``install_decode_hooks``,
only in decode scheduler processes): around ``DecodePreallocQueue._send_kv_metadata``,
to tell its receiver how many tokens the pages it is given hold, and around
``DecodeTransferQueue.resolve_deferred_releases``, so that a failed kvbridge request's
pages are held until kvbridge proves no sender can write into them, never released by
SGLang's own timer (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``).
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

BACKEND = "kvbridge"
MEMBER = "KVBRIDGE"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"

_lock = threading.Lock()


def extend_enum(cls: type[enum.Enum], name: str, value: Any) -> enum.Enum:
    """Add member ``name = value`` to the Enum ``cls`` in place and return it.

    Idempotent: an existing member of that name and value is returned; a clash (the
    name with another value, or the value under another name) raises ValueError. The
    member is entered wherever Enum looks members up (by value, by name, iteration),
    so ``cls(value)``, ``cls[name]``, ``cls.name`` and pickling all work.
    """
    with _lock:
        members = cls.__members__
        if name in members:
            m = members[name]
            if m.value != value:
                raise ValueError(f"{cls.__name__}.{name} exists with value {m.value!r}, not {value!r}")
            return m
        try:
            other = cls(value)
        except ValueError:
            other = None
        if other is not None:
            raise ValueError(f"value {value!r} already belongs to {cls.__name__}.{other.name}")
        member_type = getattr(cls, "_member_type_", object)
        member = object.__new__(cls) if member_type is object else member_type.__new__(cls, value)
        member._name_ = name
        member._value_ = value
        member.__objclass__ = cls
        try:
            member.__init__(value)
        except TypeError:
            pass
        if hasattr(member, "_sort_order_"):
            member._sort_order_ = len(cls._member_names_)
        cls._member_map_[name] = member
        cls._value2member_map_[value] = member
        cls._member_names_.append(name)
        type.__setattr__(cls, name, member)
        return member


def _is_kvbridge(backend: Any) -> bool:
    return getattr(backend, "value", backend) == BACKEND


def kvbridge_get_kv_class(original, transfer_backend, class_type):
    """AROUND hook on ``get_kv_class``: SGLang's schedulers (prefill and decode, each TP
    rank) and its tokenizer-side bootstrap starter call ``get_kv_class(backend, kind)``
    when they build the KV manager, each request's sender/receiver, and the bootstrap
    server. For ``kvbridge`` this answers with kvbridge's classes; every other backend,
    and ``KVClassType.KVARGS`` (one shared container), goes to SGLang's original."""
    kind = getattr(class_type, "value", class_type)
    if not _is_kvbridge(transfer_backend) or kind == "kvargs":
        return original(transfer_backend, class_type)
    from . import conn

    return {
        "manager": conn.KVBridgeKVManager,
        "sender": conn.KVBridgeKVSender,
        "receiver": conn.KVBridgeKVReceiver,
        "bootstrap_server": conn.KVBridgeKVBootstrapServer,
    }.get(kind)


def _hook_registered(registry) -> bool:
    return any(h is kvbridge_get_kv_class for _, h, _ in registry._hooks.get(GET_KV_CLASS, ()))


def register() -> None:
    """The ``sglang.srt.plugins`` entry point ``kvbridge``.

    Called by SGLang's ``load_plugins()`` once per process (launcher, tokenizer,
    scheduler of every prefill and decode rank), before any server argument is parsed
    or any KV manager is built, on both sides alike. Safe to call again.
    Only registers the hooks; ``load_plugins`` applies them (see ``install`` for manual use).
    """
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils as dutils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .scales import INIT_DISAGGREGATION, record_scales

    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND])
    extend_enum(dutils.TransferBackend, MEMBER, BACKEND)
    with _lock:
        if not _hook_registered(HookRegistry):
            HookRegistry.register(GET_KV_CLASS, kvbridge_get_kv_class, HookType.AROUND)
        if not any(h is record_scales for _, h, _ in HookRegistry._hooks.get(INIT_DISAGGREGATION, ())):
            HookRegistry.register(INIT_DISAGGREGATION, record_scales, HookType.BEFORE)
    log.debug("kvbridge transfer backend registered with SGLang")


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
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    with _lock:
        for target, hook in _DECODE_HOOKS:
            if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
                HookRegistry.register(target, hook, HookType.AROUND)
        HookRegistry.apply_hooks()  # applies targets not applied yet: these (and any that failed before)
    ok = True
    for target, _ in _DECODE_HOOKS:
        cls, name = target.rsplit(".", 2)[1:]
        if target not in HookRegistry._patched or not hasattr(getattr(decode, cls), name):
            log.error("kvbridge: the hook on %s is not in place (%s)", target,
                      "prompts that do not fill their last page fail" if target == SEND_KV_METADATA else
                      "SGLang's timer may release a failed request's pages while a sender still writes")
            ok = False
    return ok


def install() -> None:
    """Register and apply at once, for processes that do not run ``load_plugins()``
    (tests, embedding). Applying patches ``get_kv_class`` now; hooks other plugins
    register on it later are then not applied, so prefer ``load_plugins()``."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()
