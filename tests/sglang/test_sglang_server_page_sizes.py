"""SGLang's REAL server pair on CPU, ``--disaggregation-transfer-backend kvbridge``, with
prefill and decode servers that differ.

SGLang's own backends refuse a prefill whose ``--page-size`` is not the decode's
(``try_ensure_parallel_info`` raises on the decode scheduler's event loop, which takes the
server down). kvbridge bridges it; here every greedy float32 output must equal
transformers' ``generate()`` on the same tiny model, and exactly the prompt's tokens land,
not whole pages: read in SGLang's decode pool by SGLang's own indexing when the KV has
arrived (``Pair.probe``, tests/helpers/sglang_probe.py), every prompt row equals
transformers' K/V and the rest of its pages still holds what was there; kvbridge's byte
counters (SGLang's ``/metrics`` with ``--enable-metrics``) agree. After each test SGLang's
allocator has every page back, none freed twice, and no free page was written. A decode server of another model fails its requests with the mismatch named,
while every server stays up.

Three pairs, one alive at a time (``tests.helpers.sglang_pairs``), each started once per session:
- prefill page 16 -> decode page 64, the prefill chunking prompts by 48 tokens; a third
  server, a decode of another tiny model, joins it for the incompatible case;
- prefill page 64 -> decode page 1, the decode reusing prefixes from its radix cache
  (prefixes that are not on the prefill's page grid) and the prefill sending prefixes it
  has cached before the rest of the prompt (``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX``);
- the MLA model, prefill page 64 -> decode page 16.
Prefill page 1 -> decode page 16 runs on the kvbridge pair of ``test_sglang_server_kvbridge``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.helpers.sglang_pairs import tiny_model_dir
from tests.helpers.tiny_models import random_prompt, reference_generate

# a test that starts servers (a pair in its fixture, or one more decode) waits ~20 s per
# start on an idle 2-core machine and minutes on a loaded one: more than the default 300 s
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_NEW = 8
PLUGIN_ENV = {"SGLANG_PLUGINS": "kvbridge"}
CHUNK = 48  # the 16 -> 64 prefill's --chunked-prefill-size
# tiny Llama (2 layers, 2 KV heads of 16, float32): K and V of one token
LLAMA_TOKEN_BYTES = 2 * 2 * 2 * 16 * 4


@pytest.fixture
def pair_16_64(sglang_pair_factory, tiny_llama_dir):
    return sglang_pair_factory("kvbridge", model_dir=tiny_llama_dir, page_size=16, decode_page_size=64,
                               extra_env=PLUGIN_ENV, extra_args=["--enable-metrics"], probe=True,
                               prefill_args=["--chunked-prefill-size", str(CHUNK)])


@pytest.fixture
def pair_64_1(sglang_pair_factory, tiny_llama_dir):
    return sglang_pair_factory(
        "kvbridge", model_dir=tiny_llama_dir, page_size=64, decode_page_size=1, extra_env=PLUGIN_ENV,
        extra_args=["--enable-metrics"], probe=True,
        # early send of a cached prefix: SGLang records a CUDA event there under the overlap scheduler
        prefill_args=["--disable-overlap-schedule"],
        prefill_env={"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "true"},
        decode_args=["--disaggregation-decode-enable-radix-cache"])


def received_bytes(srv) -> float:
    """kvbridge's ``kvbridge_handoff_bytes_total`` of a decode server (role receiver, all plans)."""
    text = requests.get(srv.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvbridge_handoff_bytes_total{") and 'role="receiver"' in line)


def healthy(*servers) -> list[bool]:
    return [requests.get(s.url + "/health", timeout=10).status_code == 200 for s in servers]


def run_concurrently(pair, prompts, model_dir, max_new=MAX_NEW, **kw):
    """Every prompt through the pair at once; each output must equal transformers', and each
    prompt's KV as it landed in SGLang's decode pool, transformers' K/V (nothing beyond it)."""
    refs = [reference_generate(model_dir, p, max_new).token_ids for p in prompts]
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: pair.generate(p, max_new, **kw), prompts))
    dt = time.monotonic() - t0
    for p, got, ref in zip(prompts, outs, refs):
        assert got == ref, f"{len(p)}-token prompt: pair {got} != transformers {ref}"
        pair.probe("decode").assert_landed(model_dir, p)
    return dt


def test_16_to_64_twelve_concurrent_requests(pair_16_64, tiny_llama_dir):
    """The issue's case: prefill --page-size 16, decode --page-size 64, 12 requests at once.
    No prompt fills its last page on either side, some are chunked by the prefill; exactly
    the prompts' tokens land on the decode (not its pages' worth)."""
    lengths = [5, 17, 23, 37, 50, 63, 65, 90, 101, 129, 150, 211]
    assert all(n % 16 for n in lengths) and any(n > CHUNK for n in lengths)
    prompts = [random_prompt(n, seed=1600 + n) for n in lengths]
    before = received_bytes(pair_16_64.decode)
    dt = run_concurrently(pair_16_64, prompts, tiny_llama_dir)
    moved = received_bytes(pair_16_64.decode) - before
    assert moved == sum(lengths) * LLAMA_TOKEN_BYTES, (moved, sum(lengths))
    pair_16_64.probe("decode").assert_clean()
    print(f"[kvbridge 16->64] 12 concurrent requests: {dt:.2f}s, {moved / 1024:.0f} KiB moved")


def test_16_to_64_chunked_prefill(pair_16_64, tiny_llama_dir):
    """A prompt much longer than the prefill's --chunked-prefill-size (48): the prefill sends
    it in chunks of 3 of its pages, each landing in the middle of a decode page."""
    prompt = random_prompt(307, seed=307)
    ref = reference_generate(tiny_llama_dir, prompt, MAX_NEW).token_ids
    before = received_bytes(pair_16_64.decode)
    got = pair_16_64.generate(prompt, MAX_NEW)
    assert got == ref, f"chunked 307-token prompt: pair {got} != transformers {ref}"
    pair_16_64.probe("decode").assert_landed(tiny_llama_dir, prompt, prefix=0)
    assert received_bytes(pair_16_64.decode) - before == 307 * LLAMA_TOKEN_BYTES
    pair_16_64.probe("decode").assert_clean()


def test_incompatible_decode_fails_requests_and_servers_stay_up(pair_16_64, tiny_llama_dir):
    """A decode server of another model (3 layers, 4 KV heads) pulls from the pair's prefill:
    its requests fail at once with an HTTP error naming the mismatch, on both servers; the
    prefill, that decode and the pair's own decode answer /health before and after, and the
    next request through the compatible decode succeeds."""
    other = pair_16_64.add_decode("other-model", model_dir=tiny_model_dir("llama_other"))
    try:
        servers = (pair_16_64.prefill, pair_16_64.decode, other)
        assert healthy(*servers) == [True] * 3
        bodies = [pair_16_64.request_body(random_prompt(n, seed=900 + n), 4) for n in (20, 45, 77)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(bodies)) as ex:
            answers = list(ex.map(lambda b: pair_16_64.post_both(b, 60, decode=other), bodies))
        dt = time.monotonic() - t0
        for res_p, res_d in answers:
            for role, res in (("prefill", res_p), ("decode", res_d)):
                assert not isinstance(res, BaseException), f"{role}: {res!r}"
                assert res.status_code >= 400, f"{role} answered {res.status_code}: {res.text[:500]}"
                text = res.text
                assert "num_layers: source 2 != destination 3" in text, f"{role}: {text[:1000]}"
                assert "total_heads: source 2 != destination 4" in text, f"{role}: {text[:1000]}"
        assert dt < 20, f"the failures took {dt:.1f}s (they must not wait for a timeout)"
        assert healthy(*servers) == [True] * 3
        prompt = random_prompt(45, seed=945)
        assert pair_16_64.generate(prompt, MAX_NEW) == reference_generate(tiny_llama_dir, prompt, MAX_NEW).token_ids
        print(f"[kvbridge 16->64] 3 requests to another model's decode failed in {dt:.2f}s: "
              f"{json.loads(answers[0][1].text).get('message', '')[:300]}")
    finally:
        pair_16_64.extra.pop("other-model").kill()


def test_64_to_1_concurrent_requests(pair_64_1, tiny_llama_dir):
    prompts = [random_prompt(n, seed=6500 + n) for n in (3, 33, 63, 65, 130, 200)]
    # no two share a first token: the decode's radix cache would otherwise hold that token when
    # one prompt ends before the other is admitted (a load-dependent 1-token prefix hit)
    assert len({p[0] for p in prompts}) == len(prompts)
    before = received_bytes(pair_64_1.decode)
    run_concurrently(pair_64_1, prompts, tiny_llama_dir)
    assert received_bytes(pair_64_1.decode) - before == sum(map(len, prompts)) * LLAMA_TOKEN_BYTES
    pair_64_1.probe("decode").assert_clean(cached=True)


def test_64_to_1_prefix_reuse_and_early_send(pair_64_1, tiny_llama_dir):
    """Prompt x (150 tokens), then y = x + 60 tokens after the decode's radix cache was
    flushed (and its freed slots overwritten by another prompt w, so that y's KV cannot
    be found there by chance): the prefill holds 128 tokens of y (two of its pages) and
    sends them ahead of the rest (SGLang's early send of a cached prefix: a chunk of its
    own before the last), the decode holds nothing, all 210 tokens move. Then z = y + 50
    tokens: the decode holds all of y (210 tokens, not on the prefill's 64-token grid),
    the prefill sends from its page boundary 192 and exactly the 50 new tokens land."""
    x = random_prompt(150, seed=51)
    w = random_prompt(200, seed=54)
    y = x + random_prompt(60, seed=52)
    z = y + random_prompt(50, seed=53)
    assert len(y) % 64 and len(y) > 192 and (len(y) // 64) * 64 < len(y)
    dec = pair_64_1.decode
    outs, moved = [], []
    for prompt, flush in ((x, True), (w, True), (y, True), (z, False)):
        if flush:
            assert requests.post(dec.url + "/flush_cache", timeout=30).status_code == 200
        before = received_bytes(dec)
        r = pair_64_1.generate_full(prompt, MAX_NEW)
        moved.append((received_bytes(dec) - before) // LLAMA_TOKEN_BYTES)
        outs.append(r)
        ref = reference_generate(tiny_llama_dir, prompt, MAX_NEW).token_ids
        assert r.output_ids == ref, f"{len(prompt)}-token prompt: pair {r.output_ids} != transformers {ref}"
        # in SGLang's decode pool: the whole prompt is transformers' K/V, its first tokens from
        # the decode's own radix cache for z (y's rows), the rest moved
        pair_64_1.probe("decode").assert_landed(tiny_llama_dir, prompt, prefix=0 if flush else len(y))
    # y: the prefill's radix cache held two of its pages, which (early send on, overlap off)
    # SGLang sends as a chunk before the prompt's last one
    assert outs[2].prefill_json["meta_info"]["cached_tokens"] == 128, outs[2].prefill_json["meta_info"]
    assert moved == [150, 200, 210, 50], moved
    pair_64_1.probe("decode").assert_clean(cached=True)


def test_mla_64_to_16_concurrent_requests(sglang_pair_factory, tiny_mla_dir):
    """The DeepSeek-style MLA model (one latent row of 48 per token and layer), prefill page
    64 -> decode page 16, prompts that fill neither side's last page, at once."""
    pair = sglang_pair_factory("kvbridge", model_dir=tiny_mla_dir, page_size=64, decode_page_size=16,
                               extra_env=PLUGIN_ENV, extra_args=["--enable-metrics"], probe=True)
    prompts = [random_prompt(n, seed=4800 + n) for n in (7, 37, 70, 133)]
    before = received_bytes(pair.decode)
    dt = run_concurrently(pair, prompts, tiny_mla_dir)
    assert received_bytes(pair.decode) - before == sum(map(len, prompts)) * 2 * 48 * 4  # 2 layers x 48 x fp32
    pair.probe("decode").assert_clean()
    print(f"[kvbridge MLA 64->16] 4 concurrent requests: {dt:.2f}s")
