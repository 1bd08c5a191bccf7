"""SGLang transfer-backend plugin (kvbridge.adapters.sglang).

``--disaggregation-transfer-backend kvbridge`` on SGLang >= 0.5.16: the installed
entry point ``sglang.srt.plugins: kvbridge`` runs ``register`` in every SGLang process.
The backend classes live in ``kvbridge.adapters.sglang.conn`` (imported lazily: it
imports SGLang).
"""

from .plugin import BACKEND, extend_enum, install, register

__all__ = ["BACKEND", "extend_enum", "install", "register"]
