"""Cheap stand-ins for the router's hostile-client tests: an SGLang-shaped aggregated
server (``/generate`` streaming one token every ``interval_s``) served from a thread of
this process, and raw-socket clients that read SSE or send slowly."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

from aiohttp import web

__all__ = ["FakeSGLang", "sse_events", "raw_post"]


class FakeSGLang:
    """An SGLang aggregated server that answers ``/generate`` with ids 5, 6, ... one per
    ``interval_s`` (incremental ``output_ids``), ``/health`` and ``/abort_request``."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.requests = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-sglang", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("fake SGLang server did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", lambda r: web.json_response({}))
        app.router.add_post("/abort_request", lambda r: web.json_response({}))
        app.router.add_post("/generate", self._generate)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = "http://127.0.0.1:%d" % self._runner.addresses[0][1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 16))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(self.interval_s)
            fr = {"type": "length", "length": n} if i == n - 1 else None
            ev = {"output_ids": [5 + i % 50], "meta_info": {"completion_tokens": i + 1, "finish_reason": fr}}
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)


def _connect(url: str, timeout_s: float) -> socket.socket:
    host, port = url.split("//", 1)[1].split(":")
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def raw_post(url: str, path: str, body: dict) -> bytes:
    """The request bytes of a JSON POST (HTTP/1.1, closed after the answer)."""
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode() + data


def sse_events(url: str, body: dict, *, timeout_s: float = 60.0, path: str = "/v1/completions",
               on_event=None) -> tuple[int, list[tuple[float, object]]]:
    """POST ``body`` (streamed) and read the answer to its end: (status, [(arrival time,
    event: a parsed JSON object or the string "[DONE]")]). ``on_event(i)`` after each."""
    sock = _connect(url, timeout_s)
    try:
        sock.sendall(raw_post(url, path, body))
        f = sock.makefile("rb")
        status = int(f.readline().split()[1])
        chunked = False
        while True:
            line = f.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        data = b""
        events: list[tuple[float, object]] = []
        while True:
            if chunked:
                size_line = f.readline()
                if not size_line:
                    break
                size = int(size_line.strip() or b"0", 16)
                chunk = f.read(size + 2)[:size] if size else b""
                if not size:
                    break
            else:
                chunk = f.read1(65536)
                if not chunk:
                    break
            data += chunk
            while b"\n\n" in data:
                ev, data = data.split(b"\n\n", 1)
                if not ev.startswith(b"data: "):
                    continue
                payload = ev[6:]
                events.append((time.monotonic(), "[DONE]" if payload == b"[DONE]" else json.loads(payload)))
                if on_event is not None:
                    on_event(len(events))
        if data.strip() and not events:  # a JSON error answer, not a stream
            events.append((time.monotonic(), json.loads(data)))
        return status, events
    finally:
        sock.close()
