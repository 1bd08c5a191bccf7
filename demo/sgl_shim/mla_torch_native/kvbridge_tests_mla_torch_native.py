"""SGLang general plugin (for the tests and demos on CPU): serve DeepSeek-style MLA models with --attention-backend torch_native.

Why: SGLang 0.5.23 picks a DeepSeek attention method per batch through
``AttentionBackendRegistry`` (srt/models/deepseek_common/attention_backend_handler.py).
``torch_native`` has no entry there, so it falls back to the ``triton`` rule, which
picks the MHA ("forward_normal") method for a prefill without cached prefix. That
method hands expanded per-head K/V to the backend with save_kv_cache=False, but
``TorchNativeAttnBackend.forward_extend`` ignores the K/V it is given and always
attends over the KV pool, which for MLA holds the 48-wide latent rows
(kv_lora_rank + qk_rope_head_dim), so SDPA fails with
"Expected size for first two dimensions of batch2 tensor to be: [4, 32] but got: [4, 48]".

This plugin registers a ``torch_native`` handler that always selects the absorbed
MLA method, which reads the latent pool as it is. The KV pool layout and what a
transfer backend moves are the same with either method (the latent rows).

It is loaded through SGLang's own plugin mechanism (entry-point group
``sglang.srt.plugins``, name ``kvbridge_tests_mla_torch_native``) only when
``kvbridge.demo.sglang_server`` puts this folder on a server's PYTHONPATH (MLA models).
"""


def register() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        AttnForwardMethod,
    )

    AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA)
