"""SGLang's real server pairs on CPU, shared by the whole session (tests/helpers/sglang_pairs.py).

- ``sglang_pair_factory``: ``get_pair(backend, model_dir=None, **start_pair_kwargs) -> Pair``;
  the same configuration returns the same running pair; at most one pair lives at a time.
- ``mooncake_pair``: the tiny Llama served with SGLang's own ``mooncake`` backend.
- ``mooncake_mla_pair``: the tiny MLA model, likewise.
"""
import os

import pytest

from tests.helpers import sglang_pairs, sglang_servers


def _require_sglang() -> None:
    if os.environ.get("KVBRIDGE_SKIP_SGLANG_SERVER"):
        pytest.skip("KVBRIDGE_SKIP_SGLANG_SERVER is set")
    import sglang  # noqa: F401  (pinned: a missing one fails the run, never skips)


@pytest.fixture(scope="session")
def sglang_pair_factory():
    _require_sglang()
    yield sglang_pairs.get_pair
    sglang_servers.stop_shared()
    sglang_pairs.write_timings()


@pytest.fixture
def mooncake_pair(sglang_pair_factory) -> sglang_servers.Pair:
    """The tiny Llama as a prefill/decode pair over SGLang's own Mooncake backend (TCP)."""
    return sglang_pair_factory("mooncake")


@pytest.fixture
def mooncake_mla_pair(sglang_pair_factory, tiny_mla_dir) -> sglang_servers.Pair:
    """The tiny DeepSeek-V3-style MLA model as a pair over SGLang's Mooncake backend (TCP)."""
    return sglang_pair_factory("mooncake", model_dir=tiny_mla_dir)
