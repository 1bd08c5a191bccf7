"""``kvbridge route`` with TensorRT-LLM servers: the stand-in (``kvbridge.demo.trtllm``)
behind trtllm-serve's HTTP shape (``kvbridge.demo.trtllm.http``), each in this process
with its ranks in their own.

Three servers: a TensorRT-LLM 1.2 prefill and a TensorRT-LLM main decode sharing the
deployment's secret, and a 1.2 decode with another secret (its pulls are refused: a
decode that fails). Checked against transformers' ``generate()`` and against each
server's own records (loads, blocks, rooms), never against the router's word alone.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbridge.demo.models import random_prompt, reference_generate

pytestmark = [pytest.mark.slow]

PLUGIN = {"host": "127.0.0.1", "deadline_s": 30.0, "peer_timeout_s": 3.0, "heartbeat_s": 0.2, "quiesce_s": 0.5}
S1 = "route-test-secret-one-0123456789"
MAX_NEW = 8


@pytest.fixture(scope="module")
def trt(tiny_llama_dir):
    """{"prefill": 1.2, "decode": main, "bad": a 1.2 decode that names another model}, all with secret S1."""
    from kvbridge.demo.trtllm.http import StandInHTTP

    # "bad" serves another model: the prefill refuses its pulls by name (incompatible)
    specs = {"prefill": ("1.2", "tiny-llama"), "decode": ("main", "tiny-llama"), "bad": ("1.2", "another-model")}
    with ThreadPoolExecutor(3) as ex:
        futs = {k: ex.submit(StandInHTTP, v, tiny_llama_dir, tokens_per_block=32, num_blocks=64,
                             plugin={**PLUGIN, "secret": S1, "model": m}) for k, (v, m) in specs.items()}
        servers = {}
        try:
            for k, f in futs.items():
                servers[k] = f.result()
        except BaseException:
            for s in servers.values():
                s.stop()
            raise
    yield servers
    for s in servers.values():
        s.stop()


def _cfg(md, servers: list[dict], **sections) -> "object":
    from kvbridge.route.config import parse_config
    from kvbridge.demo.route_local import route_yaml

    cfg = {"model": {"name": "tiny-llama", "tokenizer": str(md)}, "servers": servers, "secret": S1,
           "health": {"interval_s": 0.5, "fail_after": 1}, **sections}
    return parse_config(route_yaml(cfg))


def _state(server) -> dict:
    return server.stepper.call(lambda s: s.state())


def _post(url: str, body: dict, headers: dict | None = None, timeout: float = 60.0):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _wait(cond, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_standin_speaks_trtllm_serve_http(trt, tiny_llama_dir):
    """The stand-in's HTTP front as trtllm-serve answers: token-id prompts, ``detokenize:
    false`` -> token ids, SSE with a usage chunk, text otherwise; refusals with 400."""
    from openai import BadRequestError, OpenAI

    d = trt["decode"]
    c = OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)
    p = random_prompt(21, seed=21)
    ref = reference_generate(tiny_llama_dir, p, MAX_NEW).token_ids
    r = c.completions.create(model="m", prompt=p, max_tokens=MAX_NEW, temperature=0, extra_body={"detokenize": False})
    assert r.choices[0].model_extra["token_ids"] == ref and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 21 and r.usage.completion_tokens == MAX_NEW
    chunks = list(c.completions.create(model="m", prompt=p, max_tokens=MAX_NEW, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"detokenize": False}))
    assert [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]] == ref
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_NEW
    text = c.completions.create(model="m", prompt=p, max_tokens=MAX_NEW, temperature=0).choices[0].text
    assert text == " ".join(f"w{t}" for t in ref)
    for kw, needle in (({"temperature": 0.7}, "greedily"), ({"extra_body": {"colour": 1}}, "extra fields"),
                       ({"stop": ["w1"]}, "stop")):
        with pytest.raises(BadRequestError, match=needle):
            c.completions.create(model="m", prompt=p, max_tokens=2, **{"temperature": 0, **kw})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    assert opener.open(d.url + "/health").status == 200
    assert "stand-in" in json.loads(opener.open(d.url + "/version").read())["version"]


def test_route_trtllm_prefill_to_trtllm_decode(trt, tiny_llama_dir):
    """Through ``kvbridge route``: the router announces each half to its server's bus and
    sends ordinary completions; the decode pulls the KV (its connector's records say so)
    and its tokens equal transformers'."""
    from openai import OpenAI

    from kvbridge.route.app import BackgroundRouter
    from tests.helpers.route_client import complete

    p, d = trt["prefill"], trt["decode"]
    cfg = _cfg(tiny_llama_dir, [{"name": "tp", "engine": "trtllm", "role": "prefill", "url": p.url, "bus": p.bus},
                                {"name": "td", "engine": "trtllm", "role": "decode", "url": d.url, "bus": d.bus}],
               cost={"enabled": False})
    loads_before = set(_state(d).get("finished_loads") or {})
    prompts = [random_prompt(n, seed=n) for n in (33, 47, 70, 90)]
    refs = [reference_generate(tiny_llama_dir, q, MAX_NEW).token_ids for q in prompts]
    with BackgroundRouter(cfg) as router:
        c = OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)

        def ask(i):
            return complete(c, prompts[i], stream=bool(i % 2), max_tokens=MAX_NEW)

        with ThreadPoolExecutor(4) as ex:
            out = list(ex.map(ask, range(4)))
        m = router.router.metrics
        assert m.value("kvbridge_route_requests_total", {"route": "trtllm->trtllm", "mode": "disaggregated"}) == 4
        # a finished handoff is not cleaned up as a failed one: no room aborted, no retry
        router.call(router.router.dispatcher.drain)
        assert m.value("kvbridge_route_room_aborts_total", {"engine": "trtllm"}) == 0
        assert not router.router.dispatcher._stale
    for (ids, info), ref in zip(out, refs):
        assert ids == ref and info["route"] == "trtllm->trtllm" and info["mode"] == "disaggregated"
        assert info["servers"] == ["tp", "td"]
    loads = {k: v for k, v in (_state(d).get("finished_loads") or {}).items() if k not in loads_before}
    assert len(loads) == 4 and all(v["verdict"] == "ok" for v in loads.values()), loads
    _wait(lambda: _state(p)["free"] == _state(p)["total"] and _state(p)["sender_rooms"] == 0, 10,
          "the prefill released every block and room")


def test_short_prompt_is_computed_by_the_trtllm_decode_alone(trt, tiny_llama_dir):
    """Below the break-even the router sends the request to the TensorRT-LLM decode alone
    (no announcement: it computes the prompt); nothing reaches the prefill."""
    from kvbridge.route.app import BackgroundRouter
    from openai import OpenAI

    p, d = trt["prefill"], trt["decode"]
    cfg = _cfg(tiny_llama_dir, [{"name": "tp", "engine": "trtllm", "role": "prefill", "url": p.url, "bus": p.bus},
                                {"name": "td", "engine": "trtllm", "role": "decode", "url": d.url, "bus": d.bus}],
               cost={"prefill_tps": 20000.0, "decode_prefill_tps": 10000.0})
    before_p, before_d = _state(p), _state(d)
    with BackgroundRouter(cfg) as router:
        be = router.router.gates.break_even()["tcp"]
        assert 8 < be < 64, be
        c = OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        short, long_ = random_prompt(8, seed=8), random_prompt(64, seed=64)
        rs = c.completions.create(model="tiny-llama", prompt=short, max_tokens=MAX_NEW, temperature=0)
        rl = c.completions.create(model="tiny-llama", prompt=long_, max_tokens=MAX_NEW, temperature=0)
        m = router.router.metrics
        assert m.value("kvbridge_route_recomputed_total", {"route": "trtllm", "why": "below_break_even"}) == 1
        assert m.value("kvbridge_route_requests_total", {"route": "trtllm->trtllm", "mode": "disaggregated"}) == 1
    assert rs.choices[0].model_extra["token_ids"] == reference_generate(tiny_llama_dir, short, MAX_NEW).token_ids
    assert rl.choices[0].model_extra["token_ids"] == reference_generate(tiny_llama_dir, long_, MAX_NEW).token_ids
    assert rs.model_extra["kvbridge"]["mode"] == "recomputed" and rs.model_extra["kvbridge"]["servers"] == ["td"]
    assert "below break-even" in rs.model_extra["kvbridge"]["verdict"]
    after_p, after_d = _state(p), _state(d)
    assert len(after_p["ever"]) >= len(before_p["ever"])
    # the prefill computed one prompt (the long one), the decode loaded one and computed one itself
    assert len(after_d["finished_loads"]) == len(before_d["finished_loads"]) + 1


def test_decode_failure_is_a_clear_error_and_the_prefill_room_is_aborted(trt, tiny_llama_dir):
    """A decode whose pulls the prefill refuses (another model) fails its request; the
    client gets 502 naming the decode, and the router aborts the room on the prefill,
    which releases the prompt's blocks at once (its own deadline is 30 s)."""
    from kvbridge.route.app import BackgroundRouter

    p, bad = trt["prefill"], trt["bad"]
    cfg = _cfg(tiny_llama_dir, [{"name": "tp", "engine": "trtllm", "role": "prefill", "url": p.url, "bus": p.bus},
                                {"name": "tbad", "engine": "trtllm", "role": "decode", "url": bad.url, "bus": bad.bus}],
               cost={"enabled": False})
    _wait(lambda: _state(p)["free"] == _state(p)["total"], 30, "the prefill is idle")
    with BackgroundRouter(cfg) as router:
        t0 = time.monotonic()
        status, headers, body = _post(router.url + "/v1/completions",
                                      {"model": "tiny-llama", "prompt": random_prompt(50, seed=50), "max_tokens": 4,
                                       "temperature": 0})
        took = time.monotonic() - t0
        err = json.loads(body)["error"]
        assert status == 502 and err["reason"] == "decode_failed", (status, body)
        assert "decode tbad failed" in err["message"] and "aborted on prefill tp" in err["message"], err
        t1 = time.monotonic()
        _wait(lambda: (lambda s: s["free"] == s["total"] and s["sender_rooms"] == 0 and s["pinned"] == 0)(_state(p)), 10,
              "the prefill released the room's blocks")
        released = time.monotonic() - t1
        assert router.router.metrics.value("kvbridge_route_room_aborts_total", {"engine": "trtllm"}) == 1
        assert router.router.metrics.value("kvbridge_route_failures_total",
                                           {"route": "trtllm->trtllm", "reason": "decode_failed"}) == 1
    assert took < 15 and released < 8, (took, released)
    assert any("model mismatch" in str(v) for v in _state(bad)["finished_loads"].values())


def test_saturation_429_and_deadline_504(trt, tiny_llama_dir):
    """A full queue answers 429 with Retry-After at once; a request past its deadline 504
    within it, and the server's request is cancelled (its blocks come back)."""
    from kvbridge.route.app import BackgroundRouter

    d = trt["decode"]
    cfg = _cfg(tiny_llama_dir, [{"name": "ta", "engine": "trtllm", "role": "aggregated", "url": d.url}],
               limits={"max_inflight": 1, "max_queue": 0, "retry_after_s": 2.0})
    long_body = {"model": "tiny-llama", "prompt": random_prompt(40, seed=4), "max_tokens": 600, "temperature": 0}
    with BackgroundRouter(cfg) as router:
        box = {}
        t_long = time.monotonic()
        th = threading.Thread(target=lambda: box.update(r=_post(router.url + "/v1/completions", long_body),
                                                         took=time.monotonic() - t_long))
        th.start()
        _wait(lambda: router.router.admission.inflight == 1, 10, "the first request is dispatched")
        t0 = time.monotonic()
        status, headers, body = _post(router.url + "/v1/completions", {**long_body, "max_tokens": 2})
        assert status == 429 and headers.get("Retry-After") == "2" and time.monotonic() - t0 < 2, (status, headers)
        assert json.loads(body)["error"]["reason"] == "saturated"
        th.join(120)
        assert box["r"][0] == 200 and len(json.loads(box["r"][2])["choices"][0]["token_ids"]) == 600
        _wait(lambda: _state(d)["active"] == 0, 10, "the decode is idle")
        t0 = time.monotonic()
        status, _, body = _post(router.url + "/v1/completions", {**long_body, "max_tokens": 1500},
                                {"X-Request-Timeout": "0.5"})
        took = time.monotonic() - t0
        assert status == 504 and json.loads(body)["error"]["reason"] == "deadline" and took < 1.5, (status, took, body)
        # the server's request was cancelled: the decode is idle with every block back sooner than
        # 600 tokens took, let alone the 1500 asked for
        _wait(lambda: (lambda s: s["active"] == 0 and s["free"] == s["total"])(_state(d)), box["took"],
              f"the decode's request was cancelled (600 tokens took {box['took']:.1f} s)")
        assert router.router.metrics.value("kvbridge_route_failures_total", {"route": "trtllm", "reason": "deadline"}) == 1


def test_openai_edges_through_the_greedy_standin(trt, tiny_llama_dir):
    """The TensorRT-LLM stand-in (greedy only, no stop strings, never stops at EOS, as its
    ``/version`` says) behind the router answers as SGLang and vLLM do: stop strings
    trimmed, the answer ended at EOS; what no server can serve (sampling, the context) is
    a 400 before any server is asked, never retried; unknown models 404, aliases served,
    chat content parts, JSON errors on any path."""
    import openai

    from kvbridge.route.app import BackgroundRouter
    from tests.helpers import route_client as rc

    p, d = trt["prefill"], trt["decode"]
    cfg = _cfg(tiny_llama_dir, [{"name": "tp", "engine": "trtllm", "role": "prefill", "url": p.url, "bus": p.bus},
                                {"name": "td", "engine": "trtllm", "role": "decode", "url": d.url, "bus": d.bus}],
               cost={"enabled": False},
               model={"name": "tiny-llama", "tokenizer": str(tiny_llama_dir), "aliases": ["tiny"],
                      "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"})
    prompt = random_prompt(40, seed=40)
    ref = reference_generate(tiny_llama_dir, prompt, 12).token_ids
    eos_prompt = random_prompt(rc.EOS_PROMPT[0], seed=rc.EOS_PROMPT[1])
    eos_ref = reference_generate(tiny_llama_dir, eos_prompt, 8).token_ids
    assert rc.EOS_ID in eos_ref, eos_ref
    with BackgroundRouter(cfg) as router:
        c = rc.client_of(router.url)
        rc.check_stop_strings(c, prompt, ref)
        rc.check_eos(c, eos_prompt, eos_ref)
        rc.check_openai_surface(router.url, prompt, ref[:6], alias="tiny")
        before = (_state(p)["ever"], _state(d)["ever"])
        rc.check_refusals(c, 2048)
        with pytest.raises(openai.BadRequestError, match="temperature") as e:  # the OpenAI default, 1.0
            c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4)
        assert "td (trtllm decode)" in str(e.value) and e.value.body["param"] == "temperature"
        assert (_state(p)["ever"], _state(d)["ever"]) == before, "a refused request reached a server"
        m = router.router.metrics
        assert m.value("kvbridge_route_failures_total", {"route": "none", "reason": "bad_request"}) == 4
        assert not [s for s in m.registry.collect() for x in s.samples
                    if x.name in ("kvbridge_route_retries_total", "kvbridge_route_room_aborts_total") and x.value]
        assert m.value("kvbridge_route_failures_total", {"route": "none", "reason": "model_not_found"}) == 1
