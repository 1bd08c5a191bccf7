"""``kvbridge route`` with a vLLM decode answers as vLLM's own OpenAI server does: the
checks of ``tests.helpers.route_client`` that SGLang's decode and the TensorRT-LLM
stand-in pass too, here against vLLM's REAL servers (``vllm_servers`` of
tests/vllm/conftest.py, which test_vllm_servers.py uses too: two ``kv_both`` servers,
``--max-model-len 2048``). In tests/vllm, not tests/route, to share those servers."""

from __future__ import annotations

import pytest

from kvbridge.demo.models import random_prompt, reference_generate
from tests.helpers import route_client as rc
from tests.helpers.vllm_env import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

EOS_PROMPT = (40, 213)  # the head_dim-32 Llama's greedy answer has EOS as its 3rd token


def _router(model_dir, vllm_servers):
    from kvbridge.route.app import BackgroundRouter
    from kvbridge.route.config import parse_config
    from kvbridge.demo.route_local import route_yaml

    v0, v1 = vllm_servers
    servers = [{"name": "v0", "engine": "vllm", "role": "prefill", "url": v0.url, "bootstrap": v0.bootstrap_address,
                "model": str(model_dir)},
               {"name": "v1", "engine": "vllm", "role": "decode", "url": v1.url, "model": str(model_dir)}]
    cfg = {"model": {"name": "tiny-llama", "tokenizer": str(model_dir), "aliases": ["tiny"],
                     "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"},
           "servers": servers, "cost": {"enabled": False}, "deadlines": {"request_s": 120, "prefill_s": 60}}
    return BackgroundRouter(parse_config(route_yaml(cfg)))


def test_openai_edges_answer_as_vllm_itself(model_dir, vllm_servers):
    """vLLM's own ``/v1/completions`` and the router in front of a vLLM prefill and decode
    answer alike: stop strings trimmed (kept with ``include_stop_str_in_output``), the
    stop in ``stop_reason``, the ids up to it, the answer ended at EOS, streamed and not;
    a seeded sampled request is reproducible, as vLLM's own; requests over the context
    400 before any server is asked; unknown models 404, aliases, chat parts, JSON errors."""
    own = rc.client_of(vllm_servers[1].url)
    prompt, eos_prompt = random_prompt(50, seed=7), random_prompt(EOS_PROMPT[0], seed=EOS_PROMPT[1])
    ref = reference_generate(model_dir, prompt, 12).token_ids
    eos_ref = reference_generate(model_dir, eos_prompt, 8).token_ids
    k, e = rc.stop_at(ref), eos_ref.index(rc.EOS_ID)
    stop = f"w{ref[k]}"
    for keep in (False, True):
        c = own.completions.create(model=str(model_dir), prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                   extra_body={"include_stop_str_in_output": keep}).choices[0]
        assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (
            rc.words(ref[:k]) + " " + (stop if keep else ""), "stop", stop), c
    c = own.completions.create(model=str(model_dir), prompt=eos_prompt, max_tokens=8, temperature=0).choices[0]
    assert (c.text, c.finish_reason) == (rc.words(eos_ref[:e]), "stop"), c
    sampled = dict(prompt=prompt, max_tokens=8, temperature=0.9, seed=11)
    vllm_seeded = own.completions.create(model=str(model_dir), **sampled, extra_body={"return_token_ids": True})
    with _router(model_dir, vllm_servers) as router:
        client = rc.client_of(router.url)
        rc.check_stop_strings(client, prompt, ref)
        rc.check_eos(client, eos_prompt, eos_ref)
        rc.check_openai_surface(router.url, prompt, ref[:6], alias="tiny")
        twice = [client.completions.create(model="tiny-llama", **sampled).choices[0] for _ in range(2)]
        assert twice[0].model_extra["token_ids"] == twice[1].model_extra["token_ids"] == \
            vllm_seeded.choices[0].model_extra["token_ids"], (twice, vllm_seeded)
        assert router.router.pool.by_name["v1"].caps.context_length == 2048  # vLLM's max_model_len, as published
        served = {s["name"]: s["served"] for s in router.router.pool.snapshot()}
        rc.check_refusals(client, 2048)
        assert {s["name"]: s["served"] for s in router.router.pool.snapshot()} == served, "a refused request was sent"
        m = router.router.metrics
        assert not [x for f in m.registry.collect() for x in f.samples
                    if x.name in ("kvbridge_route_retries_total", "kvbridge_route_room_aborts_total") and x.value]
