import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def sglang_pools():
    """SGLang 0.5.23's real pool classes (MHATokenToKVPool, MLATokenToKVPool), on CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    return MHATokenToKVPool, MLATokenToKVPool


def pytest_terminal_summary(terminalreporter):
    """Print the cross-engine compatibility matrix when its tests ran."""
    mod = sys.modules.get("test_compat_matrix")
    if mod is not None and mod.MATRIX:
        terminalreporter.section("cross-engine compatibility matrix (every cell byte-exact)")
        for line in mod.format_matrix():
            terminalreporter.write_line(line)
    faults = sys.modules.get("test_faults")
    if faults is not None and faults.RESULTS:
        terminalreporter.section("fault matrix (each side: the state it reports, seconds from fault to terminal / bound)")
        for line in faults.format_matrix():
            terminalreporter.write_line(line)
        if os.environ.get("KVBRIDGE_RELIABILITY_DIR"):  # else the rows went to a temporary folder
            terminalreporter.write_line(f"rows written to {os.path.join(faults.OUT, 'faults.json')}")
