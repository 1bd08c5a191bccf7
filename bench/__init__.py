"""Benchmarks, reports and charts: everything ``kvbridge bench ...`` and ``kvbridge report``
run. A serving process never imports this package; the core (``kvbridge.layout``,
``kvbridge.common``, ``kvbridge.adapters``) imports nothing from it.

| module | job |
|---|---|
| ``layout`` | ``bench layout``: plan compile time, repack bandwidth against a plain copy |
| ``transfer`` | ``bench transfer`` and ``bench link``: a handoff against a raw Mooncake write, two processes |
| ``load`` | ``bench load``: many concurrent handoffs, each checksummed |
| ``sglang`` | ``bench sglang``: kvbridge's SGLang backend beside SGLang's Mooncake backend (parent) |
| ``sglang_worker`` | its worker processes (SGLang pools and managers, transfer counting) |
| ``vllm`` | ``bench vllm``: vLLM's MooncakeConnector anchor, or why it cannot run here |
| ``route`` | ``bench route``: a load through ``kvbridge route`` with a prefill killed part-way |
| ``plots`` | PNG charts of those results and the cost model's break-even chart |
| ``cli`` | the ``bench`` and ``report`` commands: arguments, runs, printed tables (``kvbridge.cli`` adds them) |
| ``console`` | status lines, progress bars and tables on the terminal |
| ``report``, ``report_faults`` | ``kvbridge report``: the reliability report's sections (``docs/reliability.md``) |
"""
