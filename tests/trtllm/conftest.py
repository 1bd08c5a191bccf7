import pytest

from kvbridge.demo.trtllm.server import StandInServer
from tests.helpers.trtllm_servers import PLUGIN


@pytest.fixture
def trt_servers():
    """``make(version, model, plugin=None, **llm_kw) -> StandInServer``; all stopped at the end."""
    started: list[StandInServer] = []

    def make(version: str, model, plugin: dict | None = None, **kw) -> StandInServer:
        s = StandInServer(version, model, plugin={**PLUGIN, **(plugin or {})}, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
