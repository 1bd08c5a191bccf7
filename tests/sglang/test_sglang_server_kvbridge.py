"""SGLang's REAL server pair on CPU with ``--disaggregation-transfer-backend kvbridge``.

The backend is picked up from kvbridge's installed ``sglang.srt.plugins`` entry point in
every server process. Greedy float32 outputs must equal transformers' ``generate()`` on
the same tiny model, and the outputs of the same pair on SGLang's own ``mooncake``
backend. Servers start once per test session (``tests.helpers.sglang_pairs``). A second decode
server with --page-size 16 joins the pair once (prefill page 1 -> decode page 16).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.tiny_models import random_prompt, reference_generate

# a test that starts servers (a pair in its fixture, or one more decode) waits ~20 s per
# start on an idle 2-core machine and minutes on a loaded one: more than the default 300 s
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_NEW = 16
PROMPTS = [4, 37, 300]


@pytest.fixture
def kvbridge_pair(sglang_pair_factory, tiny_llama_dir):
    return sglang_pair_factory("kvbridge", model_dir=tiny_llama_dir, extra_env={"SGLANG_PLUGINS": "kvbridge"})


def test_kvbridge_pair_matches_transformers_and_mooncake(sglang_pair_factory, tiny_llama_dir):
    prompts = [random_prompt(n, seed=n) for n in PROMPTS]
    refs = [reference_generate(tiny_llama_dir, p, MAX_NEW).token_ids for p in prompts]
    mooncake = sglang_pair_factory("mooncake", model_dir=tiny_llama_dir)
    via_mooncake = [mooncake.generate(p, MAX_NEW) for p in prompts]
    kv = sglang_pair_factory("kvbridge", model_dir=tiny_llama_dir, extra_env={"SGLANG_PLUGINS": "kvbridge"})
    for p, ref, mc in zip(prompts, refs, via_mooncake):
        t0 = time.monotonic()
        got = kv.generate(p, MAX_NEW)
        dt = time.monotonic() - t0
        assert got == ref, f"{len(p)}-token prompt: kvbridge pair {got} != transformers {ref}"
        assert got == mc, f"{len(p)}-token prompt: kvbridge pair {got} != mooncake pair {mc}"
        print(f"[kvbridge pair] {len(p)}-token prompt, {MAX_NEW} new tokens: {dt:.2f}s")


def test_kvbridge_pair_concurrent_requests(kvbridge_pair, tiny_llama_dir):
    prompts = [random_prompt(n, seed=200 + n) for n in (5, 23, 64, 150)]
    refs = [reference_generate(tiny_llama_dir, p, MAX_NEW).token_ids for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: kvbridge_pair.generate(p, MAX_NEW), prompts))
    for p, got, ref in zip(prompts, outs, refs):
        assert got == ref, f"{len(p)}-token prompt (concurrent): kvbridge pair {got} != transformers {ref}"


def test_prefill_page_1_to_decode_page_16(kvbridge_pair, tiny_llama_dir):
    """A second decode server with --page-size 16 pulls from the pair's prefill (page 1):
    concurrent prompts that do not fill their last decode page, outputs equal to transformers'."""
    dec16 = kvbridge_pair.add_decode("page16", page_size=16)
    try:
        prompts = [random_prompt(n, seed=116 + n) for n in (3, 21, 47, 90, 161)]
        assert all(len(p) % 16 for p in prompts)
        refs = [reference_generate(tiny_llama_dir, p, MAX_NEW).token_ids for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(lambda p: kvbridge_pair.generate(p, MAX_NEW, decode=dec16), prompts))
        for p, got, ref in zip(prompts, outs, refs):
            assert got == ref, f"{len(p)}-token prompt (page 1 -> 16): {got} != transformers {ref}"
    finally:
        kvbridge_pair.extra.pop("page16").kill()


def test_decode_fails_cleanly_when_prefill_is_gone_and_stays_healthy(kvbridge_pair, tiny_llama_dir):
    """Kill the prefill server: a request to the decode server fails with a clear error
    well within the configured timeouts (30 s + 30 s here), and the decode server keeps
    answering /health. (The fixture restarts the pair for later tests.)"""
    import requests

    from tests.helpers.sglang_servers import _post

    prompt = random_prompt(20, seed=99)
    kvbridge_pair.generate(prompt, 2)  # warm: the decode has met this prefill
    kvbridge_pair.kill_prefill()
    body = kvbridge_pair.request_body(prompt, 4)
    t0 = time.monotonic()
    res = _post(kvbridge_pair.decode.url + "/generate", body, 90)
    dt = time.monotonic() - t0
    assert not isinstance(res, BaseException), res
    text = res.text
    failed = res.status_code != 200 or '"abort"' in text
    assert failed, f"decode answered {res.status_code} {text[:500]} with no prefill alive"
    assert dt < 60 + 1, f"the failure took {dt:.1f}s"
    assert any(w in text.lower() for w in ("prefill", "bootstrap", "unreachable", "timeout", "failed")), text[:1000]
    assert requests.get(kvbridge_pair.decode.url + "/health", timeout=10).status_code == 200
    print(f"[kvbridge pair] dead prefill: decode failed the request in {dt:.1f}s: {text[:300]}")


def test_decode_abort_while_waiting_for_kv_ends_the_room_on_both_servers(kvbridge_pair, tiny_llama_dir):
    """A client aborts its decode request (SGLang's ``/abort_request``) while the decode
    server waits for the KV (the prefill has not been asked yet): the decode answers with
    an abort; the prefill request for that room, sent afterwards, ends within the handoff
    timeouts instead of holding its KV; both servers stay healthy and the next request
    through the pair equals transformers' output (the same behaviour tests/helpers/sglang_peers.py
    drives by hand, through the real servers)."""
    import requests

    from tests.helpers.sglang_servers import _post

    prompt = random_prompt(40, seed=77)
    body = kvbridge_pair.request_body(prompt, 4)
    rid = f"abort-{body['bootstrap_room']}"
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_post, kvbridge_pair.decode.url + "/generate", {**body, "rid": rid}, 90)
        # give the decode time to admit the request (milliseconds) and make its receiver:
        # nothing over HTTP shows that
        time.sleep(2.0)
        ab = requests.post(kvbridge_pair.decode.url + "/abort_request", json={"rid": rid}, timeout=30)
        assert ab.status_code == 200, ab.text
        res = fut.result(timeout=90)
    assert not isinstance(res, BaseException), res
    assert res.status_code != 200 or '"abort"' in res.text, f"decode answered {res.status_code} {res.text[:500]}"
    t0 = time.monotonic()
    pre = _post(kvbridge_pair.prefill.url + "/generate", body, 120)
    dt = time.monotonic() - t0
    assert not isinstance(pre, BaseException), pre
    assert dt < 60 + 1, f"the prefill's room for the aborted decode took {dt:.1f}s to end"
    # kvbridge's decode receiver declined the room when SGLang aborted it: the prefill names that
    assert pre.status_code != 200 and "aborted by decode" in pre.text, pre.text
    for srv in (kvbridge_pair.prefill, kvbridge_pair.decode):
        assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    nxt = random_prompt(33, seed=78)
    assert kvbridge_pair.generate(nxt, MAX_NEW) == reference_generate(tiny_llama_dir, nxt, MAX_NEW).token_ids
    print(f"[kvbridge pair] decode abort: prefill answered {pre.status_code} in {dt:.1f}s: {pre.text[:300]}")
