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

Against hostile clients: a body over ``limits.max_body_bytes`` is a 413 before it is read
(by its Content-Length, or as soon as it passes the cap); a body that is not JSON, or nests
deeper than the parser allows, a 400; a body not in within ``deadlines.body_s`` a 408, its
connection closed; a connection without a whole request's headers within
``deadlines.headers_s`` is closed (aiohttp's keep-alive timer, which runs from a
connection's start and from the end of each answer, not extended by partial data). Bodies
are decoded and prompts tokenized on ``limits.parse_threads`` threads, prompts after
admission (a list of ids longer than the context is refused before). At shutdown
(``Router.shutdown``) no request is taken any more (503), those in flight have
``deadlines.shutdown_s`` to finish, then open streams end with an error event (and
``[DONE]``), waiting requests with 503; room aborts still queued are sent before the
control channel closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import aiohttp
import msgspec
from aiohttp import web

from . import capabilities as C
from .ranks import PrefillRanks, route_keyring
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

# bodies up to this size are decoded on the event loop (a thread hop costs more)
_INLINE_BODY = 64 << 10
# the default token limit per API, as protocol's parsers apply it
_DEFAULT_MAX = {"completion": 16, "chat": 256, "generate": 128}


class _ShutDown(Exception):
    """The router's shutdown cut a request short."""


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
        self.ranks = PrefillRanks(route_keyring(cfg.secret))
        self.http: aiohttp.ClientSession | None = None
        self.dispatcher: Dispatcher | None = None
        self._health: asyncio.Task | None = None
        self._parse_pool = ThreadPoolExecutor(cfg.limits.parse_threads, thread_name_prefix="kvbridge-route-parse")
        self.closing = False  # shutting down: no new request is taken
        self._cut = asyncio.Event()  # the drain deadline passed: requests still in flight end now
        self._handlers: set[asyncio.Task] = set()
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

    async def shutdown(self, app: web.Application | None = None) -> None:
        """Stop taking requests; let those in flight finish within ``deadlines.shutdown_s``,
        then end them (streams with an error event, waiting requests with 503)."""
        self.closing = True
        busy = {t for t in self._handlers if not t.done()}
        if not busy:
            return
        drain_s = self.cfg.deadlines.shutdown_s
        log.info("route: shutting down: %d request(s) in flight, %g s to finish", len(busy), drain_s)
        _, busy = await asyncio.wait(busy, timeout=drain_s)
        if busy:
            log.warning("route: shutting down: ending %d request(s) still in flight", len(busy))
            self._cut.set()
            _, busy = await asyncio.wait(busy, timeout=5.0)
            if busy:
                log.warning("route: %d request(s) did not end within 5 s of the cut", len(busy))

    async def stop(self, app: web.Application | None = None) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        if self.dispatcher is not None:
            await self.dispatcher.drain()
        await self.ranks.flush()
        if self.http is not None:
            await self.http.close()
        self.ranks.close()
        self._parse_pool.shutdown(wait=False, cancel_futures=True)

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
        me = asyncio.current_task()
        self._handlers.add(me)
        try:
            if self.closing:
                raise RouteError(503, "shutdown", "the router is shutting down", self.cfg.limits.retry_after_s)
            body = await self._body(request)
            if kind != "generate":
                self._check_model(body)
            self._refuse_long_ids(kind, body, rid)
            deadline = self._deadline(request, arrived)
            async with self.admission.slot(deadline - loop.time()):
                parsed = self._fitted(await self._parse(parse, body))
                job = Job(rid, parsed.ids, parsed.sampling, deadline,
                          Answer(self.codec, parsed.ids, parsed.sampling.stop, parsed.include_stop))
                refused = self.pool.refusal(job.needs, rid)
                if refused is not None:
                    raise refused
                return await self._answer(request, kind, job, parsed, trace, arrived)
        except RouteError as e:
            resp = self._error(e, trace, rid)
            if e.status == 503 and self.closing:
                resp.force_close()  # shutting down: no keep-alive
            elif e.status == 408:  # the rest of a body too slow is not waited for (nor lingered on)
                await resp.prepare(request)
                await resp.write_eof()
                if request.transport is not None:
                    request.transport.close()
            return resp
        except RecursionError:  # a body nested deeper than the parsers (or repr) recurse
            return self._error(RouteError(400, "bad_request", "the body nests too deeply"), trace, rid)
        except web.HTTPException:  # aiohttp's own (a body over client_max_size): json_errors answers it
            raise
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away
            if not request.get("kvbridge_counted"):
                self.metrics.failures.labels(trace.route or "none", "client_gone").inc()
            raise
        except Exception as e:  # nothing is dropped silently: an unexpected error is an answer too
            log.exception("route: request %s failed", rid)
            return self._error(RouteError(500, "internal", f"request {rid}: {type(e).__name__}: {e}"), trace, rid)
        finally:
            self._handlers.discard(me)

    async def _body(self, request: web.Request) -> object:
        """The request's JSON body: 413 over ``limits.max_body_bytes`` (before reading it
        when its Content-Length says so), 408 when it takes longer than ``deadlines.body_s``,
        400 when it is not JSON or nests too deeply."""
        cap, body_s = self.cfg.limits.max_body_bytes, self.cfg.deadlines.body_s
        declared = request.content_length
        if declared is not None and declared > cap:
            raise RouteError(413, "too_large", f"the body is {declared} bytes; this router takes at most {cap} bytes "
                                               "(limits.max_body_bytes)")
        buf = bytearray()
        try:
            async with asyncio.timeout(body_s):
                async for chunk in request.content.iter_any():
                    buf += chunk
                    if len(buf) > cap:
                        raise RouteError(413, "too_large", f"the body is over {cap} bytes, the most this router takes "
                                                           "(limits.max_body_bytes)")
        except TimeoutError:
            raise RouteError(408, "body_timeout", f"the body did not arrive within {body_s:g} s (deadlines.body_s): "
                                                  f"{len(buf)} bytes came") from None
        raw = bytes(buf)
        if len(raw) <= _INLINE_BODY:
            return _decode_json(raw)
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, _decode_json, raw)

    async def _parse(self, parse: Callable[[object, TextCodec], Parsed], body: object) -> Parsed:
        """``parse(body)`` (ids checked, text tokenized, chat rendered) on a parse thread."""
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, parse, body, self.codec)

    def _refuse_long_ids(self, kind: str, body: object, rid: str) -> None:
        """A prompt of token ids at least the model's context long is refused (400 naming
        both numbers) before its ids are checked or a slot is taken."""
        ctx = self.pool.context
        if not ctx or not isinstance(body, dict):
            return
        ids = body.get("input_ids" if kind == "generate" else "prompt")
        if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
            ids = ids[0]
        if not isinstance(ids, list) or len(ids) < ctx:
            return
        if kind == "generate":
            sp = body.get("sampling_params")
            mt = sp.get("max_new_tokens") if isinstance(sp, dict) else None
        else:
            mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if mt is None:
            mt = _DEFAULT_MAX[kind]
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            mt = 1
        refused = self.pool.refusal(C.Needs(len(ids), mt, False, False), rid)
        if refused is not None:
            raise refused

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
                "verdict": trace.verdict, "retries": trace.attempts, "rooms": trace.rooms,
                "verified": trace.mode == "disaggregated" and trace.verified}

    async def _answer(self, request: web.Request, kind: str, job: Job, parsed: Parsed, trace: Trace,
                      arrived: float) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        stream = self.dispatcher.run(job, trace)
        fmt = Formatter(kind, job.rid, self.cfg.model.name, len(job.ids))
        try:
            try:
                first = await self._until_cut(stream.__anext__())
            except StopAsyncIteration:
                raise RouteError(502, "no_output", f"request {job.rid}: the server answered no token") from None
            except _ShutDown:
                raise self._shutdown_error(job.rid) from None
            ttft = loop.time() - arrived
            m = self.metrics
            m.ttft.labels(trace.route, trace.mode).observe(ttft)
            headers = {"X-KVBridge-Route": trace.route, "X-KVBridge-Mode": trace.mode,
                       "X-KVBridge-Servers": ",".join(trace.servers), "X-KVBridge-TTFT-Ms": f"{ttft * 1e3:.2f}",
                       "X-KVBridge-Verified": "yes" if trace.mode == "disaggregated" and trace.verified else "no"}
            if not parsed.stream:
                try:
                    ids, text, last = await self._until_cut(_collect(first, stream))
                except _ShutDown:
                    raise self._shutdown_error(job.rid) from None
                body = fmt.whole(ids, text, last.finish or "length", self._info(trace), last.matched)
                self._served(trace, arrived)
                return web.json_response(body, headers=headers)
            resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
            try:
                await self._until_cut(self._relay(resp, fmt, first, stream, trace))
            except _ShutDown:  # after the first token: an error event ends the stream
                e = self._shutdown_error(job.rid)
                m.failures.labels(trace.route or "none", e.reason).inc()
                log.warning("route: request %s: ended by the shutdown after the first token", job.rid)
                await _send(resp, e.body())
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

    async def _until_cut(self, aw):
        """``aw``'s result, or _ShutDown when the shutdown's drain deadline passes first
        (``aw`` then cancelled)."""
        task = asyncio.ensure_future(aw)
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            await asyncio.wait({task, cut}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client went away: so does the work for it
            task.cancel()
            cut.cancel()
            raise
        cut.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise _ShutDown()

    def _shutdown_error(self, rid: str) -> RouteError:
        return RouteError(503, "shutdown", f"request {rid}: the router is shutting down (deadlines.shutdown_s = "
                                           f"{self.cfg.deadlines.shutdown_s:g} s passed)", self.cfg.limits.retry_after_s)

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


async def _collect(first, stream) -> tuple[list[int], str, object]:
    """(ids, text, last piece) of a whole answer from its first piece on."""
    ids, text, last = list(first.ids), first.text, first
    async for piece in stream:
        ids += piece.ids
        text += piece.text
        last = piece
    return ids, text, last


def _decode_json(raw: bytes) -> object:
    """A body's JSON (400 when it is not JSON or nests deeper than the decoder allows)."""
    try:
        return msgspec.json.decode(raw)
    except RecursionError:
        raise RouteError(400, "bad_request", "the body nests too deeply (JSON arrays or objects) to be decoded") from None
    except msgspec.DecodeError as e:
        raise RouteError(400, "bad_request", f"the body is not JSON: {e}") from None


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
    app = web.Application(client_max_size=cfg.limits.max_body_bytes, middlewares=[json_errors])
    app[ROUTER_KEY] = router
    app.on_startup.append(router.start)
    app.on_shutdown.append(router.shutdown)
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


def server_options(cfg: RouteConfig) -> dict:
    """aiohttp server settings from the configuration: the header deadline is aiohttp's
    keep-alive timer (from a connection's start and the end of each answer, not extended by
    partial data); shutdown waits past the drain deadline for the cut to be written."""
    return {"keepalive_timeout": cfg.deadlines.headers_s, "shutdown_timeout": cfg.deadlines.shutdown_s + 10.0,
            "handler_cancellation": True, "access_log": None}


def serve(cfg: RouteConfig, *, host: str | None = None, port: int | None = None, print_fn=None) -> None:
    """Run the router until interrupted (``kvbridge route``; SIGINT or SIGTERM: a graceful
    shutdown, ``Router.shutdown``)."""
    app = build_app(cfg)
    web.run_app(app, host=host or cfg.listen.host, port=port if port is not None else cfg.listen.port,
                print=print_fn, **server_options(cfg))


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
        self._runner = web.AppRunner(self.app, **server_options(cfg))
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
        """Shut down as ``kvbridge route`` does on SIGTERM (``Router.shutdown``), and wait."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(self.router.cfg.deadlines.shutdown_s + 30)

    def __enter__(self) -> "BackgroundRouter":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
