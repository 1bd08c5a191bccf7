"""What the router answers when it cannot serve a request: one error type, mapped to HTTP."""

from __future__ import annotations

__all__ = ["RouteError"]


class RouteError(RuntimeError):
    """A request the router ends with an error. ``status``: the HTTP status (400 bad
    request, 429 saturated, 502 a server failed, 503 no server / queued too long, 504
    deadline); ``reason``: the metrics label; ``retry_after``: seconds for the
    ``Retry-After`` header (429 and 503)."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    def body(self) -> dict:
        """The OpenAI-style error object."""
        kind = {400: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
                504: "timeout"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "code": self.status, "reason": self.reason}}
