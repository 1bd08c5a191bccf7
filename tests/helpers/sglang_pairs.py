"""The session's SGLang server pairs and tiny models: one process-wide registry.

The fixtures built on it live in conftest files: ``tiny_llama_dir`` and ``tiny_mla_dir``
in tests/conftest.py (every area uses them), ``sglang_pair_factory``, ``mooncake_pair``
and ``mooncake_mla_pair`` in tests/sglang/conftest.py. Tests elsewhere (tests/vllm) call
``get_pair`` directly. Everything shares one registry (``sglang_servers.shared_pair`` and
``tiny_model_dir``), so each configuration's servers start once per test session. Logs go
to a temporary folder that is removed at exit unless KVBRIDGE_KEEP_SGLANG_LOGS=1 (then it
also holds timings.json: start and request seconds per pair).

- ``tiny_model_dir(kind)``: the tiny GQA Llama ("llama"), the tiny DeepSeek-V3-style MLA
  model ("mla") or another Llama for the same tokenizer ("llama_other"), built once per
  session (no download).
- ``get_pair(backend, model_dir=None, **start_pair_kwargs) -> Pair``: the same
  configuration returns the same running pair; a pair that a failure test killed is
  restarted on the next call; at most one pair lives at a time.
- ``write_timings()``: timings.json (called when the session's pair fixture ends).

A new backend gets its own fixture in one line (in tests/sglang/conftest.py)::

    @pytest.fixture
    def kvbridge_pair(sglang_pair_factory):
        return sglang_pair_factory("kvbridge", **KVBRIDGE)
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

from tests.helpers import sglang_servers
from tests.helpers import tiny_models

# the kvbridge plugin in both servers, with /metrics (kvbridge's own series included) and
# SGLang's own pool and allocator observed (``Pair.probe``): the options every plain kvbridge
# pair of the tiny Llama shares, so they share one running pair
KVBRIDGE = {"extra_env": {"SGLANG_PLUGINS": "kvbridge"}, "extra_args": ["--enable-metrics"], "probe": True}

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


# Process-wide, like the pair registry.
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


def write_timings() -> Path:
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
