"""``kvbridge bench layerwise --engine sglang``: the same runs on SGLang 0.5.23's REAL servers.

Four servers (``kvbridge.demo.sglang_server``, CPU, Mooncake TCP on 127.0.0.1): a prefill
with ``KVBRIDGE_LAYERWISE=false`` (whole), one with ``true`` (layer-wise: the plugin's
hooks on ``Scheduler.run_batch`` and ``MHATokenToKVPool.set_kv_buffer``), one decode both
feed, and one aggregated server (``--disaggregation-mode null``) that times the prefill
alone. Radix caches are off, so every run computes its whole prompt; the prompt fits one
prefill chunk.

A run sends the request to a prefill and, streamed, to the decode at once (the
bootstrap room naming the prefill), as a router would. ``ttft``: from the requests'
submission to the decode's first streamed token; ``decode_step``: from its first token to
its second; ``prefill``: from the submission to the prefill's last chunk handed to
kvbridge (its forward done: the bootstrap handshake, the queue and the forward, beside the
decode server on the same cores), read from the prefill's timeline log line
(``time.monotonic()`` is one clock for every process); ``tail``: from there to the room's
success on the prefill (the send after the forward). ``prefill_alone``: the aggregated
server's answer time for the same prompt with one new token, nothing else running
(measured in the whole runs, right before each). Layer pieces and how the room
ended come from the layer-wise prefill's log line for the room. Bytes are the prompt's
KV by geometry (the servers do not report them).
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvbridge.demo.sglang_server import ServerError, generate_body, generate_output, new_room, post_json, start_server

__all__ = ["SglangPair"]

_LINE = re.compile(r"room (\d+) went layer by layer: (\d+) layer piece\(s\), (\d+) token\(s\) sent whole; ended by (\w+)")
# the sender's timeline line (adapters/sglang/sender.py _log_timeline): time.monotonic() of the
# decode's request, the last chunk handed over (its forward done) and the room's success
_TIMELINE = re.compile(r"room (\d+) timeline: .*\(monotonic ([\d.]+) ([\d.]+) ([\d.]+)\)")


class SglangPair:
    """Two SGLang prefills (``layerwise`` off, on), one decode and one aggregated server."""

    engine = "sglang 0.5.23 real servers (CPU), TP 1 -> TP 1, Mooncake TCP 127.0.0.1"

    def __init__(self, model_dir: str, max_len: int, token_bytes: int, page_size: int = 64, log_dir: str | None = None):
        total = max(4096, 2 * max_len + 256)  # two rooms of the longest prompt at once, and some
        common = ["--disable-radix-cache", "--chunked-prefill-size", str(max(8192, max_len)),
                  "--max-prefill-tokens", str(max(16384, max_len))]
        self.servers = []
        self.token_bytes = token_bytes
        kw = dict(max_total_tokens=total, log_dir=log_dir, page_size=page_size)
        starts = {
            "whole": lambda: start_server(model_dir, "prefill", extra_env={"KVBRIDGE_LAYERWISE": "false"},
                                          extra_args=common, **kw),
            "layerwise": lambda: start_server(model_dir, "prefill", extra_env={"KVBRIDGE_LAYERWISE": "true"},
                                              extra_args=common, **kw),
            "decode": lambda: start_server(model_dir, "decode", extra_args=common[:1], **kw),
            "alone": lambda: start_server(model_dir, "null", extra_args=common, **kw),
        }
        with ThreadPoolExecutor(len(starts)) as ex:  # all four at once (each retries a lost port race)
            futs = {k: ex.submit(f) for k, f in starts.items()}
        got = {}
        for k, f in futs.items():
            try:
                got[k] = f.result()
                self.servers.append(got[k][0])
            except BaseException as e:
                got.setdefault("error", e)
        if "error" in got:
            self.close()
            raise got["error"]
        self.prefill = {m: got[m] for m in ("whole", "layerwise")}
        self.decode, self.alone = got["decode"][0], got["alone"][0]

    def _prefill_alone_ms(self, prompt: list[int], timeout_s: float) -> float:
        body = {"input_ids": list(prompt), "sampling_params": {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}}
        t0 = time.perf_counter()
        generate_output(post_json(self.alone.url + "/generate", body, timeout_s), self.alone, "aggregated prefill")
        return (time.perf_counter() - t0) * 1e3

    def run(self, mode: str, prompt: list[int], max_new: int, salt: str, timeout_s: float = 600.0):
        """One handoff of ``prompt`` through the ``mode`` prefill: a ``kvbridge.bench.layerwise._Run``."""
        import requests

        from kvbridge.bench.layerwise import _Run
        from kvbridge.route.engines import sglang_delta, sse_json

        del salt  # radix caches are off: nothing to keep apart
        prefill_ms = self._prefill_alone_ms(prompt, timeout_s) if mode == "whole" else 0.0
        pre, boot = self.prefill[mode]
        room = new_room()
        body = generate_body(prompt, max_new, boot, room)
        answer: dict = {}
        t0 = time.perf_counter()
        th = threading.Thread(target=lambda: answer.update(r=post_json(pre.url + "/generate", body, timeout_s)),
                              daemon=True)
        th.start()
        out: list[int] = []
        stamps: list[float] = []
        with requests.Session() as http:
            http.trust_env = False
            with http.post(self.decode.url + "/generate", json={**body, "stream": True}, stream=True,
                           timeout=timeout_s) as res:
                if res.status_code != 200:
                    raise ServerError(f"{mode} run: decode HTTP {res.status_code}: {res.text[:300]}")
                for line in res.iter_lines():
                    ev = sse_json(line)
                    if ev is True:
                        break
                    if not isinstance(ev, dict):
                        continue
                    new, _, abort = sglang_delta(ev, len(out))
                    if abort:
                        raise ServerError(f"{mode} run of {len(prompt)} tokens: the decode aborted: {abort}\n"
                                          f"{self.decode.log_tail(30)}")
                    if new:
                        stamps += [time.perf_counter()] * len(new)
                        out += new
        th.join(timeout_s)
        t_first = stamps[0] if stamps else time.perf_counter()
        _, last_chunk, done = self._timeline(pre, room)
        # time.monotonic() is one clock for every process of this host: the prefill's
        # forward ended (last_chunk) and its room succeeded (done) on the bench's time line
        mono0 = time.monotonic() - (time.perf_counter() - t0)
        generate_output(answer.get("r", TimeoutError("no prefill answer")), pre, f"{mode} prefill")
        if len(out) < max_new:
            raise ServerError(f"{mode} run of {len(prompt)} tokens: {len(out)} of {max_new} tokens from the decode")
        pieces, ended = self._room_line(pre, room) if mode == "layerwise" else (0, "send")
        dstep = (stamps[1] - stamps[0]) * 1e3 if len(stamps) > 1 else 0.0
        return _Run(mode, len(prompt), (t_first - t0) * 1e3, (last_chunk - mono0) * 1e3, dstep, out,
                    len(prompt) * self.token_bytes, pieces, ended, tail_ms=(done - last_chunk) * 1e3,
                    prefill_alone_ms=prefill_ms or None)

    @staticmethod
    def _logged(srv, pattern: "re.Pattern", room: int, what: str, timeout_s: float = 10.0) -> "re.Match":
        """The prefill's log line ``pattern`` for ``room`` (its group 1), waited for up to ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while True:
            for m in pattern.finditer(srv.log_path.read_text(errors="replace")):
                if int(m.group(1)) == room:
                    return m
            if time.monotonic() > end:
                raise ServerError(f"no {what} line for room {room} in {srv.log_path}:\n{srv.log_tail(30)}")
            time.sleep(0.05)

    def _timeline(self, srv, room: int) -> tuple[float, float, float]:
        """(asked, last chunk, done), time.monotonic() in the prefill, from its log line for ``room``."""
        m = self._logged(srv, _TIMELINE, room, "timeline")
        return float(m.group(2)), float(m.group(3)), float(m.group(4))

    def _room_line(self, srv, room: int) -> tuple[int, str]:
        """(layer pieces, how the room ended) from the prefill's log line for ``room``."""
        m = self._logged(srv, _LINE, room, "layer-wise")
        return int(m.group(2)), m.group(4)

    def close(self) -> None:
        for s in self.servers:
            s.kill()
        self.servers = []
