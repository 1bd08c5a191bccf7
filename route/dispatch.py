"""One request through the deployment: choose, hand off or compute, retry, stream.

Per request (``Dispatcher.run``, an async iterator of ``Piece``):

1. pick a pair (``ServerPool.pick_pair``: least outstanding) and ask the pair's cost gate
   (``PairGates``) whether moving the KV gives the first token sooner than computing the
   prompt where it lands. Below break-even the request goes to a server that computes it
   alone (the pair's decode when it is a TensorRT-LLM or vLLM one, else an aggregated server);
2. disaggregated: a new room; each TensorRT-LLM half is announced, then both halves are
   sent at once (``engines``); the decode's tokens are relayed as they come;
3. faults, before the first token reached the client: a prefill half that fails, or has
   not handed off within ``deadlines.prefill_s``, is given up (its room aborted on the
   prefill, both halves cancelled) and the request is retried on another prefill with a
   new room, up to ``retry.prefill_attempts`` handoffs, then computed on one server when
   ``retry.recompute`` allows; a decode half that fails while its prefill did not ends
   the request with an error naming the decode (502), the prefill's room aborted. After
   the first token a failure ends the stream with an error. The request's deadline bounds
   every wait; past it the request ends with 504.

Only servers that can serve the request (``capabilities.Needs``) are chosen; each gets
the request's sampling as it can take it (``capabilities.for_server``), and the answer
(``text.Answer``) ends at the first stop string, or at EOS for a server that does not
stop there, the server's request then closed.

Clean-up that needs the network (aborts, SGLang ``/abort_request``) runs in the
background, so an error reaches the client at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import AsyncIterator

import aiohttp

from . import capabilities as C
from . import engines as E
from .ranks import PrefillRanks
from .config import RouteConfig
from .errors import RouteError
from .gates import PairGates
from .metrics import RouteMetrics
from .pool import Server, ServerPool
from .text import Answer

__all__ = ["Dispatcher", "Job", "Trace"]

log = logging.getLogger(__name__)

_END = object()


@dataclass
class Job:
    """A request as the dispatcher sees it: token ids, sampling, its deadline (loop time)."""

    rid: str
    ids: list[int]
    sampling: E.Sampling
    deadline: float
    answer: Answer | None = None  # the answer's text and end (none: ids as the engine gives them)

    @property
    def needs(self) -> C.Needs:
        return C.Needs.of(len(self.ids), self.sampling)

    @property
    def key(self) -> str:
        """The prompt's key (what a TensorRT-LLM announcement is filed under)."""
        k = self.__dict__.get("_key")
        if k is None:
            from kvbridge.adapters.trtllm import prompt_key

            k = self.__dict__["_key"] = prompt_key(self.ids)
        return k


@dataclass
class Trace:
    """What happened to a request (response headers, metrics, logs)."""

    route: str = ""
    mode: str = ""  # "disaggregated" | "recomputed"
    why: str = ""  # why recomputed
    verdict: str = ""  # the cost gate's reason
    servers: list[str] = field(default_factory=list)
    attempts: list[str] = field(default_factory=list)  # one line per failed try
    rooms: list[int] = field(default_factory=list)
    verified: bool = False  # the decode compared the moved KV's content digest (its integrity setting) and took it


class _HalfFailed(Exception):
    """A try that can be retried elsewhere (the client has seen nothing yet)."""

    def __init__(self, reason: str, error: E.EngineError):
        super().__init__(str(error))
        self.reason, self.error = reason, error


def new_room() -> int:
    """A random non-zero 62-bit room (0 is SGLang's warm-up room)."""
    return secrets.randbits(62) or 1


class _Relay:
    """A stream pumped by a task into a queue, so that waits can race it against other
    events (the prefill half, deadlines)."""

    def __init__(self, stream: AsyncIterator[E.Piece]):
        self.q: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._pump(stream))
        self.getter: asyncio.Task | None = None
        self.cut = False  # the router ended the answer before the server did

    async def _pump(self, stream: AsyncIterator[E.Piece]) -> None:
        try:
            async for piece in stream:
                self.q.put_nowait(piece)
            self.q.put_nowait(_END)
        except E.EngineError as e:
            self.q.put_nowait(e)

    def next_task(self) -> asyncio.Task:
        if self.getter is None:
            self.getter = asyncio.create_task(self.q.get())
        return self.getter

    def take(self):
        item, self.getter = self.getter.result(), None
        return item

    def cancel(self) -> None:
        for t in (self.getter, self.task):
            if t is not None and not t.done():
                t.cancel()


class Dispatcher:
    """Runs requests over a server pool (see the module doc)."""

    def __init__(self, cfg: RouteConfig, pool: ServerPool, gates: PairGates, metrics: RouteMetrics,
                 http: aiohttp.ClientSession, ranks: PrefillRanks):
        self.cfg, self.pool, self.gates, self.m, self.http, self.ranks = cfg, pool, gates, metrics, http, ranks
        self.model = cfg.model.name
        self._integrity = cfg.integrity_check()
        self._background: set[asyncio.Task] = set()
        # (server name, prompt key) -> until when a TensorRT-LLM server may hold a handle announced
        # for a try that failed: its next request with that prompt would take it (announcements are
        # keyed by the prompt and cannot be withdrawn), so it gets no request with that prompt until then
        self._stale: dict[tuple[str, str], float] = {}

    def _model(self, s: Server) -> str:
        """The model name in this server's OpenAI requests."""
        return s.spec.model or self.model

    # -- housekeeping -------------------------------------------------------------------
    def _later(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for background clean-up (shutdown, tests)."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    def _noted(self, err: E.EngineError) -> None:
        """Passive health: a refused connection takes the server out of rotation now; a
        server whose connection failed or broke may come back with new ranks."""
        srv = err.server if isinstance(err.server, Server) else self.pool.by_name.get(err.server.name)
        if srv is None:
            return
        if err.code == "connect":
            self.pool.mark_down(srv, str(err))
        if err.code in ("connect", "disconnect", "timeout"):
            self.ranks.forget(srv.spec)

    def _abort_room(self, p: Server, room: int, reason: str) -> None:
        async def go():
            if await self.ranks.abort(p.spec, room, reason):
                self.m.room_aborts.labels(p.engine).inc()
        self._later(go())

    def _abort_rid(self, s: Server, rid: str) -> None:
        self._later(E.abort_request(self.http, s, rid))

    def _left(self, job: Job) -> float:
        return job.deadline - asyncio.get_running_loop().time()

    def _deadline_error(self, job: Job, where: str) -> RouteError:
        return RouteError(504, "deadline", f"request {job.rid}: deadline passed {where} "
                                           f"({self.cfg.deadlines.request_s:g} s or the client's X-Request-Timeout)")

    # -- stale announcements -------------------------------------------------------------
    def _stale_servers(self, job: Job) -> set[Server]:
        now = asyncio.get_running_loop().time()
        for k in [k for k, until in self._stale.items() if until <= now]:
            del self._stale[k]
        return {s for s in self.pool.servers if (s.name, job.key) in self._stale}

    def _mark_stale(self, job: Job, servers: list[Server]) -> None:
        until = job.deadline + 1.0  # announcements live no longer than the request (announce's ttl_s)
        for s in servers:
            if s.engine == "trtllm":
                self._stale[(s.name, job.key)] = max(until, self._stale.get((s.name, job.key), 0.0))

    # -- choice -------------------------------------------------------------------------
    def _choose(self, job: Job, trace: Trace, tried: set, failed: set, handoffs: int, last: _HalfFailed | None):
        stale = self._stale_servers(job)
        tried, failed = set(tried) | stale, set(failed) | stale
        needs = job.needs
        pair = self.pool.pick_pair(tried, needs) if handoffs < self.cfg.retry.prefill_attempts else None
        if pair is not None:
            p, d = pair
            v = self.gates.verdict(p.spec, d.spec, len(job.ids))
            trace.verdict = v.reason if v is not None else "cost gate off"
            if v is None or v.move:
                return "disagg", p, d, ""
            target = self.pool.pick_compute(prefer=d, exclude=failed, needs=needs)
            if target is not None:
                return "compute", target, None, "below_break_even"
            trace.verdict += "; no server computes requests alone, so moving anyway"
            return "disagg", p, d, ""
        if handoffs == 0 or self.cfg.retry.recompute:
            target = self.pool.pick_compute(exclude=failed, needs=needs)
            if target is not None:
                return "compute", target, None, ("prefill_failed" if last is not None else "no_pair")
        if last is not None:
            raise RouteError(502, last.reason, f"request {job.rid} failed after {handoffs} handoff attempt(s) and "
                             f"{len(failed)} compute attempt(s): " + " | ".join(trace.attempts))
        up = ", ".join(f"{s.name} {'up' if s.healthy else 'down: ' + (s.last_error or '?')}"
                       + (f" (cannot: {'; '.join(s.unmet(needs, 'decode'))})" if s.unmet(needs, "decode") else "")
                       for s in self.pool.servers)
        raise RouteError(503, "no_server", f"no healthy server can take request {job.rid} ({up})",
                         self.cfg.limits.retry_after_s)

    async def run(self, job: Job, trace: Trace) -> AsyncIterator[E.Piece]:
        """The request's output pieces; RouteError when it cannot be served."""
        tried: set[Server] = set()
        failed: set[Server] = set()
        handoffs = 0
        last: _HalfFailed | None = None
        while True:
            if self._left(job) <= 0:
                raise self._deadline_error(job, "before dispatch")
            kind, a, b, why = self._choose(job, trace, tried, failed, handoffs, last)
            try:
                if kind == "disagg":
                    handoffs += 1
                    stream = self._disaggregated(job, trace, a, b, handoffs)
                else:
                    stream = self._compute(job, trace, a, why)
                async for piece in stream:
                    yield piece
                return
            except _HalfFailed as f:
                last = f
                (tried if kind == "disagg" else failed).add(a)
                route = f"{a.engine}->{b.engine}" if kind == "disagg" else a.engine
                trace.attempts.append(f"{kind} on {a.name}{' -> ' + b.name if b else ''}: {f.reason}: {f.error}")
                self.m.retries.labels(route, f.reason).inc()
                log.warning("route: request %s: %s; retrying", job.rid, trace.attempts[-1])
                if self.cfg.retry.backoff_s:
                    await asyncio.sleep(min(self.cfg.retry.backoff_s, max(0.0, self._left(job))))

    # -- one try ------------------------------------------------------------------------
    @staticmethod
    def _sampling(job: Job, s: Server, part: str) -> E.Sampling:
        return C.for_server(job.sampling, s.engine, s.caps, part)

    @staticmethod
    def _answer_from(job: Job, s: Server) -> None:
        """The answer comes from ``s``: it ends at EOS when ``s`` does not stop there."""
        if job.answer is not None:
            job.answer.end_at_eos(s.caps.eos == "router" and not job.sampling.ignore_eos)

    @staticmethod
    def _shaped(job: Job, piece: E.Piece) -> E.Piece:
        """``piece`` with its text, cut where the answer ends."""
        if job.answer is None:
            return piece
        ids, text, finish = job.answer.add(piece.ids, piece.finish)
        return E.Piece(ids, finish, text, job.answer.matched)

    async def _pieces(self, job: Job, relay: _Relay, first: E.Piece) -> AsyncIterator[E.Piece]:
        """The answer's pieces from the first on, until it ends (the server may go on)."""
        piece = self._shaped(job, first)
        relay.cut = first.finish is None and piece.finish is not None
        yield piece
        if piece.finish is not None:
            return
        async for raw in self._rest(job, relay):
            piece = self._shaped(job, raw)
            relay.cut = raw.finish is None and piece.finish is not None
            yield piece
            if piece.finish is not None:
                return

    async def _first(self, job: Job, relay: _Relay, prefill: asyncio.Task | None, prefill_by: float):
        """Wait for the stream's first piece, racing the prefill half and the deadlines.
        Returns the piece; raises _HalfFailed (retry), E.EngineError (the stream's own
        failure, with the prefill fine) or RouteError (deadline)."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if now >= job.deadline:
                raise self._deadline_error(job, "before the first token")
            waits = {relay.next_task()}
            limit = job.deadline - now
            if prefill is not None and not prefill.done():
                waits.add(prefill)
                limit = min(limit, prefill_by - now)
            done, _ = await asyncio.wait(waits, timeout=max(0.0, limit), return_when=asyncio.FIRST_COMPLETED)
            if relay.getter in done:
                item = relay.take()
                if isinstance(item, E.EngineError):
                    if prefill is not None:
                        perr = await self._prefill_error(prefill, min(1.0, max(0.0, job.deadline - loop.time())))
                        if perr is not None:
                            raise _HalfFailed("prefill_failed", perr)
                    raise item
                if item is _END:
                    raise E.EngineError(relay_server(relay), "bad_answer", "the stream ended without a token")
                return item
            if prefill is not None and prefill in done and prefill.exception() is not None:
                raise _HalfFailed("prefill_failed", prefill.exception())
            if prefill is not None and not prefill.done() and loop.time() >= prefill_by:
                raise _HalfFailed("prefill_timeout", E.EngineError(
                    prefill_server(prefill), "timeout",
                    f"no handoff within deadlines.prefill_s = {self.cfg.deadlines.prefill_s:g} s"))

    @staticmethod
    async def _prefill_error(prefill: asyncio.Task, grace_s: float) -> E.EngineError | None:
        if not prefill.done():
            await asyncio.wait({prefill}, timeout=grace_s)
        if prefill.done() and not prefill.cancelled() and prefill.exception() is not None:
            return prefill.exception()
        return None

    async def _rest(self, job: Job, relay: _Relay) -> AsyncIterator[E.Piece]:
        """The stream's pieces after the first, within the deadline."""
        loop = asyncio.get_running_loop()
        while True:
            left = job.deadline - loop.time()
            done, _ = await asyncio.wait({relay.next_task()}, timeout=max(0.0, left))
            if not done:
                raise self._deadline_error(job, "while streaming")
            item = relay.take()
            if item is _END:
                return
            if isinstance(item, E.EngineError):
                raise item
            yield item

    async def _disaggregated(self, job: Job, trace: Trace, p: Server, d: Server, n: int) -> AsyncIterator[E.Piece]:
        loop = asyncio.get_running_loop()
        room = new_room()
        h = E.Handoff(room, p.spec)
        if d.engine == "trtllm" or (d.engine == "vllm" and not p.spec.bootstrap):
            h = await self._with_endpoints(job, h, p)
        rid_p, rid_d = f"{job.rid}-p{n}", f"{job.rid}-d{n}"
        trace.route, trace.mode, trace.servers, trace.why = f"{p.engine}->{d.engine}", "disaggregated", [p.name, d.name], ""
        trace.rooms.append(room)
        trace.verified = self._integrity.verifies(room)  # a room whose content differs fails: this try ends
        relay = prefill = None
        announced: list[Server] = []
        first_out = False
        ok = False
        with self.pool.lease(p, d):
            try:
                try:
                    announced = [x for x in (d, p) if x.engine == "trtllm"]
                    await asyncio.wait_for(
                        E.announce_halves(p, d, job.ids, h, on_failure="fail", ttl_s=max(1.0, self._left(job) + 1.0),
                                          timeout_s=max(0.1, self._left(job)), keyring=self.ranks.keyring),
                        max(0.0, self._left(job)))
                except asyncio.TimeoutError:
                    raise self._deadline_error(job, "while announcing the handoff") from None
                except E.EngineError as e:
                    self._noted(e)
                    if e.server is p:
                        raise _HalfFailed("prefill_failed", e) from None
                    raise
                prefill = asyncio.create_task(E.run_prefill(self.http, p, self._model(p), job.ids,
                                                             self._sampling(job, p, "prefill"), h, rid_p))
                prefill.server = p  # type: ignore[attr-defined]
                relay = _Relay(E.stream_decode(self.http, d, self._model(d), job.ids, self._sampling(job, d, "decode"),
                                               h, rid_d))
                relay.server = d  # type: ignore[attr-defined]
                self._answer_from(job, d)
                first = await self._first(job, relay, prefill, loop.time() + self.cfg.deadlines.prefill_s)
                first_out = True
                # done once the last piece is out: a consumer may stop at the finish without exhausting us
                async for piece in self._pieces(job, relay, first):
                    ok = piece.finish is not None
                    yield piece
                ok = True
            except _HalfFailed as f:
                self._noted(f.error)
                raise
            except E.EngineError as e:  # the decode failed (the prefill did not)
                self._noted(e)
                self.ranks.forget(p.spec)  # in case the decode could not reach ranks the prefill no longer has
                raise RouteError(502, "decode_failed",
                                 f"request {job.rid}: decode {d.name} failed "
                                 f"{'while streaming' if first_out else 'before the first token'}: {e} "
                                 f"(room {room} aborted on prefill {p.name})") from None
            finally:
                if relay is not None:
                    relay.cancel()
                    if not ok or relay.cut:
                        self._abort_rid(d, rid_d)
                if prefill is not None and not ok:
                    prefill.cancel()
                    self._abort_rid(p, rid_p)
                if not ok:
                    self._abort_room(p, room, f"router: request {job.rid} ended without this handoff")
                    self._mark_stale(job, announced)
                if prefill is not None and ok and not prefill.done():
                    self._later(_settle(prefill, 10.0))

    async def _with_endpoints(self, job: Job, h: E.Handoff, p: Server) -> E.Handoff:
        """The handoff with the prefill's rank endpoints (for a TensorRT-LLM decode's handle,
        or a vLLM decode's when the prefill has no bootstrap server); a prefill whose ranks
        cannot be found has failed."""
        try:
            eps = await asyncio.wait_for(self.ranks.endpoints(p.spec, min(2.0, max(0.1, self._left(job)))),
                                         max(0.0, self._left(job)))
        except asyncio.TimeoutError:
            raise self._deadline_error(job, "while finding the prefill's ranks") from None
        except Exception as e:
            self.ranks.forget(p.spec)
            raise _HalfFailed("prefill_failed", E.EngineError(p, "connect", f"its kvbridge ranks: {e}")) from None
        return E.Handoff(h.room, h.prefill, tuple(eps))

    async def _compute(self, job: Job, trace: Trace, s: Server, why: str) -> AsyncIterator[E.Piece]:
        rid = f"{job.rid}-c{len(trace.attempts)}"
        trace.route, trace.mode, trace.why, trace.servers = s.engine, "recomputed", why, [s.name]
        relay = None
        ok = False
        with self.pool.lease(s):
            try:
                relay = _Relay(E.stream_compute(self.http, s, self._model(s), job.ids,
                                                self._sampling(job, s, "compute"), rid))
                relay.server = s  # type: ignore[attr-defined]
                self._answer_from(job, s)
                try:
                    first = await self._first(job, relay, None, 0.0)
                except E.EngineError as e:
                    self._noted(e)
                    raise _HalfFailed("compute_failed", e) from None
                async for piece in self._pieces(job, relay, first):
                    ok = piece.finish is not None
                    yield piece
                ok = True
            except E.EngineError as e:
                self._noted(e)
                raise RouteError(502, "compute_failed", f"request {job.rid}: {s.name} failed while streaming: {e}") from None
            finally:
                if relay is not None:
                    relay.cancel()
                    if not ok or relay.cut:
                        self._abort_rid(s, rid)


def relay_server(relay: _Relay):
    return getattr(relay, "server")


def prefill_server(task: asyncio.Task):
    return getattr(task, "server")


async def _settle(task: asyncio.Task, timeout_s: float) -> None:
    """Let a prefill half that is still answering finish, then drop it."""
    await asyncio.wait({task}, timeout=timeout_s)
    if not task.done():
        task.cancel()
    elif not task.cancelled() and task.exception() is not None:
        log.info("route: a prefill half failed after its decode finished: %s", task.exception())
