"""Session-wide test setup: the tiny models every area uses and the end-of-run summaries.

Area fixtures live in the area's own conftest.py (tests/sglang: the SGLang server pairs);
shared code lives in tests/helpers.
"""
import os
import sys
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
# secure defaults in the tests too: every server and peer process a test starts inherits
# this session's secret (a routable bind refuses to start without one)
from kvbridge.demo.secret import ensure_secret  # noqa: E402

ensure_secret()
# every room a decode pulls in the tests is verified: its content digest compared with the
# sender's (KVBRIDGE_INTEGRITY, read by every plugin; settings.handoff_config reads no environment: off there)
os.environ.setdefault("KVBRIDGE_INTEGRITY", "on")


def pytest_sessionstart(session):
    """Under ``make test`` (``KVBRIDGE_REQUIRE_VLLM=1``) the vLLM venv is part of the
    install: a missing or broken one stops the run naming the fix, instead of its tests
    skipping."""
    if os.environ.get("KVBRIDGE_REQUIRE_VLLM") != "1":
        return
    import subprocess

    from tests.helpers.vllm_env import vllm_python

    py = vllm_python()
    probe = "import importlib.util, xxhash, kvbridge; assert importlib.util.find_spec('vllm'), 'no vllm'"
    out = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=120) if py else None
    if out is None or out.returncode != 0:
        why = "absent" if out is None else out.stderr.strip().splitlines()[-1:]
        pytest.exit(f"the vLLM venv is required here and is {why}: run `make vllm-venv` (or set KVBRIDGE_VLLM_PYTHON)",
                    returncode=3)


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """The tiny GQA Llama (built once per session, no download)."""
    from tests.helpers.sglang_pairs import tiny_model_dir

    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_mla_dir() -> Path:
    """The tiny DeepSeek-V3-style MLA model (built once per session, no download)."""
    from tests.helpers.sglang_pairs import tiny_model_dir

    return tiny_model_dir("mla")


@pytest.fixture(scope="session")
def sglang_pools():
    """SGLang 0.5.23's real pool classes (MHATokenToKVPool, MLATokenToKVPool), on CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    return MHATokenToKVPool, MLATokenToKVPool


def pytest_terminal_summary(terminalreporter):
    """Print the cross-engine compatibility matrix when its tests ran."""
    mod = sys.modules.get("tests.layout.test_compat_matrix")
    if mod is not None and mod.MATRIX:
        terminalreporter.section("cross-engine compatibility matrix (every cell byte-exact)")
        for line in mod.format_matrix():
            terminalreporter.write_line(line)
    faults = sys.modules.get("tests.faults.test_faults")
    if faults is not None and faults.RESULTS:
        terminalreporter.section("fault matrix (each side: the state it reports, seconds from fault to terminal / bound)")
        for line in faults.format_matrix():
            terminalreporter.write_line(line)
        if os.environ.get("KVBRIDGE_RELIABILITY_DIR"):  # else the rows went to a temporary folder
            terminalreporter.write_line(f"rows written to {os.path.join(faults.OUT, 'faults.json')}")
