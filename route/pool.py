"""The router's servers: who is in rotation, how busy each is, and which to pick.

Selection is least-outstanding: the healthy candidate with the fewest requests the
router has in flight on it (ties in turn). A pair is a decode first (among those with a
healthy prefill they can pull from), then the least busy prefill for it. No engine here
reports which prefixes a decode holds in a form a router can read, so there is no prefix
affinity: every decode is equally good for every prompt.

Health: ``health_loop`` polls each server's health path; ``fail_after`` failures in a row
take a server out of rotation, ``pass_after`` successes bring it back. ``mark_down``
takes one out at once (a refused connection on the request path); polling brings it
back.

Capabilities (``capabilities``): each server's, from the configuration narrowed by what
the server publishes (read once it is healthy); a choice given a request's ``Needs``
takes only servers that can serve it, and ``refusal`` says why none of the configured
servers could (a 400 before any server is asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import aiohttp

from . import capabilities as C
from .config import HealthSpec, RouteConfig, ServerSpec, pairable
from .errors import RouteError

__all__ = ["Server", "ServerPool"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Server:
    """One server's live state (the spec is the configuration's)."""

    spec: ServerSpec
    healthy: bool = True
    outstanding: int = 0
    fails: int = 0
    passes: int = 0
    last_error: str = ""
    changed_at: float = field(default_factory=time.monotonic)
    served: int = 0
    caps: C.Caps = field(default_factory=C.Caps)
    caps_read: bool = False  # what it publishes was read

    def unmet(self, needs: "C.Needs | None", part: str) -> list[str]:
        """Why this server cannot be ``part`` of a request with ``needs`` (empty: it can)."""
        return [] if needs is None else needs.unmet(self.engine, self.caps, part)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def engine(self) -> str:
        return self.spec.engine

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def url(self) -> str:
        return self.spec.url.rstrip("/")

    def describe(self) -> str:
        return f"{self.name} ({self.engine} {self.role}, {self.url})"


class ServerPool:
    """Every configured server, their health and load; pick prefill/decode pairs and
    compute targets."""

    def __init__(self, cfg: RouteConfig, on_change: Callable[[Server], None] | None = None):
        self.context = C.model_context(cfg)
        self.servers = [Server(s, caps=C.configured(s, self.context)) for s in cfg.servers]
        self.by_name = {s.name: s for s in self.servers}
        self.health = cfg.health
        self._turns: dict[str, Iterator[int]] = {}
        self._on_change = on_change or (lambda s: None)

    # -- selection ----------------------------------------------------------------------
    def _least_busy(self, cands: Iterable[Server], turn: str) -> Server | None:
        """The candidate with the fewest outstanding requests; ties in turn (one turn
        counter per kind of choice, so that choices of one kind alternate)."""
        cands = list(cands)
        if not cands:
            return None
        low = min(s.outstanding for s in cands)
        tied = [s for s in cands if s.outstanding == low]
        return tied[next(self._turns.setdefault(turn, itertools.count())) % len(tied)]

    def healthy(self, role: str) -> list[Server]:
        return [s for s in self.servers if s.role == role and s.healthy]

    def pick_pair(self, exclude: Iterable[Server] = (), needs: C.Needs | None = None) -> tuple[Server, Server] | None:
        """The least busy healthy decode with a healthy prefill it can pull from (not in
        ``exclude``, both able to serve ``needs``), and the least busy such prefill; None
        when there is none."""
        ex = set(exclude)
        prefills = [p for p in self.healthy("prefill") if p not in ex and not p.unmet(needs, "prefill")]
        decodes = [d for d in self.healthy("decode") if d not in ex and not d.unmet(needs, "decode")
                   and any(pairable(p.spec, d.spec) for p in prefills)]
        d = self._least_busy(decodes, "decode")
        if d is None:
            return None
        p = self._least_busy((p for p in prefills if pairable(p.spec, d.spec)), "prefill")
        return (p, d) if p is not None else None

    def pick_compute(self, prefer: Server | None = None, exclude: Iterable[Server] = (),
                     needs: C.Needs | None = None) -> Server | None:
        """A healthy server that computes a request alone (and can serve ``needs``):
        ``prefer`` when it can (a TensorRT-LLM decode chosen for the pair), else the least
        busy aggregated server, else the least busy TensorRT-LLM or vLLM decode."""
        ex = set(exclude)
        if (prefer is not None and prefer.spec.can_compute and prefer.healthy and prefer not in ex
                and not prefer.unmet(needs, "compute")):
            return prefer
        cands = [s for s in self.servers if s.healthy and s not in ex and s.spec.can_compute
                 and not s.unmet(needs, "compute")]
        agg = [s for s in cands if s.role == "aggregated"]
        return self._least_busy(agg or cands, "compute")

    def refusal(self, needs: C.Needs, rid: str = "") -> RouteError | None:
        """A 400 naming why no configured server (healthy or not) could serve a request
        with ``needs``; None when some pair or compute target could."""
        if self.context and needs.prompt + needs.max_tokens > self.context:
            return RouteError(400, "bad_request", f"This model's maximum context length is {self.context} tokens. "
                              f"However, you requested {needs.prompt + needs.max_tokens} tokens ({needs.prompt} in "
                              f"the prompt, {needs.max_tokens} for the completion: 'max_tokens'). Please reduce the "
                              "prompt or the completion.", param="max_tokens")
        prefills = [p for p in self.servers if p.role == "prefill" and not p.unmet(needs, "prefill")]
        if any(d.role == "decode" and not d.unmet(needs, "decode") and any(pairable(p.spec, d.spec) for p in prefills)
               for d in self.servers):
            return None
        if any(s.spec.can_compute and not s.unmet(needs, "compute") for s in self.servers):
            return None
        why = []
        for s in self.servers:
            part = "compute" if s.role == "aggregated" else s.role
            if s.role == "decode" and s.spec.can_compute and not s.unmet(needs, "compute"):
                part = "decode"
            reasons = s.unmet(needs, part)
            if reasons:
                why.append(f"{s.name} ({s.engine} {s.role}): " + "; ".join(reasons))
        param = "seed" if any("'seed'" in w for w in why) else "temperature" if any("'temperature'" in w for w in why) \
            else "max_tokens"
        return RouteError(400, "bad_request", f"no server of this deployment can serve request {rid}: "
                          + (" | ".join(why) or "no prefill can feed a decode that could take it"), param=param)

    def can_serve(self) -> bool:
        """Whether any request could be dispatched now."""
        return self.pick_pair() is not None or self.pick_compute() is not None

    @contextlib.contextmanager
    def lease(self, *servers: Server) -> Iterator[None]:
        """Count a request as outstanding on ``servers`` while the block runs."""
        for s in servers:
            s.outstanding += 1
        try:
            yield
        finally:
            for s in servers:
                s.outstanding -= 1
                s.served += 1

    # -- health -------------------------------------------------------------------------
    def _set(self, s: Server, healthy: bool, why: str) -> None:
        if s.healthy != healthy:
            s.healthy = healthy
            s.changed_at = time.monotonic()
            log.warning("route: %s %s rotation%s", s.describe(), "back in" if healthy else "out of",
                        f": {why}" if why else "")
            self._on_change(s)

    def mark_down(self, s: Server, why: str) -> None:
        """Out of rotation now (a refused connection, a dead server)."""
        s.last_error = why
        s.fails, s.passes = max(s.fails, self.health.fail_after), 0
        self._set(s, False, why)

    def observe(self, s: Server, ok: bool, why: str = "") -> None:
        """One health probe's outcome."""
        if ok:
            s.passes += 1
            s.fails = 0
            if not s.healthy and s.passes >= self.health.pass_after:
                self._set(s, True, "")
        else:
            s.fails += 1
            s.passes = 0
            s.last_error = why
            if s.healthy and s.fails >= self.health.fail_after:
                self._set(s, False, why)

    async def probe(self, http: aiohttp.ClientSession, s: Server) -> tuple[bool, str]:
        """GET the server's health path: (ok, why not)."""
        h: HealthSpec = self.health
        try:
            async with http.get(s.url + h.path, timeout=aiohttp.ClientTimeout(total=h.timeout_s)) as r:
                if r.status == 200:
                    return True, ""
                return False, f"health: HTTP {r.status}"
        except asyncio.TimeoutError:
            return False, f"health: no answer in {h.timeout_s:g} s"
        except aiohttp.ClientError as e:
            return False, f"health: {type(e).__name__}: {e}"

    async def check_all(self, http: aiohttp.ClientSession) -> None:
        """Probe every server once, concurrently."""
        results = await asyncio.gather(*(self.probe(http, s) for s in self.servers))
        for s, (ok, why) in zip(self.servers, results):
            self.observe(s, ok, why)

    async def read_caps(self, http: aiohttp.ClientSession) -> None:
        """Narrow the capabilities of each healthy server not read yet by what it publishes."""
        todo = [s for s in self.servers if s.healthy and not s.caps_read]
        found = await asyncio.gather(*(C.discover(http, s.spec, self.health.timeout_s) for s in todo))
        for s, limits in zip(todo, found):
            if limits is None:
                continue
            s.caps_read = True
            s.caps = C.narrowed(s.caps, limits, "published")
            if s.caps.cannot() or limits:
                log.info("route: %s: context %s tokens; cannot %s", s.describe(), s.caps.context_length or "?",
                         "; ".join(s.caps.cannot()) or "-")

    async def health_loop(self, http: aiohttp.ClientSession) -> None:
        """Probe every ``interval_s`` until cancelled."""
        while True:
            t0 = time.monotonic()
            try:
                await self.check_all(http)
                await self.read_caps(http)
            except Exception:  # a probe bug must not stop health checking
                log.exception("route: health check failed")
            await asyncio.sleep(max(0.0, self.health.interval_s - (time.monotonic() - t0)))

    def snapshot(self) -> list[dict]:
        """Every server's state, for /health and logs."""
        return [{"name": s.name, "engine": s.engine, "role": s.role, "url": s.url, "healthy": s.healthy,
                 "outstanding": s.outstanding, "served": s.served, "last_error": s.last_error,
                 "context_length": s.caps.context_length or None, "cannot": s.caps.cannot()} for s in self.servers]
