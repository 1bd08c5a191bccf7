"""vLLM's REAL server (CPU, the kvbridge connector) on either side of a handoff.

Two vLLM servers (``kv_both``, ``vllm_servers`` of tests/vllm/conftest.py, in the vLLM venv)
play prefill and decode; SGLang's REAL servers (the kvbridge backend, one pair for the
module) and the TensorRT-LLM stand-in (in this process) play the other engines:

- vLLM -> vLLM, both ways round, the decode half's handle taken from the prefill's response;
- SGLang prefill -> vLLM decode and vLLM prefill -> SGLang decode;
- vLLM prefill -> TensorRT-LLM decode and TensorRT-LLM prefill -> vLLM decode;
- a load that fails (the prefill cannot be found) is recomputed (``kv_load_failure_policy``).

Checked here against transformers' ``generate()`` run in this process: every generated
token. From vLLM's own metrics: the decode computed none of the prompt itself (every
prompt token counted as loaded by the connector, ``external_kv_transfer``); from the
workers' records: the bytes that moved equal the prompt's KV, and the plan kind the
layouts force (direct vLLM->vLLM, staged on the vLLM side otherwise). The model is the
tiny GQA Llama with head_dim 32 (vLLM's CPU backend serves no smaller head).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.demo.models import random_prompt, reference_generate
from tests.helpers.vllm_env import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

MAX_NEW = 12
LENS = (70, 33)
KV_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers x K/V x KV heads x head_dim x float32


@pytest.fixture(scope="module")
def sglang_pair(model_dir):
    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
    from tests.helpers.sglang_pairs import KVBRIDGE, get_pair

    return get_pair("kvbridge", model_dir=model_dir, **KVBRIDGE)


def reference(model_dir, n):
    prompt = random_prompt(n, seed=900 + n)
    return prompt, reference_generate(model_dir, prompt, MAX_NEW).token_ids


@pytest.mark.parametrize("a,b", [(0, 1), (1, 0)])
def test_vllm_to_vllm(model_dir, vllm_servers, a, b):
    from kvbridge.demo.vllm_flows import vllm_to_vllm

    prefill, decode = vllm_servers[a], vllm_servers[b]
    for n in LENS:
        prompt, ref = reference(model_dir, n)
        r = vllm_to_vllm(prefill, decode, prompt, MAX_NEW)
        assert r["generated"] == ref and r["first_prefill"] == ref[0], (r["generated"], ref)
        assert r["decode_handle"] == {"kvbridge": {"op": "recv", "room": r["room"], "bootstrap": prefill.bootstrap_address}}
        assert r["external_tokens"] == n, "the decode loaded every prompt token (and recomputed only the last)"
        for side in ("send", "load"):
            rec = r[side]
            assert rec["ok"] and rec["record"]["result"] == "success", rec
        assert r["send"]["record"]["bytes"] == n * KV_PER_TOKEN and r["send"]["record"]["plan"] == "direct"


def test_sglang_prefill_to_vllm_decode(model_dir, vllm_servers, sglang_pair):
    from kvbridge.demo.vllm_flows import sglang_to_vllm

    for n in LENS:
        prompt, ref = reference(model_dir, n)
        r = sglang_to_vllm(sglang_pair.prefill, sglang_pair.bootstrap_port, vllm_servers[1], prompt, MAX_NEW)
        assert r["generated"] == ref and r["first_prefill"] == ref[0], (r["generated"], ref)
        assert r["external_tokens"] == n
        rec = r["load"]["record"]
        assert r["load"]["ok"] and rec["bytes"] == n * KV_PER_TOKEN and rec["plan"] == "staged_recv", rec
        assert r["load"]["aux"]["output_ids"] == [ref[0]]  # the first token SGLang sampled rode along


def test_vllm_prefill_to_sglang_decode(model_dir, vllm_servers, sglang_pair):
    from kvbridge.demo.vllm_flows import vllm_to_sglang

    for n in LENS:
        prompt, ref = reference(model_dir, n)
        r = vllm_to_sglang(vllm_servers[0], sglang_pair.decode, prompt, MAX_NEW)
        assert r["generated"] == ref and r["first_prefill"] == ref[0], (r["generated"], ref)
        rec = r["send"]["record"]
        assert r["send"]["ok"] and rec["bytes"] == n * KV_PER_TOKEN and rec["plan"] == "staged_send", rec
        # vLLM's bytes as they landed in SGLang's decode pool, read by SGLang's own indexing
        # (vLLM's CPU kernels round differently from transformers': a few 1e-5 apart)
        sglang_pair.probe("decode").assert_landed(model_dir, prompt, prefix=0, atol=1e-4)
    sglang_pair.probe("decode").assert_clean()


@pytest.mark.parametrize("version", ["1.2"])
def test_vllm_and_trtllm(model_dir, vllm_servers, version):
    """vLLM prefill -> TensorRT-LLM decode, then TensorRT-LLM prefill -> vLLM decode."""
    from kvbridge.demo.trtllm import StandInServer
    from kvbridge.demo.vllm_flows import trtllm_to_vllm, vllm_to_trtllm

    prompt, ref = reference(model_dir, LENS[0])
    with StandInServer(version, model_dir, tokens_per_block=32, num_blocks=32,
                       plugin={"host": "127.0.0.1", "on_failure": "fail", "peer_timeout_s": 3.0}) as trt:
        r = vllm_to_trtllm(vllm_servers[0], trt, prompt, MAX_NEW)
        assert r["trt_load"].get("verdict") == "ok", r["trt_load"]
        assert r["generated"] == ref and r["first_prefill"] == ref[0], (r["generated"], ref)
        assert r["context_tokens_computed"] == 1, "the TensorRT-LLM decode computes only the last prompt token"
        assert r["send"]["record"]["bytes"] == LENS[0] * KV_PER_TOKEN and r["send"]["record"]["plan"] == "staged_send"
    with StandInServer(version, model_dir, tokens_per_block=32, num_blocks=32,
                       plugin={"host": "127.0.0.1", "sglang_bootstrap_port": 0, "sglang_page_size": 1}) as trt:
        r = trtllm_to_vllm(trt, vllm_servers[1], prompt, MAX_NEW)
        assert r["trt_save"].get("ok"), r["trt_save"]
        assert r["generated"] == ref and r["first_prefill"] == ref[0], (r["generated"], ref)
        assert r["external_tokens"] == LENS[0]
        rec = r["load"]["record"]
        assert rec["bytes"] == LENS[0] * KV_PER_TOKEN and rec["plan"] == "staged_recv", rec


def test_failed_load_is_recomputed(model_dir, vllm_servers):
    """A decode half whose prefill cannot be found: the load fails (the record says why),
    vLLM recomputes the prompt (kv_load_failure_policy=recompute), the output is right."""
    from kvbridge.adapters.vllm.handle import Handle, to_params
    from kvbridge.demo.sglang_server import free_port, new_room
    from kvbridge.demo.vllm_flows import _external_tokens, _wait_record
    from kvbridge.demo.vllm_server import complete

    decode = vllm_servers[1]
    prompt, ref = reference(model_dir, LENS[1])
    room = new_room()
    ext0 = _external_tokens(decode)
    d = complete(decode, prompt, MAX_NEW, to_params(Handle("recv", room, bootstrap=f"127.0.0.1:{free_port()}")))
    assert d["token_ids"] == ref
    rec = _wait_record(decode, room, "load")
    assert not rec["ok"] and "cannot find the prefill" in rec["reason"], rec
    assert _external_tokens(decode) - ext0 == 0


def test_demo_command_sglang_prefill_vllm_decode():
    """``kvbridge demo --prefill sglang --decode vllm --json`` as a user runs it (its own
    servers): one JSON object, both sides real servers, tokens checked here."""
    import json
    import subprocess
    import sys

    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)
    cmd = [sys.executable, "-m", "kvbridge.cli", "demo", "--json", "--prefill", "sglang", "--decode", "vllm",
           "--max-new", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, f"rc {out.returncode}:\n{out.stdout[:2000]}\n{out.stderr[-3000:]}"
    r = json.loads(lines[0])
    ref = reference_generate(Path(r["model"]["dir"]), r["prompt_ids"], 8).token_ids
    assert r["generated_ids"] == ref and r["match"] is True and out.returncode == 0, (r.get("generated_ids"), ref)
    assert r["real_servers"] == ["sglang", "vllm"] and r["direction"] == "sglang->vllm"
    assert r["bytes"] == r["bytes_expected"] == 70 * KV_PER_TOKEN and r["plan"] == "staged_recv"
    assert r["context_tokens_computed"] == 1


def test_decode_abort_while_loading_releases_blocks(model_dir, vllm_servers):
    """A decode half whose client goes away while its KV is awaited (the prefill never
    opens the room): vLLM aborts it, the connector aborts the room and reports the load
    only once no sender can write, vLLM frees the blocks, and the server serves on."""
    import time

    from kvbridge.adapters.vllm.handle import Handle, to_params
    from kvbridge.demo.sglang_server import new_room, post_json
    from kvbridge.demo.vllm_flows import _wait_record
    from kvbridge.demo.vllm_server import complete

    prefill, decode = vllm_servers
    prompt, ref = reference(model_dir, LENS[0])
    room = new_room()
    body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "kv_transfer_params": to_params(Handle("recv", room, bootstrap=prefill.bootstrap_address))}
    res = post_json(decode.url + "/v1/completions", body, 3.0)
    assert isinstance(res, Exception), "the load cannot finish: the prefill never opened the room"
    rec = _wait_record(decode, room, "load", timeout=30)
    assert not rec["ok"] and "aborted while loading" in rec["reason"], rec
    assert_blocks_freed(decode)
    assert complete(decode, prompt, MAX_NEW)["token_ids"] == ref


def assert_blocks_freed(server, timeout_s: float = 20.0) -> None:
    """vLLM's own gauge of its KV cache in use comes back to zero."""
    import time

    end = time.monotonic() + timeout_s
    while server.metric("vllm:kv_cache_usage_perc") > 0 and time.monotonic() < end:
        time.sleep(0.2)
    assert server.metric("vllm:kv_cache_usage_perc") == 0, "the aborted request's blocks were not freed"


# -- kvbridge route in front of the same servers -----------------------------------------------

ROUTE_PLUGIN = {"host": "127.0.0.1", "on_failure": "fail", "peer_timeout_s": 3.0, "deadline_s": 30.0,
                "sglang_bootstrap_port": 0, "sglang_page_size": 1}


@pytest.fixture(scope="module")
def trt_http(model_dir):
    """A TensorRT-LLM 1.2 stand-in behind trtllm-serve's HTTP shape (in this process, its
    rank in its own), with an SGLang-compatible bootstrap server: prefill or decode, as each
    request's announcement makes it."""
    from kvbridge.demo.trtllm.http import StandInHTTP

    srv = StandInHTTP("1.2", model_dir, tokens_per_block=32, num_blocks=32, plugin=ROUTE_PLUGIN)
    yield srv
    srv.stop()


def _trt_state(srv) -> dict:
    return srv.stepper.call(lambda s: s.state())


def _new_trt_records(srv, before: dict, side: str, n: int, timeout_s: float = 30.0) -> dict:
    """The stand-in's ``side`` records (``finished_saves`` / ``finished_loads``) added since
    ``before``, waiting until ``n`` are there: a prefill's send ends when the decode's done
    message reaches it, which may come after the client already has its completion."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        now = _trt_state(srv).get(side) or {}
        new = {k: v for k, v in now.items() if k not in (before.get(side) or {})}
        if len(new) >= n or time.monotonic() > deadline:
            return new
        time.sleep(0.05)


def _route_cfg(model_dir, servers: list[dict], **sections):
    from kvbridge.demo.route_local import route_yaml
    from kvbridge.route.config import parse_config

    cfg = {"model": {"name": "tiny-llama", "tokenizer": str(model_dir)}, "servers": servers,
           "health": {"interval_s": 0.5, "fail_after": 1}, "deadlines": {"request_s": 120, "prefill_s": 60}, **sections}
    return parse_config(route_yaml(cfg))


def _server_entry(kind: str, role: str, model_dir, vllm_servers, sglang_pair, trt) -> dict:
    """One route.yaml server entry for the module's servers: ``kind`` is vllm0/vllm1,
    sglang, trtllm (with its bootstrap address) or trtllm-bus (only its bus)."""
    if kind.startswith("vllm"):
        v = vllm_servers[int(kind[-1])]
        e = {"name": kind, "engine": "vllm", "role": role, "url": v.url, "model": str(model_dir)}
        return {**e, "bootstrap": v.bootstrap_address} if role == "prefill" else e
    if kind == "sglang":
        s = sglang_pair.prefill if role == "prefill" else sglang_pair.decode
        e = {"name": f"sglang-{role}", "engine": "sglang", "role": role, "url": s.url}
        return {**e, "bootstrap": f"127.0.0.1:{sglang_pair.bootstrap_port}"} if role == "prefill" else e
    e = {"name": kind, "engine": "trtllm", "role": role, "url": trt.url, "bus": trt.bus}
    return {**e, "bootstrap": trt.bootstrap_address} if role == "prefill" and kind == "trtllm" else e


ROUTE_PAIRS = [("vllm0", "vllm1"), ("vllm1", "vllm0"), ("vllm0", "sglang"), ("sglang", "vllm1"), ("vllm0", "trtllm"),
               ("trtllm", "vllm1"), ("trtllm-bus", "vllm1")]


@pytest.mark.parametrize("pk,dk", ROUTE_PAIRS, ids=[f"{p}->{d}" for p, d in ROUTE_PAIRS])
def test_route_pairs_with_vllm(model_dir, vllm_servers, sglang_pair, trt_http, pk, dk):
    """``kvbridge route`` in front of a prefill and a decode, vLLM on one side or both: the
    ``openai`` client's completions (one streamed, one not, at once) equal transformers'
    ``generate()``; the route's metrics count the engine pair; each vLLM side's own records
    say the KV moved (the prompt's bytes, the room the router chose), and a vLLM decode
    computed none of the prompt itself (``external_kv_transfer``). A TensorRT-LLM prefill
    known only by its bus is reached through the rank endpoints the router looked up."""
    from openai import OpenAI

    from kvbridge.demo.vllm_flows import _external_tokens, _wait_record
    from kvbridge.route.app import BackgroundRouter
    from tests.helpers.route_client import complete

    p_e = _server_entry(pk, "prefill", model_dir, vllm_servers, sglang_pair, trt_http)
    d_e = _server_entry(dk, "decode", model_dir, vllm_servers, sglang_pair, trt_http)
    cfg = _route_cfg(model_dir, [p_e, d_e], cost={"enabled": False})
    route = f"{p_e['engine']}->{d_e['engine']}"
    cases = [reference(model_dir, n) for n in LENS]
    vdec = vllm_servers[int(dk[-1])] if dk.startswith("vllm") else None
    ext0 = _external_tokens(vdec) if vdec is not None else 0.0
    trt0 = _trt_state(trt_http)
    with BackgroundRouter(cfg) as router:
        c = OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=120)

        def ask(i):
            return complete(c, cases[i][0], stream=bool(i % 2), max_tokens=MAX_NEW, extra_body={"ignore_eos": True})

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as ex:
            out = list(ex.map(ask, range(len(cases))))
        m = router.router.metrics
        assert m.value("kvbridge_route_requests_total", {"route": route, "mode": "disaggregated"}) == len(cases)
        router.call(router.router.dispatcher.drain)
        assert m.value("kvbridge_route_room_aborts_total", {"engine": p_e["engine"]}) == 0
    for (ids, info), (prompt, ref) in zip(out, cases):
        assert ids == ref, (ids, ref, info, _handoff_evidence(out, vllm_servers, pk, dk))
        assert info["route"] == route and info["mode"] == "disaggregated" and info["servers"] == [p_e["name"], d_e["name"]]
        assert len(info["rooms"]) == 1 and not info["retries"], info
    rooms = [(info["rooms"][0], len(prompt)) for (_, info), (prompt, _) in zip(out, cases)]
    if pk.startswith("vllm"):
        for room, n in rooms:
            rec = _wait_record(vllm_servers[int(pk[-1])], room, "send")
            assert rec["ok"] and rec["record"]["bytes"] == n * KV_PER_TOKEN, rec
    if vdec is not None:
        for room, n in rooms:
            rec = _wait_record(vdec, room, "load")
            assert rec["ok"] and rec["record"]["bytes"] == n * KV_PER_TOKEN, rec
        assert _external_tokens(vdec) - ext0 == sum(LENS), "the vLLM decode loaded every prompt token"
    if "trtllm" in (pk, dk):
        side = "finished_loads" if dk == "trtllm" else "finished_saves"
        new = _new_trt_records(trt_http, trt0, side, len(cases))
        assert len(new) == len(cases), new
        if side == "finished_loads":
            assert all(v.get("verdict") == "ok" for v in new.values()), new
        else:
            assert all(v.get("ok") for v in new.values()), new


def _handoff_evidence(out, vllm_servers, pk: str, dk: str) -> dict:
    """What each vLLM side recorded of the rooms of ``out`` (the router's answers), for a
    failure message: block ids, bytes, timing (a record not written yet shows as None)."""
    got = {}
    for _, info in out:
        for room in info.get("rooms") or ():
            for kind, side in ((pk, "send"), (dk, "load")):
                if kind.startswith("vllm"):
                    got[f"{kind} {side} {room}"] = vllm_servers[int(kind[-1])].record_of(room, side)
    return got


def test_route_short_prompt_is_computed_by_the_vllm_decode_alone(model_dir, vllm_servers):
    """Below the pair's break-even the router sends the request to the vLLM decode with no
    handle: vLLM computes the prompt itself (nothing loaded, no room), the tokens are
    transformers'; a long prompt is still moved vLLM -> vLLM."""
    from openai import OpenAI

    from kvbridge.demo.vllm_flows import _external_tokens
    from kvbridge.route.app import BackgroundRouter

    v0, v1 = vllm_servers
    cfg = _route_cfg(model_dir, [{"name": "v0", "engine": "vllm", "role": "prefill", "url": v0.url,
                                  "bootstrap": v0.bootstrap_address, "model": str(model_dir)},
                                 {"name": "v1", "engine": "vllm", "role": "decode", "url": v1.url,
                                  "model": str(model_dir)}],
                     cost={"prefill_tps": 20000.0, "decode_prefill_tps": 10000.0})
    short, long_ = reference(model_dir, 8), reference(model_dir, LENS[0])
    ext0 = _external_tokens(v1)
    with BackgroundRouter(cfg) as router:
        be = router.router.gates.break_even()["tcp"]
        assert 8 < be < LENS[0], be
        c = OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=120)
        args = dict(model="tiny-llama", max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True})
        rs = c.completions.create(prompt=short[0], **args)
        rl = c.completions.create(prompt=long_[0], **args)
        m = router.router.metrics
        assert m.value("kvbridge_route_recomputed_total", {"route": "vllm", "why": "below_break_even"}) == 1
        assert m.value("kvbridge_route_requests_total", {"route": "vllm->vllm", "mode": "disaggregated"}) == 1
    assert rs.choices[0].model_extra["token_ids"] == short[1]
    assert rl.choices[0].model_extra["token_ids"] == long_[1]
    info = rs.model_extra["kvbridge"]
    assert info["mode"] == "recomputed" and info["servers"] == ["v1"] and info["rooms"] == [], info
    assert _external_tokens(v1) - ext0 == LENS[0], "only the long prompt's KV was loaded"


def test_route_check_probes_vllm_servers(model_dir, vllm_servers, sglang_pair):
    """``kvbridge route --check`` on vLLM servers: engine and version (``/version``,
    ``/v1/models``), the model name the router sends served, a decode's KV connector in a
    consuming role (vLLM's metrics), a prefill's kvbridge bootstrap server and published
    layout against the model, the page size an SGLang decode needs; each wrong setting
    fails the check naming it."""
    import asyncio

    from kvbridge.route.check import check, format_report

    v0, v1 = vllm_servers
    servers = [{"name": "v0", "engine": "vllm", "role": "prefill", "url": v0.url, "bootstrap": v0.bootstrap_address,
                "model": str(model_dir)},
               {"name": "v1", "engine": "vllm", "role": "decode", "url": v1.url, "model": str(model_dir)},
               {"name": "d0", "engine": "sglang", "role": "decode", "url": sglang_pair.decode.url}]
    rep = asyncio.run(check(_route_cfg(model_dir, servers)))
    text = format_report(rep)
    assert rep["ok"], text
    by = {r["name"]: {c["check"]: c for c in r["checks"]} for r in rep["servers"]}
    assert by["v0"]["engine"]["detail"].startswith("vLLM 0.") and "owned_by ['vllm']" in by["v0"]["engine"]["detail"]
    assert by["v1"]["KV connector (consumer)"]["ok"] and "bootstrap" in by["v0"]
    assert {r["name"]: r.get("layout", {}).get("head_dim") for r in rep["servers"]}["v0"] == 32
    assert any(c["check"] == "page size v0 -> d0" and c["ok"] for c in rep["cross"]), text
    # the wrong model name (vLLM serves its --model path), and the wrong engine
    bad = [dict(servers[0], model="tiny-llama"), dict(servers[1], engine="trtllm", bus="tcp://127.0.0.1:1"),
           servers[2]]
    rep = asyncio.run(check(_route_cfg(model_dir, bad), timeout_s=2.0))
    by = {r["name"]: {c["check"]: c for c in r["checks"]} for r in rep["servers"]}
    assert not rep["ok"] and not by["v0"]["model"]["ok"] and "set this server's `model:`" in by["v0"]["model"]["detail"]
    assert not by["v1"]["kvbridge connector"]["ok"], format_report(rep)
    assert not by["v1"]["engine"]["ok"] and "a vLLM server" in by["v1"]["engine"]["detail"], format_report(rep)


def test_route_vllm_decode_failure_aborts_the_vllm_prefill_room(model_dir, vllm_servers):
    """A decode half that fails (vLLM answers 404: the router sends a model name it does not
    serve) ends the request with 502 naming the decode; the router aborts the room on the
    vLLM prefill, which ends it at once (its own deadline is 30 s) and frees the prompt's
    blocks."""
    import json
    import re
    import time
    import urllib.error
    import urllib.request

    from kvbridge.demo.vllm_flows import _wait_record
    from kvbridge.route.app import BackgroundRouter

    v0, v1 = vllm_servers
    cfg = _route_cfg(model_dir, [{"name": "v0", "engine": "vllm", "role": "prefill", "url": v0.url,
                                  "bootstrap": v0.bootstrap_address, "model": str(model_dir)},
                                 {"name": "v1", "engine": "vllm", "role": "decode", "url": v1.url,
                                  "model": "not-served"}], cost={"enabled": False})
    prompt, _ = reference(model_dir, LENS[0])
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with BackgroundRouter(cfg) as router:
        t0 = time.monotonic()
        try:
            opener.open(urllib.request.Request(router.url + "/v1/completions", body,
                                               {"Content-Type": "application/json"}), timeout=60)
            raise AssertionError("the request succeeded")
        except urllib.error.HTTPError as e:
            status, err = e.code, json.loads(e.read())["error"]
        assert status == 502 and err["reason"] == "decode_failed", (status, err)
        assert "decode v1 failed" in err["message"] and "404" in err["message"], err
        room = int(re.search(r"room (\d+) aborted on prefill v0", err["message"]).group(1))
        rec = _wait_record(v0, room, "send", timeout=20)
        took = time.monotonic() - t0
        router.call(router.router.dispatcher.drain)
        assert router.router.metrics.value("kvbridge_route_room_aborts_total", {"engine": "vllm"}) == 1
        assert router.router.metrics.value("kvbridge_route_failures_total",
                                           {"route": "vllm->vllm", "reason": "decode_failed"}) == 1
    assert not rec["ok"] and took < 15, (took, rec)
    end = time.monotonic() + 20
    while v0.metric("vllm:kv_cache_usage_perc") > 0 and time.monotonic() < end:
        time.sleep(0.2)
    assert v0.metric("vllm:kv_cache_usage_perc") == 0, "the aborted room's blocks were not freed"
