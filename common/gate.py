"""Per-request cost-model decisions: move this request's KV, or compute its prompt on the
decode side (``CostGate``)? Send it layer by layer during the prefill, or whole after it
(``LayerwiseChooser``, the ``layerwise: auto`` setting)?

Every engine plugin that supports it consults a ``CostGate`` on the decode side when
one is configured (off by default; settings ``cost_gate_enabled``, ``link``,
``cost_model``, ``cost_prefill_tps``, ``cost_decode_prefill_tps``, ``cost_queue_s`` of
``kvbridge.common.settings.BridgeSettings``, documented in docs/settings.md).

The verdict for a request comes from its prompt length and the prompt tokens the decode
worker already holds (``kvbridge.common.costmodel.decide``): "move" when the prefill
worker's first token plus the handoff comes before the decode worker's own prefill.
No engine is imported here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import math

from .costmodel import (MODEL_PRESETS, Decision, LayerwiseEstimate, LinkProfile, ModelGeometry, break_even_prompt_len,
                        decide, decide_layerwise, load_link)

__all__ = ["CostGate", "GateVerdict", "LayerwiseChooser", "FALLBACK_BELOW_BREAK_EVEN", "RECOMPUTE_PREFIX"]

log = logging.getLogger(__name__)

FALLBACK_BELOW_BREAK_EVEN = "below_break_even"  # the Prometheus ``reason`` label of a gate fallback
RECOMPUTE_PREFIX = "recompute: below break-even"  # how every gate fallback's reason starts


def model_geometry(spec: str | Mapping[str, Any] | ModelGeometry, dtype_bytes: int = 2) -> ModelGeometry:
    """A ``ModelGeometry`` from a preset name, the path of a Hugging Face ``config.json``
    (or its directory), or a config as a dict."""
    if isinstance(spec, ModelGeometry):
        return spec
    if isinstance(spec, Mapping):
        return ModelGeometry.from_hf_dict(dict(spec), dtype_bytes)
    if spec in MODEL_PRESETS:
        return MODEL_PRESETS[spec]
    p = Path(spec)
    if (p / "config.json").is_file() or p.is_file():
        return ModelGeometry.from_hf_config(p, dtype_bytes)
    raise ValueError(f"cost model {spec!r}: not a preset ({', '.join(MODEL_PRESETS)}) nor a config.json or its directory")


@dataclass(frozen=True)
class GateVerdict:
    """One request's verdict: ``move`` its KV, or recompute it on the decode side (``reason``
    starts with ``RECOMPUTE_PREFIX`` then)."""

    move: bool
    reason: str
    prompt_len: int
    held_tokens: int
    decision: Decision | None

    @property
    def label(self) -> str:
        """The Prometheus ``reason`` label of a fallback ('' when moving)."""
        return "" if self.move else FALLBACK_BELOW_BREAK_EVEN


class CostGate:
    """The cost model applied per request on a decode worker (see the module doc)."""

    def __init__(self, model: ModelGeometry, link: LinkProfile, *, prefill_tps: float = 0.0,
                 decode_prefill_tps: float = 0.0, queue_s: float = 0.0):
        for name, v in (("prefill_tps", prefill_tps), ("decode_prefill_tps", decode_prefill_tps), ("queue_s", queue_s)):
            if v < 0:
                raise ValueError(f"cost gate: {name} must be >= 0, got {v}")
        self.model, self.link = model, link
        self._kw = dict(prefill_tps=prefill_tps or None, decode_prefill_tps=decode_prefill_tps or None, queue_s=queue_s)
        self.break_even = break_even_prompt_len(model, link, lo=2, **self._kw)

    @classmethod
    def from_settings(cls, link: "str | LinkProfile" = "", model: str | Mapping[str, Any] | ModelGeometry = "", *,
                      prefill_tps: float = 0.0, decode_prefill_tps: float = 0.0, queue_s: float = 0.0,
                      default_model: str | Mapping[str, Any] | None = None) -> "CostGate | None":
        """The gate for these settings, or None when ``link`` is empty (gate off). ``link``:
        a ``LinkProfile``, a preset name or a ``kvbridge bench link --out`` file.
        ``default_model`` is used when ``model`` is empty (the served model's config)."""
        if not link:
            return None
        spec = model or default_model
        if not spec:
            raise ValueError("cost gate: no model geometry: set cost_model to a preset or a "
                             "config.json (the served model's config could not be found)")
        gate = cls(model_geometry(spec), link if isinstance(link, LinkProfile) else load_link(link), prefill_tps=float(prefill_tps),
                   decode_prefill_tps=float(decode_prefill_tps), queue_s=float(queue_s))
        log.info("kvbridge cost gate on: %s, %s; moves prompts from %s tokens", gate.model.name, gate.link.describe(),
                 gate.break_even if gate.break_even is not None else "never")
        return gate

    def check(self, prompt_len: int, held_tokens: int = 0) -> GateVerdict:
        """Verdict for a prompt of ``prompt_len`` tokens of which the decode worker holds
        the first ``held_tokens`` (nothing left to move: moving trivially wins)."""
        if prompt_len <= 0:
            raise ValueError(f"prompt_len must be positive, got {prompt_len}")
        held = max(0, int(held_tokens))
        if held >= prompt_len:
            return GateVerdict(True, "nothing to move", prompt_len, held, None)
        d = decide(self.model, self.link, prompt_len, held_tokens=held, **self._kw)
        be = f"{self.break_even} tokens" if self.break_even is not None else "never"
        if d.move:
            reason = f"move: first token after {d.disaggregated_ttft_s * 1e3:.2f} ms vs {d.local_ttft_s * 1e3:.2f} ms recomputing"
        else:
            reason = (f"{RECOMPUTE_PREFIX} ({prompt_len} prompt tokens, {held} held; break-even {be}): first token after "
                      f"{d.local_ttft_s * 1e3:.2f} ms recomputing on the decode worker vs {d.disaggregated_ttft_s * 1e3:.2f} ms "
                      f"through the prefill worker and a {d.handoff.bytes} B handoff over {self.link.name}")
        return GateVerdict(d.move, reason, prompt_len, held, d)


class LayerwiseChooser:
    """``layerwise: auto`` on a prefill worker: per request, layer-wise sends when the cost
    model (``kvbridge.common.costmodel.decide_layerwise``) predicts an earlier first
    token than a whole send by more than ``margin``. Prompt lengths are rounded up to
    eight buckets per octave, each decided once (a decision plans the request)."""

    BUCKETS_PER_OCTAVE = 8

    def __init__(self, model: ModelGeometry, link: LinkProfile, *, prefill_tps: float = 0.0, margin: float = 0.1):
        if prefill_tps < 0:
            raise ValueError(f"layer-wise decision: prefill_tps must be >= 0, got {prefill_tps}")
        self.model, self.link, self.prefill_tps, self.margin = model, link, prefill_tps, margin
        self._cache: dict[int, LayerwiseEstimate] = {}
        self._told = False

    @classmethod
    def from_settings(cls, link: "str | LinkProfile", model: str | Mapping[str, Any] | ModelGeometry = "", *,
                      prefill_tps: float = 0.0, default_model: str | Mapping[str, Any] | None = None) -> "LayerwiseChooser":
        """The chooser for ``link`` (a ``LinkProfile``, a preset or a ``kvbridge bench link``
        file) and ``model`` (else ``default_model``, the served model's config)."""
        spec = model or default_model
        if not spec:
            raise ValueError("layerwise=auto needs the model geometry: set cost_model to a preset or a config.json "
                             "(the served model's config could not be found)")
        return cls(model_geometry(spec), link if isinstance(link, LinkProfile) else load_link(link),
                   prefill_tps=float(prefill_tps))

    def bucket(self, prompt_len: int) -> int:
        """The prompt length a decision for ``prompt_len`` is made at (rounded up)."""
        if prompt_len <= 16:
            return max(1, int(prompt_len))
        k = math.ceil(math.log2(prompt_len) * self.BUCKETS_PER_OCTAVE - 1e-9)
        return max(int(prompt_len), int(math.ceil(2 ** (k / self.BUCKETS_PER_OCTAVE))))

    def choose(self, prompt_len: int) -> LayerwiseEstimate:
        """The decision for a request of ``prompt_len`` tokens sent from its first."""
        if prompt_len <= 0:
            raise ValueError(f"prompt_len must be positive, got {prompt_len}")
        b = self.bucket(prompt_len)
        est = self._cache.get(b)
        if est is None:
            est = self._cache[b] = decide_layerwise(self.model, self.link, b, prefill_tps=self.prefill_tps or None,
                                                     margin=self.margin)
            log.debug("kvbridge layer-wise decision at %d tokens: %s", b, est.reason)
            if not self._told:
                self._told = True
                log.info("kvbridge layerwise=auto: %s, %s; first decision (%d tokens): %s", self.model.name,
                         self.link.describe(), b, est.reason)
        return est
