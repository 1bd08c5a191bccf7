"""``kvbridge route``'s pieces that need no server: the configuration and its errors, the
cost gate per pair, server choice and health transitions, admission limits, request
parsing and response shapes, stream parsing, incremental detokenization."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvbridge.common.costmodel import LINK_PRESETS, decide
from kvbridge.common.gate import model_geometry
from kvbridge.route.admission import Admission
from kvbridge.route.config import ConfigError, parse_config, pairable
from kvbridge.route.engines import (Sampling, completion_delta, sglang_delta, sglang_generate_body, sse_json,
                                    trtllm_completion_body, trtllm_delta)
from kvbridge.route.errors import RouteError
from kvbridge.route.gates import PairGates
from kvbridge.route.pool import ServerPool


def _yaml(servers: str, extra: str = "", tokenizer: str = "/nonexistent") -> str:
    return f"model: {{name: m, tokenizer: {tokenizer}}}\nservers:\n{servers}\n{extra}"


MIXED = """  - {name: p0, engine: sglang, role: prefill, url: "http://h:1", bootstrap: "h:2"}
  - {name: p1, engine: trtllm, role: prefill, url: "http://h:3", bus: "tcp://h:4"}
  - {name: d0, engine: sglang, role: decode, url: "http://h:5"}
  - {name: t0, engine: trtllm, role: decode, url: "http://h:6", bus: "tcp://h:7"}
  - {name: a0, engine: sglang, role: aggregated, url: "http://h:8"}"""


def test_config_defaults_pairs_and_links(tiny_model):
    cfg = parse_config(_yaml(MIXED, 'links: {default: tcp, "sglang->trtllm": ib400, "p1->d0": nvlink}', tiny_model))
    s = {x.name: x for x in cfg.servers}
    assert cfg.deadlines.request_s == 60 and cfg.limits.max_queue == 256 and cfg.retry.prefill_attempts == 2
    # a TensorRT-LLM prefill without a bootstrap address cannot feed an SGLang decode; everything else pairs
    assert pairable(s["p0"], s["d0"]) and pairable(s["p0"], s["t0"]) and pairable(s["p1"], s["t0"])
    assert not pairable(s["p1"], s["d0"]) and not pairable(s["d0"], s["p0"])
    assert cfg.link_spec(s["p0"], s["t0"]) == "ib400"  # by engines
    assert cfg.link_spec(s["p1"], s["d0"]) == "nvlink"  # by names, before engines
    assert cfg.link_spec(s["p0"], s["d0"]) == "tcp"  # default
    assert [x.name for x in cfg.servers if x.can_compute] == ["t0", "a0"]


@pytest.mark.parametrize("servers,extra,needle", [
    ("  - {name: p0, engine: sglang, role: prefill, url: 'http://h:1'}", "", "bootstrap"),
    ("  - {name: p0, engine: mxnet, role: prefill, url: 'http://h:1'}", "", "engine"),
    ("  - {name: v0, engine: vllm, role: prefill, url: 'http://h:1'}", "", "vLLM prefill needs its kvbridge bootstrap"),
    ("  - {name: v0, engine: vllm, role: decode, url: 'http://h:1', bus: 'tcp://h:2'}", "", "only TensorRT-LLM"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1', model: x}", "", "model"),
    ("  - {name: p0, engine: sglang, role: prefill, url: 'http://h:1', bootstrap: 'h:2'}\n"
     "  - {name: v1, engine: vllm, role: decode, url: 'http://h:3', bootstrap: 'h:4'}", "",
     "only prefill servers have a bootstrap"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'ftp://h:1'}", "", "url"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1'}\n"
     "  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:2'}", "", "used twice"),
    ("  - {name: t0, engine: trtllm, role: decode, url: 'http://h:1'}", "", "bus"),
    ("  - {name: p1, engine: trtllm, role: prefill, url: 'http://h:3', bus: 'tcp://h:4'}\n"
     "  - {name: d0, engine: sglang, role: decode, url: 'http://h:5'}", "", "no prefill it can pull from"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1'}", "links: {default: nowhere}", "nowhere"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1'}", "links: {'x->y': tcp}", "keys are"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1'}", "deadlines: {request_s: 0}", "request_s"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1'}", "retry: {prefill_attempts: 0}",
     "prefill_attempts"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1'}", "limits: {max_inflight: 0}", "limits"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1', colour: red}", "", "colour"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1'}", "deadlines: {request_s: soon}",
     "deadlines.request_s"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1', capabilities: {sampling: beam}}", "",
     "sampling"),
    ("  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:1', capabilities: {context_length: -1}}", "",
     "capabilities.context_length"),
])
def test_config_errors_name_the_key(servers, extra, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config(_yaml(servers, extra))


def test_config_file_paths_are_relative_to_it(tmp_path, tiny_model):
    from kvbridge.route.config import load_config

    link = {"name": "lab", "bandwidth_bytes_per_s": 2e9, "per_segment_s": 1e-5, "setup_s": 1e-3, "repack_bytes_per_s": 5e9}
    (tmp_path / "link.json").write_text(json.dumps(link))
    (tmp_path / "route.yaml").write_text(_yaml(MIXED, "links: {default: link.json}", tiny_model))
    cfg = load_config(tmp_path / "route.yaml")
    assert cfg.links["default"] == str(tmp_path / "link.json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


def test_gate_per_pair_is_the_cost_model(tiny_model):
    """The router's verdict for a pair is ``decide`` on that pair's link: below the
    break-even it says recompute, above it move; a faster link moves shorter prompts."""
    cfg = parse_config(_yaml(MIXED, "links: {default: tcp, 'sglang->trtllm': nvlink}\n"
                                    "cost: {prefill_tps: 20000, decode_prefill_tps: 10000}", tiny_model))
    s = {x.name: x for x in cfg.servers}
    gates = PairGates(cfg)
    geo = model_geometry(tiny_model, 2)
    for pair, link in (((s["p0"], s["d0"]), "tcp"), ((s["p0"], s["t0"]), "nvlink")):
        for n in (4, 16, 24, 40, 200):
            v = gates.verdict(*pair, n)
            d = decide(geo, LINK_PRESETS[link], n, prefill_tps=20000, decode_prefill_tps=10000)
            assert v.move == d.move, (link, n)
    be = gates.break_even()
    assert be["nvlink"] < be["tcp"], be
    assert not gates.verdict(s["p0"], s["d0"], be["tcp"] - 1).move and gates.verdict(s["p0"], s["d0"], be["tcp"]).move
    off = PairGates(parse_config(_yaml(MIXED, "cost: {enabled: false}", tiny_model)))
    assert off.verdict(s["p0"], s["d0"], 4) is None


VLLM_MIXED = """  - {name: v0, engine: vllm, role: prefill, url: "http://h:1", bootstrap: "h:2", model: /models/m}
  - {name: p0, engine: sglang, role: prefill, url: "http://h:3", bootstrap: "h:4"}
  - {name: p1, engine: trtllm, role: prefill, url: "http://h:5", bus: "tcp://h:6"}
  - {name: v1, engine: vllm, role: decode, url: "http://h:7"}
  - {name: d0, engine: sglang, role: decode, url: "http://h:8"}
  - {name: t0, engine: trtllm, role: decode, url: "http://h:9", bus: "tcp://h:10"}"""


def test_vllm_config_pairs_links_and_compute(tiny_model):
    """vLLM on either side: its prefill feeds every decode through its bootstrap server;
    its decode pulls from every prefill (a TensorRT-LLM one known only by its bus through
    the rank endpoints), and computes a request alone when given no handle."""
    cfg = parse_config(_yaml(VLLM_MIXED, 'links: {default: tcp, "vllm->sglang": ib400, "p1->v1": nvlink}', tiny_model))
    s = {x.name: x for x in cfg.servers}
    assert s["v0"].engine == "vllm" and s["v0"].model == "/models/m" and s["v1"].model == ""
    for p in ("v0", "p0", "p1"):
        assert pairable(s[p], s["v1"]) and pairable(s[p], s["t0"]), p
    assert pairable(s["v0"], s["d0"]) and not pairable(s["p1"], s["d0"]) and not pairable(s["v1"], s["v0"])
    assert cfg.link_spec(s["v0"], s["d0"]) == "ib400" and cfg.link_spec(s["p1"], s["v1"]) == "nvlink"
    assert cfg.link_spec(s["v0"], s["v1"]) == "tcp"
    assert [x.name for x in cfg.servers if x.can_compute] == ["v1", "t0"]
    pool = ServerPool(cfg)
    assert pool.pick_compute(prefer=pool.by_name["v1"]).name == "v1"  # a vLLM decode computes alone
    # a vLLM decode alone is a deployment: it computes everything; with a vLLM prefill it pulls
    assert parse_config(_yaml("  - {name: v1, engine: vllm, role: aggregated, url: 'http://h:1'}")).servers[0].can_compute
    with pytest.raises(ConfigError, match="no prefill it can pull from"):
        parse_config(_yaml("  - {name: v1, engine: vllm, role: decode, url: 'http://h:1'}\n"
                           "  - {name: a0, engine: sglang, role: aggregated, url: 'http://h:2'}"))


def test_pool_least_outstanding_exclusion_and_compute_targets(tiny_model):
    cfg = parse_config(_yaml(MIXED, "health: {fail_after: 2, pass_after: 2}", tiny_model))
    pool = ServerPool(cfg)
    by = pool.by_name
    with pool.lease(by["d0"], by["p0"]):
        p, d = pool.pick_pair()
        assert d.name == "t0"  # d0 is busier
        assert p.name == "p1"  # p0 is busier, and p1 feeds t0
        # d0 can only pull from p0 (p1 has no SGLang bootstrap): excluding p0 leaves t0
        assert pool.pick_pair(exclude=[by["p0"], by["t0"]]) is None
    assert pool.pick_compute(prefer=by["t0"]).name == "t0"  # a TensorRT-LLM decode computes alone
    assert pool.pick_compute(prefer=by["d0"]).name == "a0"  # an SGLang decode cannot: the aggregated server
    assert pool.pick_compute(exclude=[by["a0"]]).name == "t0"
    # health: two failures take a server out, two successes bring it back
    pool.observe(by["a0"], False, "x")
    assert by["a0"].healthy
    pool.observe(by["a0"], False, "y")
    assert not by["a0"].healthy and pool.pick_compute(prefer=by["d0"]).name == "t0"
    pool.observe(by["a0"], True)
    assert not by["a0"].healthy
    pool.observe(by["a0"], True)
    assert by["a0"].healthy
    pool.mark_down(by["t0"], "refused")
    pool.mark_down(by["d0"], "refused")
    assert pool.pick_pair() is None and pool.pick_compute().name == "a0" and pool.can_serve()
    pool.mark_down(by["a0"], "refused")
    assert not pool.can_serve()


def test_admission_429_when_the_queue_is_full_and_503_when_the_wait_ends():
    async def go():
        adm = Admission(max_inflight=1, max_queue=1, retry_after_s=2.0)
        held = asyncio.Event()
        release = asyncio.Event()

        async def holder():
            async with adm.slot(1.0):
                held.set()
                await release.wait()

        h = asyncio.create_task(holder())
        await held.wait()
        waiter = asyncio.create_task(_enter(adm, 5.0))
        await asyncio.sleep(0)  # the waiter queues
        assert adm.waiting == 1
        with pytest.raises(RouteError) as e429:
            async with adm.slot(5.0):
                pass
        assert e429.value.status == 429 and e429.value.retry_after == 2.0
        release.set()
        await h
        assert await waiter == "in"
        assert adm.inflight == 0 and adm.waiting == 0
        # a wait that outlives its deadline is a 503
        release.clear()
        held.clear()
        h = asyncio.create_task(holder())
        await held.wait()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(RouteError) as e503:
            async with adm.slot(0.2):
                pass
        assert e503.value.status == 503 and asyncio.get_running_loop().time() - t0 < 1.0
        release.set()
        await h

    asyncio.run(go())


async def _enter(adm, t):
    async with adm.slot(t):
        return "in"


def test_request_parsing_refuses_what_it_cannot_pass_on(codec):
    from kvbridge.route.protocol import parse_chat, parse_completion, parse_generate

    p = parse_completion({"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "stream": True,
                          "stream_options": {"include_usage": True}, "ignore_eos": True}, codec)
    assert p.ids == [5, 6, 7] and p.stream and p.include_usage and p.sampling == Sampling(4, 0.0, ignore_eos=True)
    assert parse_completion({"prompt": "w5 w6"}, codec).ids == codec.encode("w5 w6") == [5, 6]
    assert parse_completion({"prompt": ["w5"]}, codec).ids == [5]
    g = parse_generate({"input_ids": [9, 10], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}, codec)
    assert g.ids == [9, 10] and g.sampling.max_tokens == 3 and not g.stream
    c = parse_chat({"messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 2}, codec)
    assert c.ids == codec.encode("w7 w8 ") and c.sampling.max_tokens == 2
    for body, needle in (({"prompt": ["a", "b"]}, "one prompt"), ({"prompt": [1, 99999]}, "not a token id"),
                         ({"prompt": [1], "n": 2}, "'n'"), ({"prompt": [1], "logprobs": 2}, "logprobs"),
                         ({"prompt": [1], "frequency_penalty": 0.5}, "frequency_penalty"),
                         ({"prompt": [1], "temperature": 3}, "out of range"), ({"prompt": [1], "foo": 1}, "foo"),
                         ({"prompt": [1], "max_tokens": "x"}, "max_tokens"), ({"prompt": ""}, "empty")):
        with pytest.raises(RouteError, match=needle) as e:
            parse_completion(body, codec)
        assert e.value.status == 400
    with pytest.raises(RouteError, match="regex"):
        parse_generate({"text": "w5", "sampling_params": {"regex": "a+"}}, codec)
    with pytest.raises(RouteError, match="one of 'text'"):
        parse_generate({"text": "w5", "input_ids": [5]}, codec)


def test_engine_request_shapes():
    from kvbridge.route.config import ServerSpec
    from kvbridge.route.engines import Handoff, decode_handle

    s = Sampling(8, 0.0, top_k=1, ignore_eos=True, stop=("x",), seed=3)
    p_sg = ServerSpec(name="p", engine="sglang", role="prefill", url="http://h:1", bootstrap="10.0.0.1:8998")
    p_trt = ServerSpec(name="q", engine="trtllm", role="prefill", url="http://h:1", bus="tcp://10.0.0.2:18500")
    b = sglang_generate_body([1, 2], s, rid="r", stream=True, handoff=Handoff(42, p_sg))
    assert b == {"input_ids": [1, 2], "stream": True, "rid": "r", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
                 "bootstrap_room": 42, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0,
                                                           "top_k": 1, "ignore_eos": True, "stop": ["x"],
                                                           "sampling_seed": 3}}
    t = trtllm_completion_body("m", [1, 2], s, stream=False, max_tokens=1)
    assert t["prompt"] == [1, 2] and t["max_tokens"] == 1 and t["detokenize"] is False and t["seed"] == 3
    assert decode_handle(Handoff(42, p_sg), "fail").to_dict() == {"op": "recv", "room": 42, "bootstrap": "10.0.0.1:8998",
                                                                  "on_failure": "fail"}
    # the router's own lookup of the prefill's ranks wins over the connector's discovery
    assert decode_handle(Handoff(42, p_sg, ("tcp://10.0.0.1:5000",)), "fail").to_dict() == {
        "op": "recv", "room": 42, "endpoints": ["tcp://10.0.0.1:5000"], "on_failure": "fail"}
    assert decode_handle(Handoff(7, p_trt), "recompute").to_dict() == {"op": "recv", "room": 7,
                                                                       "prefill": "tcp://10.0.0.2:18500",
                                                                       "on_failure": "recompute"}


def test_vllm_request_shapes_and_prefill_answers():
    """Each vLLM half's body: token ids, ``return_token_ids``, its handle in
    ``kv_transfer_params`` (adapters/vllm/handle.py's shapes); a prefill's answer must hand
    back the decode half's handle for the same room."""
    from kvbridge.adapters.vllm.handle import handle_of
    from kvbridge.route.config import ServerSpec
    from kvbridge.route.engines import Handoff, check_vllm_prefill_answer, vllm_completion_body, vllm_handle_params

    s = Sampling(8, 0.0, top_k=-1, ignore_eos=True, stop=("x",), seed=3)
    p_v = ServerSpec(name="v", engine="vllm", role="prefill", url="http://h:1", bootstrap="10.0.0.1:8998")
    p_trt = ServerSpec(name="q", engine="trtllm", role="prefill", url="http://h:1", bus="tcp://10.0.0.2:18500")
    send = vllm_handle_params(Handoff(42, p_v), "send")
    assert send == {"kvbridge": {"op": "send", "room": 42}} and handle_of(send).op == "send"
    b = vllm_completion_body("/models/m", [1, 2], s, stream=False, max_tokens=1, params=send)
    assert b == {"model": "/models/m", "prompt": [1, 2], "max_tokens": 1, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                 "ignore_eos": True, "stream": False, "return_token_ids": True, "stop": ["x"], "seed": 3,
                 "kv_transfer_params": {"kvbridge": {"op": "send", "room": 42}}}
    recv = vllm_handle_params(Handoff(42, p_v), "recv")
    assert recv == {"kvbridge": {"op": "recv", "room": 42, "bootstrap": "10.0.0.1:8998"}}
    # a TensorRT-LLM prefill known only by its bus: the rank endpoints the router looked up
    recv_eps = vllm_handle_params(Handoff(7, p_trt, ("tcp://10.0.0.2:5000", "tcp://10.0.0.2:5001")), "recv")
    assert recv_eps == {"kvbridge": {"op": "recv", "room": 7, "endpoints": ["tcp://10.0.0.2:5000", "tcp://10.0.0.2:5001"]}}
    assert handle_of(recv_eps).endpoints == ("tcp://10.0.0.2:5000", "tcp://10.0.0.2:5001")
    alone = vllm_completion_body("m", [1], Sampling(4), stream=True)
    assert "kv_transfer_params" not in alone and alone["stream"] is True and alone["max_tokens"] == 4
    # what the prefill answers: the decode half's handle for the same room, or it did not take the handoff
    assert check_vllm_prefill_answer({"kv_transfer_params": recv}, 42) is None
    assert "no kvbridge handle" in check_vllm_prefill_answer({"kv_transfer_params": None}, 42)
    assert "for recv room 42, not recv room 43" in check_vllm_prefill_answer({"kv_transfer_params": recv}, 43)
    assert "not a kvbridge handle" in check_vllm_prefill_answer({"kv_transfer_params": {"kvbridge": {"op": "x"}}}, 42)
    # vLLM's answers (return_token_ids): token_ids per choice, deltas when streamed; "abort" is a failure
    assert completion_delta({"choices": [{"index": 0, "text": "w3", "token_ids": [3], "finish_reason": None}]}) == \
        ([3], None, None)
    assert completion_delta({"choices": [{"text": "", "token_ids": [], "finish_reason": "length"}]}) == ([], "length", None)
    assert "abort" in completion_delta({"choices": [{"text": "", "token_ids": [], "finish_reason": "abort"}]})[2]


def test_stream_parsing_cumulative_incremental_and_failures():
    assert sse_json(b'data: {"a": 1}\n') == {"a": 1} and sse_json(b"data: [DONE]") is True
    assert sse_json(b": keep-alive") is None and sse_json(b"data: [1]") is None
    # SGLang, cumulative (the default): the tail beyond what was taken
    ev = {"output_ids": [4, 5, 6], "meta_info": {"completion_tokens": 3, "finish_reason": None}}
    assert sglang_delta(ev, 2) == ([6], None, None)
    # incremental (--incremental-streaming-output): the ids themselves
    ev = {"output_ids": [6], "meta_info": {"completion_tokens": 3, "finish_reason": {"type": "length", "length": 3}}}
    assert sglang_delta(ev, 2) == ([6], "length", None)
    ev = {"output_ids": [], "meta_info": {"completion_tokens": 0, "finish_reason": {"type": "abort", "message": "boom"}}}
    assert sglang_delta(ev, 0) == ([], None, "boom")
    assert trtllm_delta({"choices": [{"token_ids": [3], "finish_reason": None}]}) == ([3], None, None)
    assert trtllm_delta({"choices": [{"token_ids": [3], "finish_reason": "length"}]}) == ([3], "length", None)
    assert trtllm_delta({"choices": [], "usage": {}}) == ([], None, None)
    assert "cancelled" in trtllm_delta({"choices": [{"token_ids": [], "finish_reason": "cancelled"}]})[2]
    assert "token_ids" in trtllm_delta({"choices": [{"text": "x", "finish_reason": None}]})[2]


def test_detokenizer_deltas_add_up_to_the_whole(codec):
    from kvbridge.route.text import Detokenizer

    ids = [5, 17, 300, 2, 44, 45]  # 2 is </s>, skipped
    d = Detokenizer(codec)
    parts = [d.add(ids[:1]), d.add(ids[1:3]), d.add(ids[3:4]), d.add(ids[4:])] + [d.flush()]
    assert "".join(parts) == codec.decode(ids) == "w5 w17 w300 w44 w45"


def test_formatter_shapes():
    from kvbridge.route.protocol import Formatter

    f = Formatter("completion", "cmpl-1", "m", 3)
    c = f.chunk([7], "w7", None, {"route": "x"}, first=True)
    assert c["choices"][0] == {"index": 0, "text": "w7", "token_ids": [7], "logprobs": None, "finish_reason": None}
    assert c["kvbridge"] == {"route": "x"}
    f.chunk([8], " w8", "length")
    assert f.usage_chunk()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    g = Formatter("generate", "r", "m", 2)
    g.chunk([7], "w7", None)
    out = g.chunk([8], " w8", "length")
    assert out["output_ids"] == [7, 8] and out["text"] == "w7 w8" and out["meta_info"]["finish_reason"] == {"type": "length"}
    w = Formatter("chat", "c", "m", 1).whole([7], "w7", "stop", {})
    assert w["choices"][0]["message"] == {"role": "assistant", "content": "w7"} and w["object"] == "chat.completion"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kvbridge.demo.models import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("route") / "tiny"))


@pytest.fixture(scope="module")
def codec(tiny_model):
    from kvbridge.route.text import TextCodec

    return TextCodec(tiny_model, "{% for m in messages %}{{ m['content'] }} {% endfor %}")


def test_a_failed_try_keeps_its_trtllm_servers_off_that_prompt(tiny_model):
    """Announcements are keyed by the prompt and cannot be withdrawn: after a try that
    announced to a TensorRT-LLM server failed, that server gets no request with the same
    prompt (its next one would take the stale handle) until the request's deadline; other
    prompts still go there."""
    from kvbridge.route.dispatch import Dispatcher, Job, Trace
    from kvbridge.route.metrics import RouteMetrics

    cfg = parse_config(_yaml(MIXED, "cost: {enabled: false}", tiny_model))

    async def go():
        pool = ServerPool(cfg)
        by = pool.by_name
        disp = Dispatcher(cfg, pool, PairGates(cfg), RouteMetrics(), None, None)
        loop = asyncio.get_running_loop()
        job = Job("r1", [5, 6, 7], Sampling(4), loop.time() + 0.5)
        other = Job("r2", [5, 6, 8], Sampling(4), loop.time() + 10)
        pool.mark_down(by["d0"], "test")  # t0 is the only decode
        assert disp._choose(job, Trace(), set(), set(), 0, None)[2] is by["t0"]
        disp._mark_stale(job, [by["p0"], by["t0"]])  # p0 is SGLang: no announcement to go stale
        kind, target, _, why = disp._choose(job, Trace(), set(), set(), 0, None)
        assert (kind, target, why) == ("compute", by["a0"], "no_pair")  # t0 neither decodes nor computes it
        assert disp._choose(other, Trace(), set(), set(), 0, None)[2] is by["t0"]
        pool.mark_down(by["a0"], "test")
        with pytest.raises(RouteError) as e:
            disp._choose(job, Trace(), set(), set(), 0, None)
        assert e.value.status == 503
        await asyncio.sleep(1.6)  # past the request's deadline (+1 s): t0 takes that prompt again
        assert disp._choose(job, Trace(), set(), set(), 0, None)[2] is by["t0"]

    asyncio.run(go())


def test_ties_alternate_per_kind_of_choice(tiny_model):
    """With equal load, successive pairs alternate decodes even with a single prefill
    (each kind of choice takes its own turns)."""
    servers = """  - {name: p0, engine: sglang, role: prefill, url: "http://h:1", bootstrap: "h:2"}
  - {name: d0, engine: sglang, role: decode, url: "http://h:5"}
  - {name: t0, engine: trtllm, role: decode, url: "http://h:6", bus: "tcp://h:7"}"""
    pool = ServerPool(parse_config(_yaml(servers, "", tiny_model)))
    picks = [pool.pick_pair() for _ in range(4)]
    assert [d.name for _, d in picks] in (["d0", "t0", "d0", "t0"], ["t0", "d0", "t0", "d0"])
    assert all(p.name == "p0" for p, _ in picks)


def test_no_server_is_a_503_with_retry_after_and_bad_input_a_400(tiny_model):
    """Through HTTP: with its only server refusing connections the router says so on
    /health and answers 503 with Retry-After; a malformed request is a 400 naming what is
    wrong; both counted by reason."""
    import urllib.error
    import urllib.request

    from kvbridge.demo.sglang_server import free_port
    from kvbridge.route.app import BackgroundRouter

    cfg = parse_config(_yaml(f"  - {{name: a0, engine: sglang, role: aggregated, url: 'http://127.0.0.1:{free_port()}'}}",
                             "health: {fail_after: 1, interval_s: 0.2}\nlimits: {retry_after_s: 3}", tiny_model))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def call(path, body=None):
        req = urllib.request.Request(path, None if body is None else json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with opener.open(req, timeout=10) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())

    with BackgroundRouter(cfg) as router:
        st, hd, body = call(router.url + "/health")
        assert st == 503 and "Retry-After" in hd and body["servers"][0]["healthy"] is False, body
        st, hd, body = call(router.url + "/v1/completions", {"model": "m", "prompt": [5, 6], "max_tokens": 2})
        assert st == 503 and hd.get("Retry-After") == "3" and body["error"]["reason"] == "no_server", (st, hd, body)
        assert "a0 down" in body["error"]["message"]
        st, _, body = call(router.url + "/v1/completions", {"model": "m", "prompt": [5, 6], "n": 3})
        assert st == 400 and "'n'" in body["error"]["message"]
        m = router.router.metrics
        assert m.value("kvbridge_route_failures_total", {"route": "none", "reason": "no_server"}) == 1
        assert m.value("kvbridge_route_failures_total", {"route": "none", "reason": "bad_request"}) == 1


def test_answer_ends_at_the_first_stop_string_and_holds_back_what_could_start_one(codec):
    """Stop strings end the answer where they complete (the text cut before them, or after
    with include_stop), in a stream as in one piece; no text that could start a stop
    leaves early; EOS ends it only when asked; the text is SGLang's and vLLM's (each
    word after a space: the prompt's last ids are decoded before the output)."""
    from kvbridge.route.text import Answer

    a = Answer(codec, [9, 10, 11], stops=("w30 w4", "w77"))
    assert a.add([20], None) == ([20], "", None)  # the last 5 characters wait: the longest stop, less one
    assert a.add([30], None) == ([30], " w2", None)
    assert a.add([4, 5, 6], None) == ([4], "0 ", "stop") and a.matched == "w30 w4" and a.text == " w20 "
    b = Answer(codec, [9], stops=("w30",), include_stop=True)
    assert b.add([20, 30, 40], "length") == ([20, 30], " w20 w30", "stop") and b.matched == "w30"
    c = Answer(codec, [9])
    assert c.add([20, 2, 40], None) == ([20, 2, 40], " w20 w40", None)  # EOS: the engine's business
    c.end_at_eos(True)
    assert c.add([41, 2, 42], None) == ([41, 2], " w41", "stop") and c.matched is None
    d = Answer(codec, [9], stops=("zz",))
    assert d.add([20], None) == ([20], " w2", None) and d.add([21], "length") == ([21], "0 w21", "length")


def test_capabilities_pair_requests_and_refusals_name_the_reason(tiny_model):
    """The configuration's capabilities, narrowed by what servers publish, decide which
    servers a request may go to; when none of the configured servers could, the refusal
    (a 400) names each one's reason; the model's context comes from its config.json."""
    from kvbridge.route import capabilities as C

    servers = MIXED.replace('bus: "tcp://h:7"}', 'bus: "tcp://h:7", capabilities: {sampling: greedy, stop: router}}')
    cfg = parse_config(f"model: {{name: m, tokenizer: {tiny_model}, aliases: [mm]}}\nservers:\n{servers}\n")
    assert cfg.model.names() == ["m", "mm"]
    pool = ServerPool(cfg)
    by = pool.by_name
    assert pool.context == 2048 and by["t0"].caps.context_length == 2048 and by["t0"].caps.sampling == "greedy"
    sampled = C.Needs.of(40, Sampling(8, temperature=0.7))
    assert pool.pick_pair(needs=sampled)[1].name == "d0" and pool.pick_compute(needs=sampled).name == "a0"
    assert pool.refusal(sampled) is None
    by["a0"].caps = C.narrowed(by["a0"].caps, C.published_limits("sglang", {"data": [{"max_model_len": 1024}]},
                                                                   {"enable_deterministic_inference": False}, None),
                               "published")
    assert by["a0"].caps.context_length == 1024 and not by["a0"].caps.seed and by["a0"].caps.sources == ("published",)
    assert pool.pick_compute(needs=C.Needs.of(1500, Sampling(8, temperature=0))).name == "t0"
    over = pool.refusal(C.Needs.of(2100, Sampling(4, temperature=0)), "r1")
    assert over.status == 400 and "2048" in over.message and "2104" in over.message and over.param == "max_tokens"
    only_greedy = ServerPool(parse_config(_yaml(
        '  - {name: g, engine: trtllm, role: aggregated, url: "http://h:1", capabilities: {sampling: greedy}}', "",
        tiny_model)))
    e = only_greedy.refusal(C.Needs.of(10, Sampling(4)), "r2")
    assert e.status == 400 and e.param == "temperature" and "g (trtllm aggregated)" in e.message
    assert only_greedy.refusal(C.Needs.of(10, Sampling(4, temperature=0, stop=("x",)))) is None
    assert C.for_server(Sampling(4, stop=("x",)), "trtllm", C.Caps(stop="router"), "decode").stop == ()
    assert C.for_server(Sampling(4, seed=3), "vllm", C.Caps(), "prefill") == Sampling(4, temperature=0.0, seed=None)
