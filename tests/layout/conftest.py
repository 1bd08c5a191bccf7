import warnings

import pytest


@pytest.fixture(scope="session")
def sglang_pools():
    """SGLang 0.5.23's real pool classes (MHATokenToKVPool, MLATokenToKVPool), on CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    return MHATokenToKVPool, MLATokenToKVPool
