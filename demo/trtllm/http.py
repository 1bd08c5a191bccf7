"""trtllm-serve's HTTP shape over the TensorRT-LLM stand-in: what a router talks to.

``trtllm-serve`` (TensorRT-LLM's OpenAI server, ``tensorrt_llm/serve/openai_server.py``)
answers ``POST /v1/completions``, ``GET /health``, ``GET /version`` and ``GET /v1/models``.
This module serves the same over a ``StandInServer`` that a background thread steps
(``Stepper``), so the kvbridge connector inside it meets requests the way it would behind
trtllm-serve: a router announces a handle to the server's bus, then sends an ordinary
completion request with token ids as the prompt.

What is modelled from ``tensorrt_llm/serve/openai_protocol.py`` (``CompletionRequest``,
``CompletionResponse``, ``CompletionStreamResponse``) and ``postprocess_handlers.py``:
a prompt of token ids (or one string, tokenized with the model's tokenizer); unknown
fields refused (``extra="forbid"``: HTTP 400); ``detokenize: false`` answers
``token_ids`` and empty text, otherwise text and no ids; streaming as SSE ``data:``
chunks ending with ``data: [DONE]``, a usage chunk when ``stream_options.include_usage``;
the finish reason the executor gives (``length``, ``cancelled``); a closed connection
cancels the request (``PyExecutor.cancel_request``).

Where the stand-in differs (it is a model of the executor, not of sampling): it decodes
greedily and never stops at EOS, so ``temperature`` must be 0 (or ``top_k`` 1) and
``stop`` strings are refused; and it reports a request's tokens when the request
finishes (its ranks return finished responses only), so a stream delivers them then,
one chunk per token. ``GET /version`` says so (``kvbridge_capabilities``, what a router
reads to pair requests only with servers that can serve them; trtllm-serve has no such
field).

Run it: ``StandInHTTP(...)`` in a process (a context manager), or ``python -m
kvbridge.demo.trtllm.http --version 1.2 --model DIR --port 0`` (prints one JSON line with
``url``, ``bus`` and ``bootstrap`` once it serves).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import queue
import signal
import sys
import threading
import time
import uuid
from typing import Any

from aiohttp import web

from .server import StandInError, StandInServer

__all__ = ["Stepper", "make_app", "StandInHTTP", "main", "CAPABILITIES"]

log = logging.getLogger(__name__)

# what this stand-in cannot do, in kvbridge.route's terms (kvbridge.route.config.Capabilities)
CAPABILITIES = {"sampling": "greedy", "stop": "router", "eos": "router", "seed": False}

_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "ignore_eos", "stop", "seed", "stream",
           "stream_options", "detokenize", "user", "n"}


class Stepper:
    """Steps a ``StandInServer`` in one thread (the server is not thread-safe): requests
    and cancels from any thread go through a queue; ``submit`` returns a future resolved
    with the executor's response when the request finishes."""

    def __init__(self, server: StandInServer, pause_s: float = 0.001, idle_s: float = 0.02):
        self.server = server
        self.pause_s, self.idle_s = pause_s, idle_s
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._stop = False
        self.error: str = ""
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="trtllm-standin-stepper", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], max_tokens: int) -> concurrent.futures.Future:
        """A future of ``(request_id, response)``; its ``request_id`` attribute is set once queued."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("submit", list(prompt), int(max_tokens), fut))
        self._wake.set()
        return fut

    def call(self, fn, timeout_s: float = 30.0):
        """``fn(server)`` run on the stepping thread, between iterations; its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", fn, fut))
        self._wake.set()
        return fut.result(timeout_s)

    def cancel(self, fut: concurrent.futures.Future) -> None:
        self._cmds.put(("cancel", fut))
        self._wake.set()

    @property
    def alive(self) -> bool:
        return not self.error and self._thread.is_alive() and self.server.alive()

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._commands()
                busy = bool(self._pending) or not self.server.drained()
                if not busy:
                    self._wake.wait(self.idle_s)
                    self._wake.clear()
                    continue
                self.server.step()
                self.steps += 1
                for rid in [r for r in self._pending if r in self.server.responses]:
                    _settle(self._pending.pop(rid), self.server.responses.pop(rid))
                if self.pause_s:
                    time.sleep(self.pause_s)
        except BaseException as e:  # a rank died: every waiting request fails with the reason
            self.error = f"{type(e).__name__}: {e}"
            log.error("stand-in stepper stopped: %s", self.error)
            for fut in self._pending.values():
                _settle(fut, error=StandInError(self.error))
            self._pending.clear()
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] in ("submit", "call"):
                    _settle(cmd[-1], error=StandInError(self.error))

    def _commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit":
                _, prompt, max_tokens, fut = cmd
                if fut.cancelled():
                    continue
                rid = self.server.submit(prompt, max_tokens)
                fut.request_id = rid  # type: ignore[attr-defined]
                self._pending[rid] = fut
            elif cmd[0] == "call":
                try:
                    cmd[2].set_result(cmd[1](self.server))
                except BaseException as e:  # the caller gets it
                    cmd[2].set_exception(e)
            elif cmd[0] == "cancel":
                rid = getattr(cmd[1], "request_id", None)
                if rid is not None and rid in self._pending:
                    self.server.cancel(rid)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(10)


def _settle(fut: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``fut`` unless its waiter gave up on it (a cancelled HTTP request)."""
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled meanwhile
        pass


def _bad(msg: str) -> web.Response:
    return web.json_response({"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": 400},
                             status=400)


class _App:
    def __init__(self, stepper: Stepper, model_dir: str, version: str, model_name: str):
        self.stepper, self.model_dir, self.version, self.model_name = stepper, model_dir, version, model_name
        self._tok = None

    def _tokenizer(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tok

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.stepper.alive else 503)

    async def version_page(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"{self.version} (kvbridge.demo.trtllm stand-in)",
                                  "kvbridge_capabilities": CAPABILITIES})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "created": int(time.time()), "owned_by": "tensorrt_llm"}]})

    def _parse(self, body: Any) -> tuple[list[int], int] | web.Response:
        if not isinstance(body, dict):
            return _bad("the body must be a JSON object")
        extra = sorted(set(body) - _FIELDS)
        if extra:
            return _bad(f"extra fields not permitted: {extra}")
        if "model" not in body or "prompt" not in body:
            return _bad("'model' and 'prompt' are required")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompt = list(self._tokenizer()(prompt)["input_ids"])
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            return _bad("the stand-in takes one prompt: a string or a list of token ids")
        if int(body.get("n") or 1) != 1:
            return _bad("the stand-in serves n = 1")
        temp = body.get("temperature")
        if temp not in (None, 0, 0.0) and body.get("top_k") != 1:
            return _bad("the stand-in decodes greedily: send temperature 0 (or top_k 1)")
        if body.get("stop"):
            return _bad("the stand-in implements no stop strings")
        mt = body.get("max_tokens")
        mt = 16 if mt is None else mt
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            return _bad(f"max_tokens must be a positive integer, got {mt!r}")
        return prompt, mt

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _bad("the body is not JSON")
        parsed = self._parse(body)
        if isinstance(parsed, web.Response):
            return parsed
        prompt, max_tokens = parsed
        if not self.stepper.alive:
            return web.json_response({"object": "error", "message": f"executor is down: {self.stepper.error}",
                                      "type": "InternalServerError", "code": 500}, status=500)
        detok = body.get("detokenize", True) is not False
        fut = self.stepper.submit(prompt, max_tokens)
        cid = f"cmpl-{uuid.uuid4().hex}"
        try:
            res = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the client went away: trtllm-serve aborts the request
            self.stepper.cancel(fut)
            raise
        except StandInError as e:
            return web.json_response({"object": "error", "message": str(e), "type": "InternalServerError", "code": 500},
                                     status=500)
        ids = [int(t) for t in res["output_token_ids"]]
        finish = res.get("finish_reason") or "length"
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
        created = int(time.time())
        if not body.get("stream"):
            choice = {"index": 0, "text": self._text(ids) if detok else "", "token_ids": None if detok else ids,
                      "logprobs": None, "finish_reason": finish, "stop_reason": None}
            return web.json_response({"id": cid, "object": "text_completion", "created": created, "model": body["model"],
                                      "choices": [choice], "usage": usage, "prompt_token_ids": None})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # the stand-in reports tokens at the end: one chunk per token then (one empty chunk
        # carries the finish reason of a request that ended without any, e.g. cancelled)
        for i, t in enumerate(ids or [None]):
            last = i == max(1, len(ids)) - 1
            toks = [] if t is None else [t]
            choice = {"index": 0, "text": self._text(toks) if detok else "", "token_ids": None if detok else toks,
                      "logprobs": None, "finish_reason": finish if last else None, "stop_reason": None}
            await _sse(resp, {"id": cid, "object": "text_completion", "created": created, "model": body["model"],
                              "choices": [choice], "usage": None})
        if (body.get("stream_options") or {}).get("include_usage"):
            await _sse(resp, {"id": cid, "object": "text_completion", "created": created, "model": body["model"],
                              "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _text(self, ids: list[int]) -> str:
        return self._tokenizer().decode(ids, skip_special_tokens=True)


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


def make_app(stepper: Stepper, model_dir: str, version: str, model_name: str = "") -> web.Application:
    """trtllm-serve's routes over a stepped stand-in."""
    a = _App(stepper, str(model_dir), version, model_name or str(model_dir))
    app = web.Application()
    app.router.add_post("/v1/completions", a.completions)
    app.router.add_get("/health", a.health)
    app.router.add_get("/version", a.version_page)
    app.router.add_get("/v1/models", a.models)
    return app


class StandInHTTP:
    """A stand-in TensorRT-LLM server behind trtllm-serve's HTTP shape, in this process
    (its ranks in their own): ``url``, ``bus``, ``bootstrap_address``. Arguments as
    ``StandInServer``'s, plus ``host``/``port`` (0: any) and ``model_name``."""

    def __init__(self, version: str, model, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "", **kw):
        self.server = StandInServer(version, model, **kw)
        self.stepper = Stepper(self.server)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._boot_error: BaseException | None = None
        app = make_app(self.stepper, str(model), version, model_name)
        self._thread = threading.Thread(target=self._serve, args=(app, host, port), name="trtllm-standin-http",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(60)
        if self._boot_error is not None or self._runner is None:
            self.stop()
            raise StandInError(f"HTTP front did not start: {self._boot_error}")
        sock = self._runner.addresses[0]
        self.url = f"http://{sock[0]}:{sock[1]}"
        self.bus = self.server.bus
        self.bootstrap_address = self.server.bootstrap_address

    def _serve(self, app: web.Application, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)

        async def up():
            self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, host, port).start()

        try:
            self._loop.run_until_complete(up())
        except BaseException as e:
            self._boot_error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        if self._runner is not None:
            self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        """Stop serving, then the stepper and the ranks."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(15)
        self.stepper.close()
        self.server.stop()

    def __enter__(self) -> "StandInHTTP":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbridge.demo.trtllm.http``: serve until SIGTERM / SIGINT."""
    ap = argparse.ArgumentParser(prog="python -m kvbridge.demo.trtllm.http", description=__doc__.split("\n")[0])
    ap.add_argument("--version", default="1.2", help="TensorRT-LLM version the stand-in models (1.2 or main)")
    ap.add_argument("--model", required=True, help="a tiny model folder (kvbridge.demo.models)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model-name", default="", help="the name /v1/models answers (default: the folder)")
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--plugin", default="{}", help="kvbridge settings as JSON (BridgeConfig names)")
    ap.add_argument("--llm", default="{}", help="LLM args as JSON (tp, tokens_per_block, ...)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    srv = StandInHTTP(a.version, a.model, host=a.host, port=a.port, model_name=a.model_name, num_blocks=a.num_blocks,
                      plugin=json.loads(a.plugin), **json.loads(a.llm))
    try:
        print(json.dumps({"url": srv.url, "bus": srv.bus, "bootstrap": srv.bootstrap_address}), flush=True)
        while not done.wait(0.5):
            if not srv.stepper.alive:
                log.error("stand-in stopped: %s", srv.stepper.error)
                return 1
        return 0
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
