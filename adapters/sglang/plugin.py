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

A rank's manager adds the hooks of its side when it is built (``hooks.py``: layer-wise
sends on a prefill, the deferred release and token counts on a decode).
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


def install() -> None:
    """Register and apply at once, for processes that do not run ``load_plugins()``
    (tests, embedding). Applying patches ``get_kv_class`` now; hooks other plugins
    register on it later are then not applied, so prefer ``load_plugins()``."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()
