"""The settings every engine plugin shares, and the one reader of them.

``BridgeSettings`` holds what all three adapters (SGLang, TensorRT-LLM, vLLM) configure
alike: this rank's address and the Mooncake transport, handoff timing and auth, the link
description the plans and the cost model use, the per-request cost gate and what a
prefill's SGLang-compatible bootstrap server reports. Each adapter's config subclasses
it with its own engine-specific fields (and its own defaults where they differ).
``BridgeSettings.load`` builds any of them from the JSON/YAML file named by
``KVBRIDGE_CONFIG``, an engine's config mapping, environment variables
``KVBRIDGE_<FIELD>`` and explicit overrides, later sources winning, with typed values and
unknown names refused. The handoff state machines' ``HandoffConfig`` is made from these
settings only (``BridgeSettings.handoff``). The table of settings is docs/settings.md;
the names are the same in every plugin.

Nothing here imports an engine.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping, TypeVar

from kvbridge.layout import DIGEST_HASHES, PlanCosts, PlanKind

from .costmodel import LinkProfile, load_link
from .transport import P2PHANDSHAKE

__all__ = ["BridgeSettings", "HandoffConfig", "INTEGRITY_HASHES", "INTEGRITY_MODES", "ConfigError", "CONFIG_ENV", "ENV_PREFIX", "LAYERWISE_AUTO", "handoff_config",
           "parse_layerwise"]

T = TypeVar("T", bound="BridgeSettings")

ENV_PREFIX = "KVBRIDGE_"  # every setting's environment variable: KVBRIDGE_<FIELD>, in every plugin
CONFIG_ENV = "KVBRIDGE_CONFIG"  # names a JSON or YAML file of settings, in every plugin

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A setting that is missing, malformed or inconsistent."""


LAYERWISE_AUTO = "auto"


def parse_layerwise(v: Any) -> "bool | str":
    """The ``layerwise`` setting: True / False (also "true", "on", "1", "false", "off",
    "0"...) force layer-wise sends on or off; "auto" lets the cost model decide per
    request (``kvbridge.common.costmodel.decide_layerwise``)."""
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s == LAYERWISE_AUTO:
        return LAYERWISE_AUTO
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ConfigError(f"setting layerwise={v!r} is not one of auto, true, false")


def _comma_list(v: Any) -> str:
    """A comma-separated setting, also given as a list (a YAML file's, a ``HandoffConfig``'s tuple)."""
    return ",".join(str(x) for x in v) if isinstance(v, (list, tuple)) else str(v)


_HOST = re.compile(r"[^\s/]+")
_METADATA = re.compile(r"[a-z][a-z0-9+.-]*://\S+|[^\s/:]+:\d{1,5}")
_DEVICES = re.compile(r"[A-Za-z0-9_.:,-]*")


@dataclass(frozen=True)
class HandoffConfig:
    """Knobs shared by both sides (seconds unless named otherwise), made by
    ``kvbridge.common.settings.BridgeSettings.handoff``: the deployment's settings (their
    defaults are written there) and the transfer core's own fields (with defaults here)."""

    # the deployment's settings (BridgeSettings documents each)
    deadline_s: float
    heartbeat_s: float
    peer_timeout_s: float
    quiesce_s: float
    chunk_bytes: int
    secret: str = field(repr=False)
    accepted_secrets: tuple[str, ...] = field(repr=False)
    replay_window_s: float
    allow_insecure: bool
    model: str
    recv_staging_bytes: int  # 0 on a sender
    integrity: str
    integrity_sample: float
    integrity_hash: str
    costs: PlanCosts  # the plan chooser's figures, from the link (LinkProfile.plan_costs)
    gather_threads: int  # threads of the gather / scatter's C tile copy (BridgeSettings.copy_choice)
    # the transfer core's own
    gone_drain_s: float = 1.0  # a sender whose control connection closed and that answers no probe within this is gone
    part_bytes: int = 16 << 20  # one gather + one write of a staged send (the ring's region size)
    ring_parts: int = 4  # regions of a sender worker's staging ring: parts gathered ahead of the wire
    first_part_bytes: int = 1 << 20  # the first part of a send; parts double up to part_bytes
    prestage_slots: int = 4  # sender: rooms whose first part it may hold gathered before their request comes (0: never)
    prestage_bytes: int = 16 << 20  # that first part (one slot of the sender's prestage buffer)
    write_timeout_s: float = 30.0  # bound on one chunk's write
    kinds: tuple[PlanKind, ...] = tuple(PlanKind)

    def verifies(self, room: int) -> bool:
        """Whether the receiver verifies ``room``'s content (``integrity``)."""
        if self.integrity == "on":
            return True
        if self.integrity == "sample":
            return sampled(room, self.integrity_sample)
        return False

    def keyring(self):
        """A ``Keyring`` for these secrets (None: auth off); raises ValueError on a short key."""
        from .auth import Keyring

        return Keyring.from_settings(self.secret, self.accepted_secrets, self.replay_window_s)


INTEGRITY_MODES = ("on", "off", "sample")
INTEGRITY_HASHES = ("auto", *DIGEST_HASHES)  # auto: kvbridge.layout.accepted_algorithms


def sampled(room: int, fraction: float) -> bool:
    """Whether ``room`` falls in a ``fraction`` of all rooms: the same answer in every
    process (a hash of the id), spread evenly whatever the ids look like."""
    import xxhash

    return xxhash.xxh3_64_intdigest(int(room).to_bytes(8, "little", signed=False)) < fraction * 2.0**64


@dataclass(frozen=True)
class BridgeSettings:
    """Settings shared by every kvbridge engine plugin (seconds unless named otherwise).

    Networking: ``host``, the address this rank binds and advertises (control sockets,
    Mooncake); ``metadata_server`` (``P2PHANDSHAKE``: none; else a URL such as
    ``http://host:port/metadata`` or an etcd ``host:port``), ``protocol`` (``tcp``,
    ``rdma``, ``nvlink``) and ``device_name`` (InfiniBand devices, comma-separated; empty:
    Mooncake's choice) go to Mooncake.
    Handoff: ``deadline_s``, ``heartbeat_s``, ``peer_timeout_s``, ``quiesce_s``,
    ``chunk_bytes`` (per field below). Auth (``kvbridge.common.auth``): ``secret``
    (the shared key every control, bus and rank-record frame is sealed with, at least 16
    bytes; empty: auth off, allowed only on loopback binds unless ``allow_insecure``),
    ``accepted_secrets`` (comma-separated keys also accepted: a rotation),
    ``replay_window_s`` (a frame's age limit either way; hosts need NTP). Neither secret
    is ever printed.
    ``model`` (a name both sides must agree on, empty: not checked),
    ``recv_staging_bytes`` (staging a decode rank offers senders for ``staged_recv``).
    Integrity (decode side): ``integrity`` "on" compares a content digest of every room
    (``kvbridge.layout.digest``, taken by the senders over what they moved and by this
    rank over what landed) before the room is admitted, "sample" does so for a fraction
    ``integrity_sample`` of the rooms, "off" for none; a mismatch fails the room
    (``code="integrity"``), which the plugin's failure policy then handles.
    ``integrity_hash``, the digest this rank asks its senders for: "xxh3" (XXH3-64, the
    rows hashed where they lie in host memory), "torch" (a torch reduction on the pool's
    device), "auto" (XXH3-64 on a host pool; on a GPU pool the torch reduction where the
    sender's pool is on a GPU too, else XXH3-64).
    Link: ``link``, a preset (``tcp``, ``rdma``, ``nvlink``, ``pcie5``, ``ib400``) or a
    ``kvbridge bench link --out`` file; empty: the preset of ``protocol``. It sets both
    the plan chooser's costs (``HandoffConfig.costs``) and the cost gate's figures.
    Copies: ``gather_threads``, the threads the sender's gather and the receiver's scatter
    copy on (CPU pools); 0: this host's choice for ``protocol`` (``copy_choice``: one
    beside TCP, all where RDMA / NVLink leave the CPU free and they measured faster here).
    SGLang interop (vLLM and TensorRT-LLM): ``sglang_page_size``, the page size a
    prefill's SGLang-compatible bootstrap server reports (it must be the SGLang decode's
    ``--page-size``: SGLang refuses a prefill whose reported page size differs; kvbridge
    converts block sizes itself); ``discovery_timeout_s``, how long a decode waits for a
    prefill's bootstrap server to list its ranks.
    Cost gate (decode side, off by default): ``cost_gate_enabled`` turns it on (on the
    link above), ``cost_model`` (a model preset or a Hugging Face ``config.json``;
    default: the served model's), ``cost_prefill_tps`` / ``cost_decode_prefill_tps``
    (prefill tokens/s of each worker, 0: from FLOPs), ``cost_queue_s`` (expected prefill
    queue wait).
    Layer-wise sends (prefill side, off by default): ``layerwise`` true sends each layer
    of a forward's tokens as soon as the forward wrote it, false sends a request's KV
    whole after its prefill, "auto" decides per request from the link and the model
    geometry (``cost_model``, else the served model's; prefill speed
    ``cost_prefill_tps``, else from FLOPs): ``layerwise_chooser``. Where a plugin has no per-layer hook it
    sends whole requests and says so once.
    """

    WHAT: ClassVar[str] = "kvbridge"  # how errors name these settings

    host: str = "127.0.0.1"
    metadata_server: str = P2PHANDSHAKE
    protocol: str = "tcp"
    device_name: str = ""
    deadline_s: float = 60.0  # a room must finish within this after it starts
    heartbeat_s: float = 1.0  # receivers ping the senders they wait on this often
    peer_timeout_s: float = 10.0  # a peer silent this long is gone; its rooms fail (a busy prefill can be slow to answer)
    quiesce_s: float = 1.0  # a failing receiver reports Failed after this at most; blocks a sender may still write stay quarantined
    chunk_bytes: int = 64 << 20  # a sender prepares the gather of this much payload at a time
    secret: str = field(default="", repr=False)
    accepted_secrets: str = field(default="", repr=False, metadata={"parse": _comma_list})
    replay_window_s: float = 30.0  # a sealed frame older or newer than this is refused
    allow_insecure: bool = False  # a sender may bind a routable address without a secret
    model: str = ""  # model name both sides must agree on (empty: not checked)
    recv_staging_bytes: int = 0  # receiver: staging it offers senders (staged_recv plans); 0: none
    integrity: str = "off"  # receiver: "on" verifies every room's content digest, "sample" a fraction, "off" none
    integrity_sample: float = 0.1  # the fraction of rooms "sample" verifies (chosen by room id)
    integrity_hash: str = "auto"  # receiver: the digest it asks for: "xxh3", "torch", "auto" (torch where its pool is on a GPU)
    link: str = ""
    gather_threads: int = 0  # threads of the gather / scatter copy; 0: this host's choice for the protocol
    sglang_page_size: int = 1
    discovery_timeout_s: float = 30.0
    cost_gate_enabled: bool = False
    cost_model: str = ""
    cost_prefill_tps: float = 0.0
    cost_decode_prefill_tps: float = 0.0
    cost_queue_s: float = 0.0
    layerwise: bool | str = field(default=False, metadata={"parse": parse_layerwise})

    def __post_init__(self) -> None:
        object.__setattr__(self, "layerwise", parse_layerwise(self.layerwise))  # frozen: normalised once here
        for name in ("deadline_s", "heartbeat_s", "peer_timeout_s", "quiesce_s", "replay_window_s", "discovery_timeout_s",
                     "sglang_page_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not _HOST.fullmatch(self.host):
            raise ConfigError(f"host {self.host!r} is not a host name or address")
        if self.metadata_server != P2PHANDSHAKE and not _METADATA.fullmatch(self.metadata_server):
            raise ConfigError(f"metadata_server {self.metadata_server!r} is not {P2PHANDSHAKE}, a URL "
                              "(http://host:port/metadata) or an etcd host:port")
        if not _DEVICES.fullmatch(self.device_name):
            raise ConfigError(f"device_name {self.device_name!r} is not a comma-separated list of device names")
        for name in ("cost_prefill_tps", "cost_decode_prefill_tps", "cost_queue_s", "recv_staging_bytes", "gather_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        try:
            from .auth import Keyring

            Keyring.from_settings(self.secret, self.accepted_list, self.replay_window_s)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.integrity not in INTEGRITY_MODES:
            raise ConfigError(f"integrity must be one of {', '.join(INTEGRITY_MODES)}, got {self.integrity!r}")
        if self.integrity_hash not in INTEGRITY_HASHES:
            raise ConfigError(f"integrity_hash must be one of {', '.join(INTEGRITY_HASHES)}, got {self.integrity_hash!r}")
        if not 0.0 <= self.integrity_sample <= 1.0:
            raise ConfigError(f"integrity_sample must be within [0, 1], got {self.integrity_sample}")
        if self.accepted_secrets and not self.secret:
            raise ConfigError("accepted_secrets is set without a secret to sign with")
        if self.chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        try:
            self.link_profile()
        except ValueError as e:
            raise ConfigError(f"link: {e}") from None

    @property
    def accepted_list(self) -> tuple[str, ...]:
        """``accepted_secrets`` as a tuple of keys."""
        return tuple(k.strip() for k in self.accepted_secrets.split(",") if k.strip())

    def keyring(self):
        """A ``kvbridge.common.auth.Keyring`` for these secrets (None: auth off)."""
        from .auth import Keyring

        return Keyring.from_settings(self.secret, self.accepted_list, self.replay_window_s)

    def link_profile(self) -> LinkProfile:
        """The link: ``link``, else the preset of ``protocol``; resolved once per settings
        object (every cost these settings give comes from the same figures; a file is
        also read once per process, ``load_link``)."""
        link = self.__dict__.get("_link")
        if link is None:
            link = load_link(self.link, self.protocol)
            object.__setattr__(self, "_link", link)  # a cache beside the frozen fields, not a field
        return link

    def copy_choice(self):
        """The gather / scatter copy's threads and why (``kvbridge.common.copy_choice``),
        decided once per settings object (a host calibration is read or taken once)."""
        choice = self.__dict__.get("_copy_choice")
        if choice is None:
            from .copy_choice import choose

            choice = choose(self.protocol, self.gather_threads)
            object.__setattr__(self, "_copy_choice", choice)
        return choice

    def handoff(self, *, receiver: bool = False, **extra: Any) -> HandoffConfig:
        """The handoff state machines' settings, with the plan costs of this link
        (receiver staging only on the decode side); ``extra``: the transfer core's own
        ``HandoffConfig`` fields (``part_bytes``...), any other name refused."""
        own = {f.name for f in fields(HandoffConfig)} - _FROM_SETTINGS
        unknown = sorted(set(extra) - own)
        if unknown:
            raise ConfigError(f"unknown handoff fields {unknown}: the transfer core's own are {sorted(own)}; "
                              "the others come from the settings")
        return HandoffConfig(deadline_s=self.deadline_s, heartbeat_s=self.heartbeat_s,
                             peer_timeout_s=self.peer_timeout_s, quiesce_s=self.quiesce_s,
                             chunk_bytes=self.chunk_bytes, secret=self.secret, model=self.model,
                             accepted_secrets=self.accepted_list, replay_window_s=self.replay_window_s,
                             allow_insecure=self.allow_insecure, integrity=self.integrity,
                             integrity_sample=self.integrity_sample, integrity_hash=self.integrity_hash,
                             recv_staging_bytes=self.recv_staging_bytes if receiver else 0,
                             costs=self.link_profile().plan_costs(), gather_threads=self.copy_choice().threads, **extra)

    def transport(self):
        """This rank's Mooncake transport, bound to ``host`` (``device_name`` only off TCP)."""
        from .transport import MooncakeTransport

        return MooncakeTransport(self.host, self.metadata_server, self.protocol,
                                 self.device_name if self.protocol != "tcp" else "")

    @property
    def gate_on(self) -> bool:
        """Whether the decode side consults the cost gate."""
        return bool(self.cost_gate_enabled)

    def _served_config(self, served: Any) -> "str | Mapping[str, Any] | None":
        """The served model's config for the cost model from what the engine knows of it
        (here: a ``config.json`` path or a config dict, as given)."""
        return served

    def cost_gate(self, served: Any = None):
        """The per-request ``CostGate`` on this link, or None when the gate is off.
        ``served``: what the engine knows of the served model (``_served_config``), whose
        config is the geometry when ``cost_model`` is empty."""
        if not self.gate_on:
            return None
        from .gate import CostGate

        try:
            return CostGate.from_settings(self.link_profile(), self.cost_model, prefill_tps=self.cost_prefill_tps,
                                          decode_prefill_tps=self.cost_decode_prefill_tps, queue_s=self.cost_queue_s,
                                          default_model=self._served_config(served))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def sends_layerwise(self, prompt_tokens: int | None = None, chooser: Any = None) -> tuple[bool, str]:
        """Whether a request of ``prompt_tokens`` goes layer by layer, and why: the one
        decision every plugin asks (the SGLang prefill per armed request, the TensorRT-LLM
        scheduler per room). ``layerwise`` true or false forces it; "auto" asks ``chooser``
        (``layerwise_chooser()``'s answer) per prompt length, and sends whole without one.
        ``prompt_tokens`` None: may any request go layer by layer (the hooks' question)?"""
        if self.layerwise != LAYERWISE_AUTO:
            return bool(self.layerwise), f"layerwise={str(self.layerwise).lower()}"
        if prompt_tokens is None:
            return True, "layerwise=auto: decided per request"
        if chooser is None:
            return False, "layerwise=auto without a cost model: whole"
        est = chooser.choose(int(prompt_tokens))
        return bool(est.layerwise), est.reason

    def layerwise_chooser(self, served: Any = None):
        """The per-request layer-wise decision (``kvbridge.common.gate.LayerwiseChooser``)
        when ``layerwise`` is "auto", else None (``layerwise`` itself is the answer).
        ``served`` as in ``cost_gate``."""
        if self.layerwise != LAYERWISE_AUTO:
            return None
        from .gate import LayerwiseChooser

        try:
            return LayerwiseChooser.from_settings(self.link_profile(), self.cost_model, prefill_tps=self.cost_prefill_tps,
                                                  default_model=self._served_config(served))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def load(cls: type[T], base: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None,
             overrides: Mapping[str, Any] | None = None, defaults: Mapping[str, Any] | None = None) -> T:
        """Settings from, later sources winning: ``defaults`` (the engine's own), the file
        named by ``KVBRIDGE_CONFIG``, ``base`` (an engine's config mapping), environment
        variables ``KVBRIDGE_<FIELD>`` (upper case; ``environ``, default the process's),
        ``overrides``. Values are converted to each field's type; unknown names in a file or
        mapping and malformed values raise ConfigError naming the setting."""
        env = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        path = env.get(CONFIG_ENV, "")
        layers = [defaults or {}, _read_mapping_file(path, CONFIG_ENV) if path else {}, base or {}]
        values: dict[str, Any] = {}
        for source in layers + [overrides or {}]:
            unknown = sorted(set(source) - set(known))
            if unknown:
                raise ConfigError(f"unknown {cls.WHAT} settings {unknown}; known: {sorted(known)}")
        for source in layers:
            values.update(source)
        for name in known:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = raw
        values.update(overrides or {})
        return cls(**{name: _typed(name, v, known[name].default, known[name].metadata.get("parse"))
                      for name, v in values.items()})


def handoff_config(values: Mapping[str, Any], *, receiver: bool = False) -> HandoffConfig:
    """A ``HandoffConfig`` from one mapping of shared settings and transfer-core fields, for
    code that runs the core without a plugin (benches, tests): ``BridgeSettings.load``
    with them as overrides and no environment, then ``handoff``; unknown names refused."""
    shared = {f.name for f in fields(BridgeSettings)}
    settings = BridgeSettings.load(overrides={k: v for k, v in values.items() if k in shared}, environ={})
    return settings.handoff(receiver=receiver, **{k: v for k, v in values.items() if k not in shared})


# the HandoffConfig fields BridgeSettings.handoff() fills from the settings
_FROM_SETTINGS = frozenset({"deadline_s", "heartbeat_s", "peer_timeout_s", "quiesce_s", "chunk_bytes", "secret", "model",
                            "accepted_secrets", "replay_window_s", "allow_insecure", "integrity", "integrity_sample",
                            "integrity_hash", "recv_staging_bytes", "costs", "gather_threads"})


def _typed(name: str, v: Any, default: Any, parse: Any = None) -> Any:
    if parse is not None:
        return parse(v)
    kind = type(default)
    if isinstance(v, kind):
        return v
    if kind is bool:
        s = str(v).strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
        raise ConfigError(f"setting {name}={v!r} is not a boolean (true/false)")
    try:
        return kind(v)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"setting {name}={v!r} is not a {kind.__name__}: {e}") from None


def _read_mapping_file(path: str, what: str) -> dict[str, Any]:
    """A mapping of settings from a JSON or YAML (``.yaml`` / ``.yml``) file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path!r}: {e}") from None
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings")
    return data
