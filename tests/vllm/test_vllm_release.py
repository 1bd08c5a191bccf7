"""The release rule and the integrity policy with REAL vLLM servers on both sides:

- a decode whose client goes away while a piece of the prefill's write is held past its
  write guard keeps the request's blocks (vLLM does not get the load reported) until the
  prefill proved quiet, then frees them, and serves on with outputs equal to transformers';
- a load whose content differs from what the prefill moved (one byte flipped in flight,
  the session's ``KVBRIDGE_INTEGRITY=on``) is reported failed, naming the mismatch, and
  vLLM recomputes the prompt (``kv_load_failure_policy=recompute``): the output equals
  transformers' and no prompt token counts as loaded.

The prefill's writes obey the parent's ``FaultSwitch`` (tests/helpers/server_hooks puts
``install_test_hooks`` in every process of these servers): 16 KiB pieces, the transport's
own in-flight bound (up to 1024 per peer: every piece of the room is submitted at once),
the second piece held until the test lets it go.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvbridge.demo.models import random_prompt, reference_generate
from tests.helpers.kvhelpers import FaultSwitch
from tests.helpers.vllm_env import requires_vllm
from tests.vllm.test_vllm_servers import MAX_NEW, assert_blocks_freed

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
HELD = dict(piece_bytes=16 << 10, inflight=0, delay_s=0.0, started_at=2, hold_s=120.0)
FLIP = dict(piece_bytes=0, inflight=0, delay_s=0.0, started_at=1, flip=True)


@pytest.fixture(scope="module")
def hooked_servers(model_dir, tmp_path_factory):
    """A vLLM prefill and a vLLM decode (kv_both each) whose transports obey one switch."""
    from kvbridge.demo.sglang_server import wait_healthy
    from kvbridge.demo.vllm_server import start_vllm_server

    sw = FaultSwitch()
    logs = tmp_path_factory.mktemp("vllm-release-logs")
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'helpers' / 'server_hooks'}:{ROOT}", "KVBRIDGE_TEST_HOOKS_DIR": sw.dir}
    settings = {"discovery_timeout_s": 3.0, "deadline_s": 30.0, "quiesce_s": 0.5}
    servers = [start_vllm_server(model_dir, "kv_both", log_dir=logs, settings=settings, extra_env=env, wait=False)
               for _ in range(2)]
    try:
        wait_healthy(servers, 400, lambda: "\n".join(f"--- {s.log_path} ---\n{s.log_tail(40)}" for s in servers))
        yield servers, sw
    finally:
        for s in servers:
            s.kill()
        sw.close()


def test_decode_abort_keeps_blocks_until_the_prefill_is_quiet(model_dir, hooked_servers):
    from kvbridge.adapters.vllm.handle import Handle, to_params
    from kvbridge.demo.sglang_server import new_room, post_json
    from kvbridge.demo.vllm_flows import _wait_record
    from kvbridge.demo.vllm_server import complete

    (prefill, decode), sw = hooked_servers
    prompt = random_prompt(512, seed=4242)
    room = new_room()
    p = complete(prefill, prompt, 1, to_params(Handle("send", room)))
    sw.on(HELD, hold=True)
    body = {"model": str(model_dir), "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0.0,
            "kv_transfer_params": p["kv_transfer_params"]}
    t0 = time.monotonic()
    res = post_json(decode.url + "/v1/completions", body, 3.0)  # the client gives up after 3 s: vLLM aborts it
    assert isinstance(res, Exception), "the load finished although a piece of it was held"
    assert sw.started(), "the prefill's write never got under way"
    # the decode aborted the room (its client left); the prefill still holds a piece past its guard
    time.sleep(max(0.0, t0 + 3.0 + 2.0 - time.monotonic()))  # well past quiesce_s (0.5 s)
    assert decode.metric("vllm:kv_cache_usage_perc") > 0, "vLLM freed the blocks while a piece was still on its way"
    assert decode.record_of(room, "load") is None, "the load was reported while a piece was still on its way"
    sw.release()  # the piece lands, in blocks vLLM still holds; the prefill settles and says so
    rec = _wait_record(decode, room, "load", timeout=30)
    assert not rec["ok"] and "aborted" in rec["reason"], rec
    assert_blocks_freed(decode)
    sw.off()
    ref = reference_generate(model_dir, prompt, MAX_NEW).token_ids
    assert complete(decode, prompt, MAX_NEW)["token_ids"] == ref


def test_a_load_whose_content_differs_is_recomputed(model_dir, hooked_servers):
    from kvbridge.adapters.vllm.handle import Handle, to_params
    from kvbridge.demo.sglang_server import new_room
    from kvbridge.demo.vllm_flows import _external_tokens, _wait_record
    from kvbridge.demo.vllm_server import complete

    (prefill, decode), sw = hooked_servers
    prompt = random_prompt(300, seed=4343)
    ref = reference_generate(model_dir, prompt, MAX_NEW).token_ids
    room = new_room()
    p = complete(prefill, prompt, 1, to_params(Handle("send", room)))
    ext0 = _external_tokens(decode)
    sw.on(FLIP)
    try:
        d = complete(decode, prompt, MAX_NEW, p["kv_transfer_params"])
        assert sw.started(), "the prefill's write never got under way"
    finally:
        sw.off()
    rec = _wait_record(decode, room, "load")
    assert not rec["ok"] and "content digest mismatch" in rec["reason"], rec
    assert d["token_ids"] == ref, "vLLM did not recompute the prompt whose loaded content differed"
    assert _external_tokens(decode) - ext0 == 0, "prompt tokens counted as loaded from a room that failed its digest"
    assert_blocks_freed(decode)
    room = new_room()  # the next room through the same pair loads, verified
    p = complete(prefill, prompt[::-1], 1, to_params(Handle("send", room)))
    assert complete(decode, prompt[::-1], MAX_NEW, p["kv_transfer_params"])["token_ids"] == \
        reference_generate(model_dir, prompt[::-1], MAX_NEW).token_ids
    rec = _wait_record(decode, room, "load")
    assert rec["ok"] and rec["record"]["digest_s"] > 0, rec  # verified: its digest was taken and compared
