"""pytest fixtures for tests that run SGLang's real server pair on CPU.

Use them either by importing into a test module::

    from conftest_sglang import sglang_pair_factory, tiny_llama_dir  # noqa: F401

or by ``from conftest_sglang import *`` in tests/conftest.py. Both ways share
one process-wide registry (``sglang_servers.shared_pair`` and ``tiny_model_dir``),
so each configuration's servers start once per test session even if the
fixtures end up defined in several modules. Logs go to a temporary folder that is
removed at exit unless KVBRIDGE_KEEP_SGLANG_LOGS=1 (then it also holds
timings.json: start and request seconds per pair).

- ``tiny_llama_dir``: the tiny GQA Llama (built once per session, no download).
- ``tiny_mla_dir``: the tiny DeepSeek-V3-style MLA model (same).
- ``sglang_pair_factory``: ``get_pair(backend, model_dir=None, **start_pair_kwargs) -> Pair``;
  the same configuration returns the same running pair; a pair that a failure
  test killed is restarted on the next call; at most one pair lives at a time.
- ``mooncake_pair``: the tiny Llama served with SGLang's own ``mooncake`` backend.
- ``mooncake_mla_pair``: the tiny MLA model, likewise.

A new backend gets its own fixture in one line::

    @pytest.fixture
    def kvbridge_pair(sglang_pair_factory):
        return sglang_pair_factory("kvbridge", extra_env={"SGLANG_PLUGINS": "kvbridge"})
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

import sglang_servers
import tiny_models

_MODEL_BUILDERS = {
    "llama": tiny_models.build_tiny_llama,
    "mla": tiny_models.build_tiny_mla,
    # another model for the same tokenizer: 3 layers, 4 KV heads (a decode it cannot pair with)
    "llama_other": lambda d: tiny_models.build_tiny_llama(d, seed=1, num_hidden_layers=3, num_key_value_heads=4),
}
_MODEL_DIRS: dict[str, Path] = {}
_MODEL_LOCK = threading.Lock()
_ROOT: Path | None = None


def _root() -> Path:
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="kvbridge-sglang-"))
        if not os.environ.get("KVBRIDGE_KEEP_SGLANG_LOGS"):
            atexit.register(shutil.rmtree, str(_ROOT), True)
    return _ROOT


def tiny_model_dir(kind: str = "llama") -> Path:
    """The tiny model ``kind`` ("llama", "mla" or "llama_other"), built once per process."""
    with _MODEL_LOCK:
        if kind not in _MODEL_DIRS:
            _MODEL_DIRS[kind] = _MODEL_BUILDERS[kind](_root() / f"tiny_{kind}")
        return _MODEL_DIRS[kind]


def _require_sglang() -> None:
    if os.environ.get("KVBRIDGE_SKIP_SGLANG_SERVER"):
        pytest.skip("KVBRIDGE_SKIP_SGLANG_SERVER is set")
    pytest.importorskip("sglang")


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_mla_dir() -> Path:
    return tiny_model_dir("mla")


# Process-wide, like the pair registry: the fixtures may be defined in several modules.
_STARTED: list[sglang_servers.Pair] = []
_LOG_SEQ = itertools.count()


def get_pair(backend: str, model_dir=None, **kw) -> sglang_servers.Pair:
    """The running pair for (model, backend, options); see sglang_servers.shared_pair."""
    model_dir = Path(model_dir) if model_dir is not None else tiny_model_dir("llama")
    # a new folder for each start (used only if this call starts servers)
    kw.setdefault("log_dir", _root() / "logs" / f"{backend}-{model_dir.name}-{next(_LOG_SEQ)}")
    pair = sglang_servers.shared_pair(model_dir, backend, **kw)  # log_dir is not part of the key
    if pair not in _STARTED:
        _STARTED.append(pair)
    return pair


def _write_timings() -> Path:
    path = _root() / "timings.json"
    path.write_text(
        json.dumps(
            [
                {
                    "backend": p.backend,
                    "model": p.model_dir.name,
                    "start_s": p.start_seconds,
                    "prefill_ready_s": p.prefill.ready_after_s,
                    "decode_ready_s": p.decode.ready_after_s,
                    "requests": p.timings,
                    "logs": str(p.log_dir),
                }
                for p in _STARTED
            ],
            indent=1,
        )
    )
    return path


@pytest.fixture(scope="session")
def sglang_pair_factory():
    _require_sglang()
    yield get_pair
    sglang_servers.stop_shared()
    _write_timings()


@pytest.fixture
def mooncake_pair(sglang_pair_factory) -> sglang_servers.Pair:
    """The tiny Llama as a prefill/decode pair over SGLang's own Mooncake backend (TCP)."""
    return sglang_pair_factory("mooncake")


@pytest.fixture
def mooncake_mla_pair(sglang_pair_factory, tiny_mla_dir) -> sglang_servers.Pair:
    """The tiny DeepSeek-V3-style MLA model as a pair over SGLang's Mooncake backend (TCP)."""
    return sglang_pair_factory("mooncake", model_dir=tiny_mla_dir)
