"""Run in the vLLM venv: two fp8 caches as vLLM's GPU backends get them (logical views of
one uint8 allocation, ``create_kv_cache_views``), each behind attention layers whose KV
scales vLLM's own ``BaseKVCacheMethod`` loaded from a checkpoint (``create_weights``, the
loader's fill, ``process_weights_after_loading``): the prefill's 1.0 everywhere, the
decode's layer 1 at 0.5. The connector's layout of each (``layout_from_vllm``'s GPU path)
must carry those scales, so the pair is refused naming layer 1 and both scales, while two
caches with the same scales are compatible. Prints one JSON line."""

import json

import torch
from vllm.model_executor.layers.attention.attention import set_default_quant_scales
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, compute_layout_strides, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge.adapters.vllm.worker import _logical_layout
from kvbridge.layout import LayoutError, check_compatible

L, NB, BS, H, HD = 2, 6, 16, 4, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def caches():
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=HD, dtype=torch.uint8)
    layer_stride, block_stride, _, _, _ = compute_layout_strides(spec, NB, L, KVCacheLayout.LBNHC)
    t = KVCacheTensor(size=L * NB * spec.page_size_bytes, layers=NAMES, layer_stride=layer_stride,
                      block_stride=block_stride)
    return dict(zip(NAMES, create_kv_cache_views(torch.zeros(t.size, dtype=torch.int8), spec, NB, KVCacheLayout.LBNHC, t)))


def layers(scales):
    out = {}
    for name, s in zip(NAMES, scales):
        layer = torch.nn.Module()
        layer.head_size, layer.head_size_v, layer.kv_cache_dtype = HD, HD, "fp8"
        set_default_quant_scales(layer, register_buffer=True)
        method = BaseKVCacheMethod(None)
        method.create_weights(layer)
        layer.k_scale.data.fill_(s)  # what the checkpoint loader writes
        layer.v_scale.data.fill_(s)
        method.process_weights_after_loading(layer)
        out[name] = layer
    return out


def layout(scales):
    return _logical_layout(caches(), NAMES, layers(scales), mla=False, backend="FLASH_ATTN", cache_dtype="fp8",
                           total=H, tp_rank=0, tp_size=1)


pre, dec, same = layout([1.0, 1.0]), layout([1.0, 0.5]), layout([1.0, 0.5])
res = {"dtype": dec.dtype, "decode_scales": dec.scales[:, :, 0].tolist()}
try:
    check_compatible(pre, dec)
    res["refused"] = ""
except LayoutError as e:
    res["refused"] = str(e)
try:
    check_compatible(same, dec)
    res["same_ok"] = True
except LayoutError as e:
    res["same_ok"] = str(e)
print(json.dumps(res))
