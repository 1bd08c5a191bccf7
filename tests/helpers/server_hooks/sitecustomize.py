"""Test hooks in every process of a test's SGLang or vLLM server (this folder and the
repository root are on that server's ``PYTHONPATH``: ``sglang_servers.start_pair(probe=True)``,
tests/vllm/test_vllm_release.py):

- ``KVBRIDGE_TEST_SGLANG_PROBE``: ``sglang_probe.install`` patches SGLang's scheduler when it
  loads, to report SGLang's own pool and allocator (tests/helpers/sglang_probe.py);
- ``KVBRIDGE_TEST_HOOKS_DIR``: ``kvhelpers.install_test_hooks``, so the kvbridge transport
  the plugin builds obeys the parent's ``FaultSwitch``."""

import os

if os.environ.get("KVBRIDGE_TEST_SGLANG_PROBE"):
    from tests.helpers.sglang_probe import install

    install(os.environ["KVBRIDGE_TEST_SGLANG_PROBE"])
if os.environ.get("KVBRIDGE_TEST_HOOKS_DIR"):
    from tests.helpers.kvhelpers import install_test_hooks

    install_test_hooks({"dir": os.environ["KVBRIDGE_TEST_HOOKS_DIR"]})
