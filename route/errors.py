"""What the router answers when it cannot serve a request: one error type, mapped to HTTP."""

from __future__ import annotations

__all__ = ["RouteError"]


class RouteError(RuntimeError):
    """A request the router ends with an error. ``status``: the HTTP status (400 bad
    request, 404 unknown model or path, 405 wrong method, 408 body too slow, 413 body too large, 429 saturated, 502 a server failed, 503 no server / queued too long, 504
    deadline); ``reason``: the metrics label; ``retry_after``: seconds for the
    ``Retry-After`` header (429 and 503); ``param``: the request field at fault."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        self.param = param

    def body(self) -> dict:
        """The OpenAI-style error object."""
        kind = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error", 408: "timeout",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
                504: "timeout"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status,
                          "reason": self.reason}}
