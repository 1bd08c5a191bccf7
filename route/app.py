"""The router's HTTP front (aiohttp): OpenAI ``/v1/completions`` and
``/v1/chat/completions`` (SSE streaming or not), SGLang's ``/generate``, ``/v1/models``,
``/health`` and ``/metrics`` (Prometheus).

A request is parsed to token ids (400 if it cannot be), admitted (429 when the queue is
full, 503 when no slot comes before its deadline), run by the ``Dispatcher``, and
answered once its first token is there, so that a failure before it is an HTTP status
(502 a server failed, 503 no server, 504 deadline) with ``Retry-After`` where retrying
helps; a failure after it ends the stream with an error event. Every response says how
it was served: ``X-KVBridge-Route`` / ``-Mode`` / ``-Servers`` headers and a ``kvbridge``
object in the body.

Before any server is asked, a request is refused with 404 when it names a model the
router does not serve (``model.name`` or an alias), and with 400 when no configured server
could serve it (the model's context, or a parameter no server honours: ``ServerPool.refusal``);
neither is retried. Every error, unknown paths included, is a JSON error object.
``kvbridge_route_requests_total`` counts answers the client got whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from typing import Callable

import aiohttp
from aiohttp import web

from .ranks import PrefillRanks
from .admission import Admission
from .config import RouteConfig
from .dispatch import Dispatcher, Job, Trace
from .errors import RouteError
from .gates import PairGates
from .metrics import RouteMetrics
from .pool import ServerPool
from .protocol import Formatter, Parsed, parse_chat, parse_completion, parse_generate
from .text import Answer, TextCodec

__all__ = ["Router", "BackgroundRouter", "build_app", "router_of", "serve"]

log = logging.getLogger(__name__)

ROUTER_KEY = web.AppKey("router", object)


class Router:
    """Everything one router process holds: configuration, servers, gates, metrics, the
    client session, admission and the dispatcher."""

    def __init__(self, cfg: RouteConfig, codec: TextCodec | None = None, metrics: RouteMetrics | None = None):
        self.cfg = cfg
        self.codec = codec or TextCodec(cfg.model.tokenizer, cfg.model.chat_template)
        self.metrics = metrics or RouteMetrics()
        self.pool = ServerPool(cfg, on_change=self._server_changed)
        self.gates = PairGates(cfg)
        self.admission = Admission(cfg.limits.max_inflight, cfg.limits.max_queue, cfg.limits.retry_after_s, self.metrics)
        self.ranks = PrefillRanks(cfg.secret)
        self.http: aiohttp.ClientSession | None = None
        self.dispatcher: Dispatcher | None = None
        self._health: asyncio.Task | None = None
        for s in self.pool.servers:
            self._server_changed(s)

    def _server_changed(self, s) -> None:
        self.metrics.server_up.labels(s.name, s.engine, s.role).set(1 if s.healthy else 0)
        if s.healthy and hasattr(self, "ranks"):
            self.ranks.forget(s.spec)  # back in rotation: maybe restarted, with new ranks

    async def start(self, app: web.Application | None = None) -> None:
        """Open the client pool, probe every server once, start health checking."""
        d = self.cfg.deadlines
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=d.connect_s, sock_connect=d.connect_s),
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False),
            read_bufsize=1 << 22, trust_env=False)
        self.dispatcher = Dispatcher(self.cfg, self.pool, self.gates, self.metrics, self.http, self.ranks)
        await self.pool.check_all(self.http)
        await self.pool.read_caps(self.http)
        self._health = asyncio.create_task(self.pool.health_loop(self.http))

    async def stop(self, app: web.Application | None = None) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        if self.dispatcher is not None:
            await self.dispatcher.drain()
        if self.http is not None:
            await self.http.close()
        self.ranks.close()

    # -- handlers ---------------------------------------------------------------------------
    def _deadline(self, request: web.Request, arrived: float) -> float:
        limit = self.cfg.deadlines.request_s
        h = request.headers.get("X-Request-Timeout")
        if h:
            try:
                limit = min(limit, max(0.001, float(h)))
            except ValueError:
                raise RouteError(400, "bad_request", f"X-Request-Timeout must be seconds, got {h!r}") from None
        return arrived + limit

    async def _serve(self, request: web.Request, kind: str, parse: Callable[[object, TextCodec], Parsed]) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        trace = Trace()
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise RouteError(400, "bad_request", "the body is not JSON") from None
            if kind != "generate":
                self._check_model(body)
            parsed = self._fitted(parse(body, self.codec))
            job = Job(rid, parsed.ids, parsed.sampling, 0.0,
                      Answer(self.codec, parsed.ids, parsed.sampling.stop, parsed.include_stop))
            refused = self.pool.refusal(job.needs, rid)
            if refused is not None:
                raise refused
            job.deadline = deadline = self._deadline(request, arrived)
            async with self.admission.slot(deadline - loop.time()):
                return await self._answer(request, kind, job, parsed, trace, arrived)
        except RouteError as e:
            return self._error(e, trace, rid)
        except web.HTTPException:  # aiohttp's own (a body over client_max_size): json_errors answers it
            raise
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away
            if not request.get("kvbridge_counted"):
                self.metrics.failures.labels(trace.route or "none", "client_gone").inc()
            raise
        except Exception as e:  # nothing is dropped silently: an unexpected error is an answer too
            log.exception("route: request %s failed", rid)
            return self._error(RouteError(500, "internal", f"request {rid}: {type(e).__name__}: {e}"), trace, rid)

    def _check_model(self, body: object) -> None:
        """404 for a model name this router does not serve (none given: the model)."""
        name = body.get("model") if isinstance(body, dict) else None
        if name is None:
            return
        if not isinstance(name, str) or name not in self.cfg.model.names():
            raise RouteError(404, "model_not_found", f"The model `{name}` does not exist: this router serves "
                             f"{self.cfg.model.names()}", param="model")

    def _fitted(self, parsed: Parsed) -> Parsed:
        """``parsed`` with a default token limit lowered to what the model's context leaves
        (a limit the client set is checked as given)."""
        ctx = self.pool.context
        s = parsed.sampling
        if not parsed.max_given and ctx and len(parsed.ids) < ctx and len(parsed.ids) + s.max_tokens > ctx:
            parsed.sampling = dataclasses.replace(s, max_tokens=ctx - len(parsed.ids))
        return parsed

    def _error(self, e: RouteError, trace: Trace, rid: str) -> web.Response:
        self.metrics.failures.labels(trace.route or "none", e.reason).inc()
        if e.status >= 500:
            log.warning("route: request %s: %s %s: %s", rid, e.status, e.reason, e.message)
        headers = {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after is not None else {}
        return web.json_response(e.body(), status=e.status, headers=headers)

    @staticmethod
    def _info(trace: Trace) -> dict:
        return {"route": trace.route, "mode": trace.mode, "why": trace.why, "servers": trace.servers,
                "verdict": trace.verdict, "retries": trace.attempts, "rooms": trace.rooms}

    async def _answer(self, request: web.Request, kind: str, job: Job, parsed: Parsed, trace: Trace,
                      arrived: float) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        stream = self.dispatcher.run(job, trace)
        fmt = Formatter(kind, job.rid, self.cfg.model.name, len(job.ids))
        try:
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                raise RouteError(502, "no_output", f"request {job.rid}: the server answered no token") from None
            ttft = loop.time() - arrived
            m = self.metrics
            m.ttft.labels(trace.route, trace.mode).observe(ttft)
            headers = {"X-KVBridge-Route": trace.route, "X-KVBridge-Mode": trace.mode,
                       "X-KVBridge-Servers": ",".join(trace.servers), "X-KVBridge-TTFT-Ms": f"{ttft * 1e3:.2f}"}
            if not parsed.stream:
                ids, text, last = list(first.ids), first.text, first
                async for piece in stream:
                    ids += piece.ids
                    text += piece.text
                    last = piece
                body = fmt.whole(ids, text, last.finish or "length", self._info(trace), last.matched)
                self._served(trace, arrived)
                return web.json_response(body, headers=headers)
            resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
            try:
                await self._relay(resp, fmt, first, stream, trace)
            except RouteError as e:  # after the first token: an error event ends the stream
                m.failures.labels(trace.route or "none", e.reason).inc()
                log.warning("route: request %s: %s after the first token: %s", job.rid, e.reason, e.message)
                await _send(resp, e.body())
            except (ConnectionResetError, asyncio.CancelledError):
                m.failures.labels(trace.route or "none", "client_gone").inc()
                request["kvbridge_counted"] = True
                raise
            else:
                if parsed.include_usage:
                    await _send(resp, fmt.usage_chunk())
                self._served(trace, arrived)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            await stream.aclose()

    def _served(self, trace: Trace, arrived: float) -> None:
        """Count a request the client got whole."""
        m = self.metrics
        m.requests.labels(trace.route, trace.mode).inc()
        if trace.mode == "recomputed":
            m.recomputed.labels(trace.route, trace.why).inc()
        m.latency.labels(trace.route, trace.mode).observe(asyncio.get_running_loop().time() - arrived)

    async def _relay(self, resp, fmt: Formatter, first, stream, trace: Trace) -> None:
        piece, is_first = first, True
        while True:
            await _send(resp, fmt.chunk(piece.ids, piece.text, piece.finish, self._info(trace) if is_first or piece.finish
                                        else None, first=is_first, matched=piece.matched))
            is_first = False
            if piece.finish:
                return
            try:
                piece = await stream.__anext__()
            except StopAsyncIteration:
                return

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion", parse_completion)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat", parse_chat)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "generate", parse_generate)

    async def health(self, request: web.Request) -> web.Response:
        ok = self.pool.can_serve()
        body = {"status": "ok" if ok else "unavailable", "servers": self.pool.snapshot(),
                "inflight": self.admission.inflight, "queued": self.admission.waiting}
        headers = {} if ok else {"Retry-After": str(max(1, round(self.cfg.health.interval_s)))}
        return web.json_response(body, status=200 if ok else 503, headers=headers)

    async def metrics_page(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        ctx = self.pool.context or None
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "kvbridge", "root": self.cfg.model.name,
             "max_model_len": ctx} for name in self.cfg.model.names()]})


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown path 404, wrong method 405, body too large 413) as
    JSON error objects, as every other error."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        what = {404: f"no such path: {request.path}", 405: f"{request.method} is not allowed on {request.path}"}
        err = RouteError(e.status, "bad_request", what.get(e.status, e.reason or f"HTTP {e.status}"))
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}
        return web.json_response(err.body(), status=e.status, headers=headers)


def build_app(cfg: RouteConfig, *, codec: TextCodec | None = None, metrics: RouteMetrics | None = None) -> web.Application:
    """The router as an aiohttp application (servers are probed when it starts)."""
    router = Router(cfg, codec, metrics)
    app = web.Application(client_max_size=64 << 20, middlewares=[json_errors])
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat)
    app.router.add_post("/generate", router.generate)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_page)
    return app


def router_of(app: web.Application) -> Router:
    return app[ROUTER_KEY]


def serve(cfg: RouteConfig, *, host: str | None = None, port: int | None = None, print_fn=None) -> None:
    """Run the router until interrupted (``kvbridge route``)."""
    app = build_app(cfg)
    web.run_app(app, host=host or cfg.listen.host, port=port if port is not None else cfg.listen.port,
                print=print_fn, access_log=None, handler_cancellation=True)


class BackgroundRouter:
    """A router serving from a thread of this process (demo, bench, tests): ``url``,
    ``router`` (its state and metrics); ``stop()`` ends it."""

    def __init__(self, cfg: RouteConfig, *, host: str = "127.0.0.1", port: int = 0, codec: TextCodec | None = None):
        import threading

        self.app = build_app(cfg, codec=codec)
        self.router = router_of(self.app)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self._thread = threading.Thread(target=self._run, args=(host, port), name="kvbridge-route", daemon=True)
        self._thread.start()
        self._ready.wait(120)
        if self._error is not None or not self._runner.addresses:
            self.stop()
            raise RuntimeError(f"router did not start: {self._error}")
        h, p = self._runner.addresses[0][:2]
        self.url = f"http://{h}:{p}"

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)

        async def up():
            await self._runner.setup()
            await web.TCPSite(self._runner, host, port).start()

        try:
            self._loop.run_until_complete(up())
        except BaseException as e:
            self._error = e
        self._ready.set()
        if self._error is None:
            self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def call(self, fn, timeout_s: float = 30.0):
        """Run ``fn()`` (a coroutine function) on the router's loop; its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout_s)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def __enter__(self) -> "BackgroundRouter":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
