"""The settings every engine plugin shares, and the one reader of them.

``BridgeSettings`` holds what all three adapters (SGLang, TensorRT-LLM, vLLM) configure
alike: handoff timing and auth, the Mooncake protocol, the link description the plans
and the cost model use, and the per-request cost gate. Each adapter's config subclasses
it with its own engine-specific fields (and its own defaults where they differ).
``read_settings`` builds any of them from a mapping (a JSON/YAML file or an engine's
config object), environment variables ``<prefix><FIELD>`` and explicit overrides, later
sources winning, with typed values and unknown names refused. The table of settings is
in the README ("Settings"); the names are the same in every plugin.

Nothing here imports an engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, TypeVar

from .costmodel import LinkProfile, resolve_link
from .rooms import INTEGRITY_MODES, HandoffConfig

__all__ = ["BridgeSettings", "ConfigError", "LAYERWISE_AUTO", "parse_layerwise", "read_settings", "read_mapping_file"]

T = TypeVar("T", bound="BridgeSettings")

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


@dataclass(frozen=True)
class BridgeSettings:
    """Settings shared by every kvbridge engine plugin (seconds unless named otherwise).

    Handoff: ``deadline_s``, ``heartbeat_s``, ``peer_timeout_s``, ``quiesce_s``,
    ``chunk_bytes`` (see ``HandoffConfig``). Auth (``kvbridge.common.auth``): ``secret``
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
    Transport: ``protocol`` (Mooncake's: ``tcp``, ``rdma``, ``nvlink``).
    Link: ``link``, a preset (``tcp``, ``rdma``, ``nvlink``, ``pcie5``, ``ib400``) or a
    ``kvbridge bench link --out`` file; empty: the preset of ``protocol``. It sets both
    the plan chooser's costs (``HandoffConfig.costs``) and the cost gate's figures.
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

    # the handoff's defaults are HandoffConfig's, written there once
    deadline_s: float = HandoffConfig.deadline_s
    heartbeat_s: float = HandoffConfig.heartbeat_s
    peer_timeout_s: float = HandoffConfig.peer_timeout_s
    quiesce_s: float = HandoffConfig.quiesce_s
    chunk_bytes: int = HandoffConfig.chunk_bytes
    secret: str = field(default="", repr=False)
    accepted_secrets: str = field(default="", repr=False)
    replay_window_s: float = HandoffConfig.replay_window_s
    allow_insecure: bool = HandoffConfig.allow_insecure
    model: str = HandoffConfig.model
    recv_staging_bytes: int = HandoffConfig.recv_staging_bytes
    integrity: str = HandoffConfig.integrity
    integrity_sample: float = HandoffConfig.integrity_sample
    protocol: str = "tcp"
    link: str = ""
    cost_gate_enabled: bool = False
    cost_model: str = ""
    cost_prefill_tps: float = 0.0
    cost_decode_prefill_tps: float = 0.0
    cost_queue_s: float = 0.0
    layerwise: bool | str = field(default=False, metadata={"parse": parse_layerwise})

    def __post_init__(self) -> None:
        object.__setattr__(self, "layerwise", parse_layerwise(self.layerwise))  # frozen: normalised once here
        for name in ("deadline_s", "heartbeat_s", "peer_timeout_s", "quiesce_s", "replay_window_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("cost_prefill_tps", "cost_decode_prefill_tps", "cost_queue_s", "recv_staging_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        try:
            from .auth import Keyring

            Keyring.from_settings(self.secret, self.accepted_list, self.replay_window_s)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.integrity not in INTEGRITY_MODES:
            raise ConfigError(f"integrity must be one of {', '.join(INTEGRITY_MODES)}, got {self.integrity!r}")
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
        object (a measured-link file is read once: every cost these settings give comes
        from the same figures)."""
        link = self.__dict__.get("_link")
        if link is None:
            link = resolve_link(self.link, self.protocol)
            object.__setattr__(self, "_link", link)  # a cache beside the frozen fields, not a field
        return link

    def handoff(self, *, receiver: bool = False, **extra: Any) -> HandoffConfig:
        """The handoff state machines' settings, with the plan costs of this link
        (receiver staging only on the decode side); ``extra``: other ``HandoffConfig``
        fields."""
        return HandoffConfig(deadline_s=self.deadline_s, heartbeat_s=self.heartbeat_s,
                             peer_timeout_s=self.peer_timeout_s, quiesce_s=self.quiesce_s,
                             chunk_bytes=self.chunk_bytes, secret=self.secret, model=self.model,
                             accepted_secrets=self.accepted_list, replay_window_s=self.replay_window_s,
                             allow_insecure=self.allow_insecure, integrity=self.integrity,
                             integrity_sample=self.integrity_sample,
                             recv_staging_bytes=self.recv_staging_bytes if receiver else 0,
                             costs=self.link_profile().plan_costs(), **extra)

    @property
    def gate_on(self) -> bool:
        """Whether the decode side consults the cost gate."""
        return bool(self.cost_gate_enabled)

    def make_cost_gate(self, default_model: str | Mapping[str, Any] | None = None):
        """The per-request ``CostGate`` on this link, or None when the gate is off.
        ``default_model``: the served model's config (a path or a dict), used when
        ``cost_model`` is empty."""
        if not self.gate_on:
            return None
        from .gate import CostGate

        try:
            return CostGate.from_settings(self.link_profile(), self.cost_model, prefill_tps=self.cost_prefill_tps,
                                          decode_prefill_tps=self.cost_decode_prefill_tps, queue_s=self.cost_queue_s,
                                          default_model=default_model)
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

    def layerwise_chooser(self, default_model: str | Mapping[str, Any] | None = None):
        """The per-request layer-wise decision (``kvbridge.common.gate.LayerwiseChooser``)
        when ``layerwise`` is "auto", else None (``layerwise`` itself is the answer).
        ``default_model``: the served model's config, used when ``cost_model`` is empty."""
        if self.layerwise != LAYERWISE_AUTO:
            return None
        from .gate import LayerwiseChooser

        try:
            return LayerwiseChooser.from_settings(self.link_profile(), self.cost_model, prefill_tps=self.cost_prefill_tps,
                                                  default_model=default_model)
        except ValueError as e:
            raise ConfigError(str(e)) from None


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


# settings every plugin also reads as KVBRIDGE_<NAME> (below its own prefix): the deployment's keys
DEPLOYMENT_WIDE = ("secret", "accepted_secrets", "replay_window_s", "allow_insecure", "integrity", "integrity_sample")


def read_settings(cls: type[T], base: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None,
                  prefix: str = "KVBRIDGE_", overrides: Mapping[str, Any] | None = None, what: str = "kvbridge") -> T:
    """``cls`` from ``base`` (a file's or an engine config's mapping), then environment
    variables ``prefix + FIELD`` (upper case; for ``DEPLOYMENT_WIDE`` fields also
    ``KVBRIDGE_FIELD``), then ``overrides``; values are converted
    to each field's type; unknown names in ``base`` or ``overrides`` raise ConfigError."""
    env = os.environ if environ is None else environ
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for source in (base or {}), (overrides or {}):
        unknown = sorted(set(source) - set(known))
        if unknown:
            raise ConfigError(f"unknown {what} settings {unknown}; known: {sorted(known)}")
    values.update(base or {})
    for name in known:
        raw = env.get(prefix + name.upper())
        if raw is None and name in DEPLOYMENT_WIDE:
            raw = env.get("KVBRIDGE_" + name.upper())  # one key for the whole deployment, whatever the plugin
        if raw is not None:
            values[name] = raw
    values.update(overrides or {})
    return cls(**{name: _typed(name, v, known[name].default, known[name].metadata.get("parse"))
                  for name, v in values.items()})


def read_mapping_file(path: str, what: str = "config file") -> dict[str, Any]:
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

