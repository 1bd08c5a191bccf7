"""SGLang's REAL server pair on CPU with ``--disaggregation-transfer-backend kvbridge``.

The backend is picked up from kvbridge's installed ``sglang.srt.plugins`` entry point in
every server process. Greedy float32 outputs must equal transformers' ``generate()`` on
the same tiny model, and so the outputs of the same pair on SGLang's own ``mooncake``
backend (test_sglang_server_mooncake.py, same prompts). Servers start once per test
session (``tests.helpers.sglang_pairs``). A second decode server with --page-size 16 joins
the pair once (prefill page 1 -> decode page 16). The test that kills the prefill comes last.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.kvhelpers import wait_until
from tests.helpers.sglang_pairs import KVBRIDGE
from tests.helpers.tiny_models import random_prompt, reference_generate
from tests.sglang.test_sglang_server_mooncake import MAX_NEW as MOONCAKE_MAX_NEW, PROMPTS

# a test that starts servers (a pair in its fixture, or one more decode) waits ~20 s per
# start on an idle 2-core machine and minutes on a loaded one: more than the default 300 s
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_NEW = 16


@pytest.fixture
def kvbridge_pair(sglang_pair_factory, tiny_llama_dir):
    return sglang_pair_factory("kvbridge", model_dir=tiny_llama_dir, **KVBRIDGE)


def receiving(srv) -> float:
    """Rooms a decode server's kvbridge receiver has asked a prefill for and not ended
    (``kvbridge_handoffs_inflight{role="receiver"}`` in its ``/metrics``, every process)."""
    import requests

    text = requests.get(srv.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvbridge_handoffs_inflight{") and 'role="receiver"' in line)


def test_kvbridge_pair_matches_transformers_and_mooncake(kvbridge_pair, tiny_llama_dir):
    """The requests of test_sglang_server_mooncake.py's ``test_pair_matches_transformers``
    (same prompts, same new tokens), which holds the mooncake pair's outputs to the same
    transformers reference: equal to it here is equal to the mooncake pair's there,
    without a mooncake pair started (and stopped again) for this module."""
    prompts = [random_prompt(n, seed=n) for n in PROMPTS]
    refs = [reference_generate(tiny_llama_dir, p, MOONCAKE_MAX_NEW).token_ids for p in prompts]
    for p, ref in zip(prompts, refs):
        t0 = time.monotonic()
        got = kvbridge_pair.generate(p, MOONCAKE_MAX_NEW)
        dt = time.monotonic() - t0
        assert got == ref, f"{len(p)}-token prompt: kvbridge pair {got} != transformers {ref}"
        print(f"[kvbridge pair] {len(p)}-token prompt, {MOONCAKE_MAX_NEW} new tokens: {dt:.2f}s")


def test_kvbridge_pair_concurrent_requests(kvbridge_pair, tiny_llama_dir):
    prompts = [random_prompt(n, seed=200 + n) for n in (5, 23, 64, 150)]
    refs = [reference_generate(tiny_llama_dir, p, MAX_NEW).token_ids for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: kvbridge_pair.generate(p, MAX_NEW), prompts))
    for p, got, ref in zip(prompts, outs, refs):
        assert got == ref, f"{len(p)}-token prompt (concurrent): kvbridge pair {got} != transformers {ref}"
        # read from SGLang's decode pool: every prompt row is transformers' K/V, nothing beyond it
        kvbridge_pair.probe("decode").assert_landed(tiny_llama_dir, p, prefix=0)
    kvbridge_pair.probe("decode").assert_clean()
    # SGLang's loader applied the hook that notes the model's fp8 KV scales, in each scheduler
    for srv in (kvbridge_pair.prefill, kvbridge_pair.decode):
        log = srv.log_path.read_text(errors="replace")
        assert "the model's KV scales noted: 2 attention layer(s)" in log, kvbridge_pair.log_tails(30)


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


def test_decode_abort_while_waiting_for_kv_ends_the_room_on_both_servers(kvbridge_pair, tiny_llama_dir):
    """A client aborts its decode request (SGLang's ``/abort_request``) while the decode
    server waits for the KV (the prefill has not been asked yet): the decode answers with
    an abort; the prefill request for that room, sent afterwards, ends within the handoff
    timeouts instead of holding its KV; SGLang's own allocators on both servers have every
    page back, none freed twice; both servers stay healthy and the next request
    through the pair equals transformers' output (the same behaviour tests/helpers/sglang_peers.py
    drives by hand, through the real servers)."""
    import requests

    from tests.helpers.sglang_servers import _post

    prompt = random_prompt(40, seed=77)
    body = kvbridge_pair.request_body(prompt, 4)
    rid = f"abort-{body['bootstrap_room']}"
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_post, kvbridge_pair.decode.url + "/generate", {**body, "rid": rid}, 90)
        # the decode admitted the request and its receiver asked the prefill for the room
        end = time.monotonic() + 60
        while receiving(kvbridge_pair.decode) < 1 and time.monotonic() < end:
            time.sleep(0.05)
        assert receiving(kvbridge_pair.decode) >= 1, "the decode never asked the prefill for the room"
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
    # SGLang's own allocators: every page of the room back in the free list (the prefill's
    # pinned ones included: nothing protected in its radix cache), none freed twice, and no
    # byte landed in a free page of the decode's pool
    kvbridge_pair.probe("decode").assert_clean()
    kvbridge_pair.probe("prefill").assert_clean(cached=True)
    nxt = random_prompt(33, seed=78)
    assert kvbridge_pair.generate(nxt, MAX_NEW) == reference_generate(tiny_llama_dir, nxt, MAX_NEW).token_ids
    print(f"[kvbridge pair] decode abort: prefill answered {pre.status_code} in {dt:.1f}s: {pre.text[:300]}")


# the prefill's writes: 16 KiB pieces, the transport's own in-flight bound, the second held
HELD = dict(piece_bytes=16 << 10, inflight=0, delay_s=0.0, started_at=2, hold_s=120.0)


def test_decode_abort_with_a_piece_in_flight_keeps_sglangs_pages_until_the_prefill_is_quiet(
        kvbridge_pair, tiny_llama_dir):
    """A client aborts its decode request while a piece of the prefill's write is held past
    its write guard (``Pair.switch``): SGLang's own allocator on the decode does not get the
    request's pages back while that piece can still land (read in its free list, not from
    kvbridge's gauges); let go, the piece lands in pages SGLang still holds (no byte in a
    free page of its pool), then every page comes back once, on both servers, and the
    pair serves on with outputs equal to transformers'."""
    import requests

    from tests.helpers.sglang_servers import _post

    pair, sw = kvbridge_pair, kvbridge_pair.switch()
    dec, pre = pair.probe("decode"), pair.probe("prefill")
    size = dec.assert_clean()["size"]
    prompt = random_prompt(512, seed=4242)
    body = pair.request_body(prompt, 4)
    rid = f"held-{body['bootstrap_room']}"
    sw.on(HELD, hold=True)
    try:
        with ThreadPoolExecutor(2) as ex:
            fut_d = ex.submit(_post, pair.decode.url + "/generate", {**body, "rid": rid}, 120)
            fut_p = ex.submit(_post, pair.prefill.url + "/generate", body, 120)
            wait_until(sw.started, 90, "the prefill's write under way, its second piece held")
            ab = requests.post(pair.decode.url + "/abort_request", json={"rid": rid}, timeout=30)
            assert ab.status_code == 200, ab.text
            res_d = fut_d.result(timeout=120)
            assert not isinstance(res_d, BaseException), res_d
            assert res_d.status_code != 200 or '"abort"' in res_d.text, res_d.text[:500]
            # the decode aborted the room; a piece is still on its way into its pages
            time.sleep(3.0)  # well past quiesce_s (1 s) and a heartbeat: time for an early release to show
            held = dec.state()
            assert held["available"] < size, f"SGLang's allocator got the pages back while a piece was held: {held}"
            sw.release()  # the piece lands; the prefill settles and says so; the decode releases
            fut_p.result(timeout=120)
    finally:
        sw.off()
        sw.release()
    dec.assert_clean()  # every page back once, none written while free
    pre.assert_clean(cached=True)
    nxt = random_prompt(45, seed=4243)
    assert pair.generate(nxt, MAX_NEW) == reference_generate(tiny_llama_dir, nxt, MAX_NEW).token_ids
    dec.assert_landed(tiny_llama_dir, nxt, prefix=0)


def test_strangers_cannot_repoint_a_rank_or_abort_a_room(kvbridge_pair, tiny_llama_dir):
    """With the deployment's secret set (as every test server runs, tests/conftest.py):
    a stranger's unsealed ``PUT /route`` naming rank 0 at its own address is refused
    with 401 and the rank's sealed ``GET /route`` answer still names the real rank; and
    unsigned ``[ABORT, room]`` frames (plus ones sealed with another key) sent to the
    prefill rank's SGLang socket throughout an honest request for that very room abort
    nothing: its output equals transformers'."""
    import json
    import threading
    import urllib.error
    import urllib.request

    import zmq

    from kvbridge.adapters.sglang.manager import ABORT_DOMAIN, abort_seal_payload
    from kvbridge.common.auth import Keyring
    from kvbridge.common.bootstrap import open_route_info
    from kvbridge.common.settings import BridgeSettings
    from tests.helpers.sglang_servers import new_room

    ring = BridgeSettings.load().keyring()
    assert ring is not None, "the test servers run with KVBRIDGE_SECRET (tests/conftest.py)"
    boot = f"http://127.0.0.1:{kvbridge_pair.bootstrap_port}"
    q = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    with urllib.request.urlopen(boot + q, timeout=10) as r:
        info = open_route_info(json.loads(r.read()), (0, 0, 0, 0), ring)
    forged = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
              "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
              "rank_ip": "127.0.0.1", "rank_port": 1, "page_size": 1, "kv_cache_dtype": "auto",
              "kvbridge": {**info["kvbridge"], "endpoint": "tcp://127.0.0.1:1"}}
    put = urllib.request.Request(boot + "/route", data=json.dumps(forged).encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(put, timeout=10)
    assert e.value.code == 401 and "KVBRIDGE_SECRET" in e.value.read().decode()
    with urllib.request.urlopen(boot + q, timeout=10) as r:
        again = open_route_info(json.loads(r.read()), (0, 0, 0, 0), ring)
    assert (again["rank_ip"], again["rank_port"], again["kvbridge"]) == (info["rank_ip"], info["rank_port"],
                                                                          info["kvbridge"])

    room = new_room()
    target = f"{info['rank_ip']}:{info['rank_port']}"
    stranger = Keyring("a-stranger-with-its-own-key-0123456")
    stop = threading.Event()
    sent = [0]

    def flood():
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{target}")
        try:
            while not stop.is_set():
                frames = [b"ABORT", str(room).encode()]
                sock.send_multipart(frames)
                sock.send_multipart([*frames, stranger.seal(abort_seal_payload(target, frames), ABORT_DOMAIN)])
                sent[0] += 2
                time.sleep(0.005)
        finally:
            sock.close(0)

    prompt = random_prompt(120, seed=131)
    ref = reference_generate(tiny_llama_dir, prompt, MAX_NEW).token_ids
    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        time.sleep(0.2)
        got = kvbridge_pair.generate(prompt, MAX_NEW, room=room)
    finally:
        stop.set()
        t.join(10)
    assert sent[0] > 20, sent
    assert got == ref, f"room {room} under {sent[0]} forged ABORT frames: {got} != transformers {ref}"
    log = kvbridge_pair.prefill.log_path.read_text(errors="replace")
    assert "refused sglang aborts" in log and "ABORT notice" in log, kvbridge_pair.log_tails()
    print(f"[kvbridge pair] forged PUT refused (401); {sent[0]} forged ABORT frames for room {room} refused")


def test_decode_fails_cleanly_when_prefill_is_gone_and_stays_healthy(kvbridge_pair, tiny_llama_dir):
    """Kill the prefill server: a request to the decode server fails with a clear error
    well within the configured timeouts (30 s + 30 s here), and the decode server keeps
    answering /health. Last in this module: the pair it leaves without a prefill is used by
    no later test (the fixture would restart it for one)."""
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
