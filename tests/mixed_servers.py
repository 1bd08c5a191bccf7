"""One SGLang server (prefill OR decode) on the kvbridge backend, for the mixed-engine
tests: the other half of the pair is the "TensorRT-LLM" side in the test process. The
launcher and the discovery client are the library's (``kvbridge.demo.sglang_server``,
``kvbridge.common.bootstrap``); re-exported here under the names the tests use."""

from __future__ import annotations

from kvbridge.common.bootstrap import BootstrapServer, fetch_ranks, rank_record
from kvbridge.demo.sglang_server import HOST, sglang_server  # noqa: F401


def kvbridge_ranks(bootstrap_port: int, timeout: float = 60.0) -> dict:
    """The prefill's kvbridge ranks from its SGLang bootstrap server (GET /kvbridge/ranks),
    once every rank registered."""
    return fetch_ranks(f"{HOST}:{bootstrap_port}", timeout)


class TRTPrefillBootstrap:
    """An SGLang bootstrap server for an already running "TensorRT-LLM" prefill rank (TP 1),
    registered with its worker's kvbridge record. The plugin does this itself when the
    engine is configured with ``sglang_bootstrap_port`` (``TRTEngine(...,
    sglang_bootstrap_port=0)``, then ``engine.scheduler.bootstrap_address``); this class
    is for tests that build the engine without it. ``page_size`` must be the DECODE's
    (see ``kvbridge.common.bootstrap.BootstrapServer``)."""

    def __init__(self, worker, *, page_size: int = 1):
        self.server = BootstrapServer(HOST, 0, page_size=page_size, tp_size=1)
        self.port = self.server.port
        self.server.register(0, rank_record(endpoint=worker.sender.endpoint, session=worker.transport.session_id,
                                            engine="trtllm", page_size=worker.layout.tokens_per_block,
                                            layout=worker.layout.describe()))

    def close(self):
        self.server.close()
