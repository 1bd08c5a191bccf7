"""Test hooks in every process of a test's SGLang server (``sglang_servers.start_pair(probe=True)``
puts this folder and the repository root on the server's ``PYTHONPATH``):

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
