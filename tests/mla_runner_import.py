"""``TinyMLARunner`` for the tests: from ``kvbridge.demo.mla_runner`` once the ``demo/``
package is mapped (pyproject), else loaded from demo/mla_runner.py by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

try:
    from kvbridge.demo.mla_runner import TinyMLARunner
except ImportError:  # demo/ not mapped to kvbridge.demo yet
    _path = Path(__file__).resolve().parent.parent / "demo" / "mla_runner.py"
    _spec = importlib.util.spec_from_file_location("kvbridge_demo_mla_runner", _path)
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _mod
    _spec.loader.exec_module(_mod)
    TinyMLARunner = _mod.TinyMLARunner

__all__ = ["TinyMLARunner"]
