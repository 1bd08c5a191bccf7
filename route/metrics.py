"""The router's Prometheus metrics, in a registry of its own (served at ``/metrics``).

``route`` is the path a request took: ``"sglang->trtllm"`` (prefill engine -> decode
engine) when its KV moved, the computing server's engine (``"sglang"``) when it ran on
one server; ``mode`` says which (``disaggregated`` | ``recomputed``), and ``why`` why
it was recomputed (``below_break_even``, ``prefill_failed``, ``no_pair``).

| metric | labels | what |
|---|---|---|
| ``kvbridge_route_requests_total`` | route, mode | requests the client got whole (the last token sent) |
| ``kvbridge_route_recomputed_total`` | route, why | of those, computed on one server, and why |
| ``kvbridge_route_ttft_seconds`` | route, mode | arrival at the router to first token out |
| ``kvbridge_route_request_seconds`` | route, mode | arrival to the last token out |
| ``kvbridge_route_failures_total`` | route, reason | requests that ended in an error (reason: ``prefill_failed``, ``decode_failed``, ``compute_failed``, ``deadline``, ``no_server``, ``saturated``, ``bad_request``, ``model_not_found``, ``client_gone``) |
| ``kvbridge_route_retries_total`` | route, reason | handoffs retried (``prefill_failed``, ``prefill_timeout``, ``compute_failed``) |
| ``kvbridge_route_room_aborts_total`` | engine | rooms the router aborted on a prefill |
| ``kvbridge_route_inflight`` / ``kvbridge_route_queued`` | | requests dispatched / waiting |
| ``kvbridge_route_server_up`` | server, engine, role | 1 in rotation, 0 out |
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["RouteMetrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouteMetrics:
    """Every router metric, registered in ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("kvbridge_route_requests", "Requests answered whole, by route and mode", ["route", "mode"],
                                registry=r)
        self.recomputed = Counter("kvbridge_route_recomputed", "Requests computed on one server, and why",
                                  ["route", "why"], registry=r)
        self.ttft = Histogram("kvbridge_route_ttft_seconds", "Arrival to first token out", ["route", "mode"],
                              buckets=_TTFT_BUCKETS, registry=r)
        self.latency = Histogram("kvbridge_route_request_seconds", "Arrival to last token out", ["route", "mode"],
                                 buckets=_TTFT_BUCKETS, registry=r)
        self.failures = Counter("kvbridge_route_failures", "Requests that ended in an error", ["route", "reason"],
                                registry=r)
        self.retries = Counter("kvbridge_route_retries", "Handoffs retried", ["route", "reason"], registry=r)
        self.room_aborts = Counter("kvbridge_route_room_aborts", "Rooms aborted on a prefill", ["engine"], registry=r)
        self.inflight = Gauge("kvbridge_route_inflight", "Requests dispatched", registry=r)
        self.queued = Gauge("kvbridge_route_queued", "Requests waiting for admission", registry=r)
        self.server_up = Gauge("kvbridge_route_server_up", "1 when the server is in rotation",
                               ["server", "engine", "role"], registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict | None = None) -> float:
        """One sample (0 when absent), e.g. ``value("kvbridge_route_requests_total", {...})``."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else float(v)
