"""The cost model per prefill/decode pair: move this request's KV, or compute it where it lands?

One ``kvbridge.common.gate.CostGate`` per distinct link of the configuration (the link of a
pair comes from ``RouteConfig.link_spec``), all with the configuration's model geometry
and rates. The router asks before it dispatches a request, from its prompt length (no
decode server here reports the prefixes it holds, so ``held_tokens`` is 0).
"""

from __future__ import annotations

from pathlib import Path

from kvbridge.common.gate import CostGate, GateVerdict

from .config import ConfigError, RouteConfig, ServerSpec

__all__ = ["PairGates"]


class PairGates:
    """``verdict(prefill, decode, prompt_len)`` for every pair of a configuration."""

    def __init__(self, cfg: RouteConfig):
        self.enabled = cfg.cost.enabled
        self._cfg = cfg
        self._gates: dict[str, CostGate] = {}
        if not self.enabled:
            return
        from kvbridge.common.gate import model_geometry

        spec = cfg.cost.model or cfg.model.tokenizer
        if not cfg.cost.model and not (Path(spec) / "config.json").is_file():
            raise ConfigError(f"cost.model: not set and {spec}/config.json does not exist; name a preset or a config.json")
        try:
            self.model = model_geometry(spec, cfg.cost.kv_dtype_bytes)
        except (ValueError, OSError, KeyError) as e:
            raise ConfigError(f"cost.model: {e}") from None
        links = {cfg.link_spec(p, d) for p in cfg.by_role("prefill") for d in cfg.by_role("decode")}
        for link in sorted(links):
            self._gate(link)

    def _gate(self, link: str) -> CostGate:
        g = self._gates.get(link)
        if g is None:
            from kvbridge.common.costmodel import load_link

            c = self._cfg.cost
            g = CostGate(self.model, load_link(link), prefill_tps=c.prefill_tps, decode_prefill_tps=c.decode_prefill_tps,
                         queue_s=c.queue_s)
            self._gates[link] = g
        return g

    def verdict(self, prefill: ServerSpec, decode: ServerSpec, prompt_len: int) -> GateVerdict | None:
        """The gate's verdict for this pair (None when the gate is off: always move)."""
        if not self.enabled:
            return None
        return self._gate(self._cfg.link_spec(prefill, decode)).check(prompt_len)

    def break_even(self) -> dict[str, int | None]:
        """Per link: the prompt length from which moving wins (None: never)."""
        return {link: g.break_even for link, g in self._gates.items()}
