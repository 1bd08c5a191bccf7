"""The demo's deployment secret: secure defaults in the demo and the tests too.

Every server a demo (or a test session) starts inherits this process's environment, so
one ``KVBRIDGE_SECRET`` set here before the first server starts is the shared key of the
whole local deployment: every control, bus and rank-record frame between them is sealed,
as in production. An operator's own ``KVBRIDGE_SECRET`` is kept.
"""

from __future__ import annotations

import logging
import os
import secrets

__all__ = ["ensure_secret"]

log = logging.getLogger(__name__)


def ensure_secret(environ=None) -> str:
    """``KVBRIDGE_SECRET`` in ``environ`` (default ``os.environ``), set to 32 random bytes
    (hex) first when it is missing or empty; returns it."""
    env = os.environ if environ is None else environ
    if not env.get("KVBRIDGE_SECRET"):
        env["KVBRIDGE_SECRET"] = secrets.token_hex(32)
        log.info("kvbridge: a fresh KVBRIDGE_SECRET for this local deployment (every server started from here shares it)")
    return env["KVBRIDGE_SECRET"]
