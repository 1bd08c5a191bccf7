"""vLLM's REAL server (CPU, the kvbridge connector) on either side of a handoff.

Two vLLM servers (``kv_both``, started once for the module, in the vLLM venv) play
prefill and decode; SGLang's REAL servers (the kvbridge backend, one pair for the
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

from kvbridge.demo.models import build_tiny_llama_hd32, random_prompt, reference_generate
from vllm_env import requires_vllm

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

MAX_NEW = 12
LENS = (70, 33)
KV_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers x K/V x KV heads x head_dim x float32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama_hd32(tmp_path_factory.mktemp("vllm") / "tiny-llama-hd32")


@pytest.fixture(scope="module")
def vllm_servers(model_dir, tmp_path_factory):
    """Two vLLM servers, each prefill and decode (kv_both), started together."""
    from kvbridge.demo.sglang_server import wait_healthy
    from kvbridge.demo.vllm_server import start_vllm_server

    logs = tmp_path_factory.mktemp("vllm-logs")
    settings = {"discovery_timeout_s": 3.0, "deadline_s": 30.0}
    servers = [start_vllm_server(model_dir, "kv_both", log_dir=logs, settings=settings, wait=False) for _ in range(2)]
    try:
        wait_healthy(servers, 400, lambda: "\n".join(f"--- {s.log_path} ---\n{s.log_tail(40)}" for s in servers))
        yield servers
    finally:
        for s in servers:
            s.kill()


@pytest.fixture(scope="module")
def sglang_pair(model_dir):
    pytest.importorskip("sglang")
    from conftest_sglang import get_pair

    return get_pair("kvbridge", model_dir=model_dir, extra_env={"SGLANG_PLUGINS": "kvbridge"})


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
    from kvbridge.adapters.vllm.handle import Handle
    from kvbridge.demo.sglang_server import free_port, new_room
    from kvbridge.demo.vllm_flows import _external_tokens, _wait_record
    from kvbridge.demo.vllm_server import complete

    decode = vllm_servers[1]
    prompt, ref = reference(model_dir, LENS[1])
    room = new_room()
    ext0 = _external_tokens(decode)
    d = complete(decode, prompt, MAX_NEW, Handle("recv", room, bootstrap=f"127.0.0.1:{free_port()}").to_params())
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

    pytest.importorskip("sglang")
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

    from kvbridge.adapters.vllm.handle import Handle
    from kvbridge.demo.sglang_server import new_room, post_json
    from kvbridge.demo.vllm_flows import _wait_record
    from kvbridge.demo.vllm_server import complete

    prefill, decode = vllm_servers
    prompt, ref = reference(model_dir, LENS[0])
    room = new_room()
    body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "kv_transfer_params": Handle("recv", room, bootstrap=prefill.bootstrap_address).to_params()}
    res = post_json(decode.url + "/v1/completions", body, 3.0)
    assert isinstance(res, Exception), "the load cannot finish: the prefill never opened the room"
    rec = _wait_record(decode, room, "load", timeout=30)
    assert not rec["ok"] and "aborted while loading" in rec["reason"], rec
    end = time.monotonic() + 20
    while decode.metric("vllm:kv_cache_usage_perc") > 0 and time.monotonic() < end:
        time.sleep(0.2)
    assert decode.metric("vllm:kv_cache_usage_perc") == 0, "the aborted request's blocks were not freed"
    assert complete(decode, prompt, MAX_NEW)["token_ids"] == ref
