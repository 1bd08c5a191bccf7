"""Fault hooks in every process of a vLLM server started for a test: with
``KVBRIDGE_TEST_HOOKS_DIR`` set, ``kvhelpers.install_test_hooks`` runs at interpreter start
(this folder and the repository root are on that server's ``PYTHONPATH``), so the
kvbridge transport its connector builds obeys the parent's ``FaultSwitch``."""

import os

if os.environ.get("KVBRIDGE_TEST_HOOKS_DIR"):
    from tests.helpers.kvhelpers import install_test_hooks

    install_test_hooks({"dir": os.environ["KVBRIDGE_TEST_HOOKS_DIR"]})
