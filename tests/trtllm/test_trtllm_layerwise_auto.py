"""``layerwise: auto`` in the TensorRT-LLM plugin: the prefill's scheduler asks the cost
model per request, when the room opens, and sends layer by layer only where it predicts
an earlier first token. Under the stand-in (one OS process per rank, Mooncake TCP on
127.0.0.1, the tiny Llama's real forward).

The link is described by a file (a slow link with costly write batches) so that the
decision differs between a short and a long prompt; what the test checks is the outcome
on the wire (layer pieces, how the room ended) and the decode's tokens against
transformers' ``generate()``, with the expected decision worked out here by hand."""

from __future__ import annotations

import json

import pytest

from kvbridge.adapters.trtllm import Handle, announce
from kvbridge.demo.models import random_prompt, reference_generate
from tests.helpers.trtllm_servers import check_clean, wait_done

MAX_NEW = 4
LAYERS = 2


def test_auto_decides_per_request(trt_servers, tiny_llama_dir, tmp_path):
    """1 MB/s, no setup, 5 ms per write batch, a prefill of 4000 tokens/s. The tiny Llama
    as the cost model sees it (2 layers x K,V x 2 heads x 16 x 2 B = 256 B/token):
    16 tokens: 4 ms prefill, 4.1 ms whole transfer, each layer's send 2 ms + 5 ms: layer by
    layer >= 2 + 14 ms against ~8 ms whole -> whole. 400 tokens: 100 ms prefill, 102 ms
    whole; layer sends 51 + 5 ms: max(50 + 112, 100 + 56) = 162 ms against ~202 ms -> layer-wise."""
    link = tmp_path / "slow-link.json"
    link.write_text(json.dumps({"name": "slow", "bandwidth_bytes_per_s": 1e6, "per_segment_s": 1e-6, "setup_s": 0.0,
                                "repack_bytes_per_s": 1e12, "per_batch_s": 5e-3}))
    pre = trt_servers("main", tiny_llama_dir, tp=1, tokens_per_block=16, num_blocks=64,
                      plugin={"layerwise": "auto", "link": str(link), "cost_prefill_tps": 4000.0})
    dec = trt_servers("main", tiny_llama_dir, tp=1, tokens_per_block=32, num_blocks=48)
    for room, n, pieces, ended in ((701, 16, 0, "send"), (702, 400, LAYERS, "finish")):
        p = random_prompt(n, seed=70 + n)
        announce(pre.bus, p, Handle("send", room))
        announce(dec.bus, p, Handle("recv", room, prefill=pre.bus))
        a, d = pre.submit(p, 1), dec.submit(p, MAX_NEW)
        wait_done([pre, dec], dec, [d], timeout_s=120)
        assert dec.responses[d]["output_token_ids"] == reference_generate(tiny_llama_dir, p, MAX_NEW).token_ids, n
        sv = pre.state()["finished_saves"][a]
        assert sv["ok"] and sv["layer_pieces"] == pieces and sv["ended_by"] == ended, (n, sv)
        assert dec.state()["finished_loads"][d]["verdict"] == "ok"
    check_clean(dec)
    check_clean(pre)


def test_auto_refuses_without_a_geometry():
    from kvbridge.adapters.trtllm.config import BridgeConfig
    from kvbridge.common.settings import ConfigError

    cfg = BridgeConfig.load(overrides={"layerwise": "auto"}, environ={})
    assert cfg.layerwise == "auto"
    with pytest.raises(ConfigError, match="layerwise=auto needs the model geometry"):
        cfg.layerwise_chooser("/nonexistent")
    assert BridgeConfig.load(environ={"KVBRIDGE_LAYERWISE": "true"}).layerwise is True  # the bool forms still work
