"""The fp8 KV scales an SGLang scheduler's model reads its cache with.

SGLang keeps one scale per tensor: each ``RadixAttention`` layer's ``k_scale_float`` and
``v_scale_float`` (``layers/radix_attention.py``; set from the checkpoint by
``BaseKVCacheMethod.process_weights_after_loading`` in ``layers/quantization/kv_cache.py``,
which refuses anything but per-tensor scales; None without a quantization config). The
backends that quantize with them divide by the scale on write and multiply on read; the
``UNSCALED_BACKENDS`` never pass a scale to ``set_kv_buffer`` nor apply one on read (no
``k_scale`` in ``torch_native_backend.py``, ``torch_flex_backend.py``,
``wave_backend.py``), so their scale is 1.0 whatever the checkpoint says.

``record_scales`` is a BEFORE hook on ``Scheduler.init_disaggregation``: the scheduler
calls it after its model is loaded and before it builds its KV manager, in each
scheduler process (one per TP rank). The manager then asks ``kv_scales`` for its layers.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

__all__ = ["INIT_DISAGGREGATION", "UNSCALED_BACKENDS", "record_scales", "scales_of_model", "kv_scales"]

log = logging.getLogger(__name__)

INIT_DISAGGREGATION = "sglang.srt.managers.scheduler.Scheduler.init_disaggregation"
UNSCALED_BACKENDS = frozenset({"torch_native", "flex_attention", "wave"})

_lock = threading.Lock()
_recorded: dict[str, Any] = {}  # this scheduler process's model: {"layers": {layer_id: (k, v)}, "backends": (p, d)}


def scales_of_model(model: Any) -> dict[int, tuple[float, float]]:
    """``{layer_id: (k scale, v scale)}`` of every ``RadixAttention`` in ``model`` (1.0
    where SGLang keeps None)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    out: dict[int, tuple[float, float]] = {}
    for m in model.modules():
        if isinstance(m, RadixAttention):
            k, v = m.k_scale_float, m.v_scale_float
            out[int(m.layer_id)] = (float(k) if k is not None else 1.0, float(v) if v is not None else 1.0)
    return out


def record_scales(*args, **kwargs):
    """BEFORE hook on ``Scheduler.init_disaggregation`` (scheduler process, once its model
    is loaded): note the target model's scales and attention backends. Never raises."""
    try:
        scheduler = args[0] if args else kwargs.get("self")
        runner = scheduler.tp_worker.model_runner
        backends = (getattr(runner, "prefill_attention_backend_str", None),
                    getattr(runner, "decode_attention_backend_str", None))
        layers = scales_of_model(runner.model)
        with _lock:
            _recorded.update(layers=layers, backends=backends)
        log.info("kvbridge: the model's KV scales noted: %d attention layer(s), attention backends %s (prefill, "
                 "decode)", len(layers), backends)
    except Exception:  # the manager then refuses an fp8 cache (its scales unknown)
        log.exception("kvbridge: cannot read the model's KV scales")
    return None


def kv_scales(num_layers: int, layer_offset: int, kv_factor: int, decode: bool) -> np.ndarray | None:
    """float64 ``[num_layers, kv_factor]``: the scale of each (layer, K/V) this rank's KV
    is written (prefill) or read (decode) with, from what ``record_scales`` noted; None
    when nothing was noted."""
    with _lock:
        layers, backends = _recorded.get("layers"), _recorded.get("backends", (None, None))
    if layers is None:
        return None
    out = np.ones((num_layers, kv_factor))
    if backends[1 if decode else 0] in UNSCALED_BACKENDS:
        return out
    for i in range(num_layers):
        k, v = layers.get(layer_offset + i, (1.0, 1.0))
        out[i] = (k, v)[:kv_factor]
    return out
