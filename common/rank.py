"""One engine rank's kvbridge side, started and closed the same way by the three plugins.

Each plugin hands it the rank's ``KVLayout`` once its engine has allocated the KV cache
(SGLang: the KV manager's ``__init__``; TensorRT-LLM and vLLM: ``register_kv_caches``)::

    rank = BridgeRank(settings, "vllm")                  # the transport, bound to settings.host
    sender = rank.start_sender(layout)                   # a prefill side
    receiver = rank.start_receiver(layout)               # a decode side (offers recv_staging_bytes)
    bootstrap.register(tp_rank, rank.record())           # what decode ranks find it by
    ...
    rank.close()                                         # sender, receiver, then the transport
"""

from __future__ import annotations

import logging

from .protocol import LayoutDescription, RankRecord
from .receiver import KVReceiver
from .sender import KVSender
from .settings import BridgeSettings

__all__ = ["BridgeRank"]

log = logging.getLogger(__name__)


class BridgeRank:
    """One rank's Mooncake transport, its sender and receiver (either or both), and the
    record it publishes; ``engine`` names the engine in that record."""

    def __init__(self, settings: BridgeSettings, engine: str):
        self.settings, self.engine = settings, engine
        self.transport = settings.transport()
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        log.info("kvbridge %s rank: transport %s, plans costed on %s", engine, self.transport.session_id,
                 settings.link_profile().describe())

    def start_sender(self, layout) -> KVSender:
        """The prefill side over ``layout`` (its control endpoint bound to ``settings.host``)."""
        if self.sender is not None:
            raise RuntimeError(f"kvbridge {self.engine} rank: sender started twice")
        self.sender = KVSender(layout, self.transport, host=self.settings.host, config=self.settings.handoff())
        return self.sender

    def start_receiver(self, layout) -> KVReceiver:
        """The decode side over ``layout`` (offering ``recv_staging_bytes`` to its senders)."""
        if self.receiver is not None:
            raise RuntimeError(f"kvbridge {self.engine} rank: receiver started twice")
        self.receiver = KVReceiver(layout, self.transport, config=self.settings.handoff(receiver=True))
        return self.receiver

    def record(self) -> RankRecord:
        """What this prefill rank publishes for decode ranks (its sender must be started)."""
        if self.sender is None:
            raise RuntimeError(f"kvbridge {self.engine} rank: no sender, nothing to publish")
        lay = self.sender.layout
        return RankRecord(endpoint=self.sender.endpoint, session=self.transport.session_id, engine=self.engine,
                          page_size=lay.tokens_per_block, layout=LayoutDescription.of(lay))

    def close(self) -> None:
        """Close the sender and the receiver (each best effort), then the transport."""
        for side in (self.sender, self.receiver):
            if side is not None:
                try:
                    side.close()
                except Exception:  # pragma: no cover - best effort at shutdown
                    log.exception("kvbridge %s rank: closing its %s", self.engine, type(side).__name__)
        self.transport.close()
