"""kvbridge's tests, one folder per area (run one with ``pytest tests/AREA``):

- ``layout``: the layout core (plans, repack, the cross-engine compatibility matrix);
- ``core``: handoff state machines, transport, protocol, control channel, bootstrap
  discovery, settings, cost model;
- ``sglang``: the SGLang adapter, with real pools, scheduler ranks and server pairs;
- ``trtllm``: the TensorRT-LLM plugin against the stand-in and its contract;
- ``vllm``: the vLLM connector and layout against real vLLM (its own venv);
- ``mixed``: cross-engine handoffs end to end, and the demo's models and runners;
- ``route``: the router (unit, and in front of real servers);
- ``hostile``: hostile peers and what the Mooncake engine exposes;
- ``faults``: the fault matrix (kills, link cuts, two hosts in network namespaces);
- ``bench``: the benchmarks' smoke runs and the package's rooms.

Shared code is in ``tests.helpers``; fixtures live in conftest.py files (session-wide
ones in tests/conftest.py, an area's own in its folder).
"""
