"""The ``kvbridge`` command line. Every command:

- ``kvbridge demo``: a request's KV moved between engines (``--prefill``/``--decode``:
  sglang, trtllm, vllm; ``--reverse``; ``--router``: the deployment behind ``route``), checked
  against transformers.
- ``kvbridge bench layout|transfer|link|sglang|load|vllm|all``: the benchmarks
  (``kvbridge.bench``); ``all`` runs every one of them, ``--plot DIR`` draws charts.
- ``kvbridge bench route``: a load through ``kvbridge route`` with a prefill killed part-way
  (not part of ``all``).
- ``kvbridge report``: regenerate the reliability report (``docs/reliability.md``).
- ``kvbridge plan``: is moving a request's KV worth it (the cost model).
- ``kvbridge announce``: a router's handoff announcement to a TensorRT-LLM server.
- ``kvbridge route``: the OpenAI-compatible front of a mixed disaggregated deployment
  (``--check``: probe it and exit).

Benchmark, report and chart code lives in ``kvbridge.bench``; this module parses
arguments and prints results."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Callable

__all__ = ["main"]


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _run_with_status(title: str, fn: Callable[[Callable[[str], None]], dict], quiet: bool) -> dict:
    """Run ``fn(progress)`` under a live status line on stderr (none with --json)."""
    if quiet:
        return fn(lambda _m: None)
    console = _console()
    with console.status(title) as status:
        return fn(lambda m: status.update(f"{title}: {m}"))


def _run_with_bar(title: str, fn: Callable[[Callable[[str], None]], dict], quiet: bool, total: int) -> dict:
    """Run ``fn(progress)`` under a rich progress bar on stderr (none with --json): each
    ``progress(message)`` call starts the next of ``total`` steps."""
    if quiet:
        return fn(lambda _m: None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[step]}"), console=_console()) as bar:
        task = bar.add_task(title, total=total, step="")
        calls = [0]

        def say(msg: str) -> None:
            bar.update(task, completed=min(calls[0], total), step=msg)
            calls[0] += 1

        res = fn(say)
        bar.update(task, completed=total, step="done")
    return res


def _stash(args: argparse.Namespace, name: str, res: dict) -> None:
    """Keep a suite's result for ``bench all`` (its charts combine several suites)."""
    if not hasattr(args, "results"):
        args.results = {}
    args.results[name] = res


def _print_json(args: argparse.Namespace, name: str, res: dict) -> None:
    """A suite's ``--json`` output: one JSON object on stdout; under ``bench all`` kept
    instead, and printed with the others as one object keyed by suite."""
    _stash(args, name, res)
    if not getattr(args, "all_json", False):
        print(json.dumps(res))


def _print_table(title: str, result: dict, keys: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k in keys:
        if k in result:
            v = result[k]
            table.add_row(k, f"{v:,}" if isinstance(v, int) else f"{v:.4g}" if isinstance(v, float) else str(v))
    Console().print(table)


def _bench_layout(args: argparse.Namespace) -> int:
    from kvbridge.bench.layout import bench_layout

    res = _run_with_status(
        "kvbridge bench layout",
        lambda say: bench_layout(plan_tokens=args.plan_tokens, repack_tokens=args.repack_tokens, reps=args.reps or 5,
                                 progress=say),
        args.json,
    )
    if args.json:
        _print_json(args, "layout", res)
        return 0
    _print_table(
        "layout: SGLang page 64 (NHD) -> TensorRT-LLM block 32 (HND), 32 layers x 8 heads x 128, bf16",
        res,
        ["plan_ms_32k", "plan_kind", "segments_direct", "segments_staged", "segments_staged_contiguous_dst",
         "repack_bytes", "repack_gbps", "memcpy_gbps", "repack_ratio", "threads"],
    )
    print(res["plan_reason"])
    if res.get("cuda"):
        print("cuda:", res["cuda"])
    return 0


def _bench_transfer(args: argparse.Namespace) -> int:
    from kvbridge.bench.transfer import bench_transfer, transfer_steps

    sweep = _lengths(args.sweep, "--sweep")
    reps = args.reps or 7  # loopback TCP here varies up to 2x between writes: medians of 7
    res = _run_with_bar(
        "kvbridge bench transfer",
        lambda say: bench_transfer(tokens=args.tokens, small_tokens=args.small_tokens, reps=reps, sweep=sweep,
                                   progress=say),
        args.json, transfer_steps(reps, sweep),
    )
    _stash(args, "transfer", res)
    if args.plot and args.suite != "all":  # `bench all` draws them once every suite ran
        res["plots"] = _plot_suites(args.plot, res, None)
    if args.json:
        _print_json(args, "transfer", res)
        return 0
    _print_table(
        f"transfer: {res['geometry']['tokens']} tokens, SGLang page 64 -> TensorRT-LLM block 32, Mooncake TCP loopback",
        res,
        ["bytes", "handoff_gbps", "raw_gbps", "ratio", "scattered_gbps", "scattered_ratio", "same_layout_gbps",
         "same_layout_ratio", "small_handoff_ms",
         "small_raw_ms", "small_overhead_ms", "small_overhead_paired_ms", "plan", "segments", "scattered_segments",
         "chunks", "model_error_max"],
    )
    if res["cpu_s_per_gib"]:
        print("CPU s per GiB (both peers): " + ", ".join(f"{k} {v}" for k, v in res["cpu_s_per_gib"].items()))
    for p in res["model_check"]:
        print(f"  {p['tokens']:>6} tokens: measured {p['measured_ms']:.1f} ms, predicted {p['predicted_ms']:.1f} ms, error {p['error']:.1%}")
    for f in res.get("plots", []):
        print(f"chart: {f}")
    return 0


def _bench_link(args: argparse.Namespace) -> int:
    from kvbridge.bench.transfer import bench_transfer, transfer_steps

    res = _run_with_bar("kvbridge bench link", lambda say: bench_transfer(reps=args.reps or 3, link_only=True, progress=say),
                        args.json, transfer_steps(args.reps or 3, link_only=True))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res["link"], f, indent=1)
    if args.json:
        _print_json(args, "link", res)
    else:
        _print_table("link: Mooncake TCP on 127.0.0.1 (measured)", res["link"], list(res["link"]))
        if args.out:
            print(f"written to {args.out}; use it with `kvbridge plan --link {args.out}`")
    return 0


def _bench_sglang(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [m for m in ("sglang", "mooncake") if importlib.util.find_spec(m) is None]
    if missing:
        logging.getLogger("kvbridge.cli").error("bench sglang needs %s installed", " and ".join(missing))
        return 2
    from kvbridge.bench.sglang import bench_sglang, sglang_steps

    reps = args.reps or 3
    sweep, sweep_layers = (), None
    if args.sglang_sweep:
        sweep = _lengths(args.sglang_sweep, "--sglang-sweep")
    if args.suite == "all" and args.plot:  # the GB/s chart puts SGLang's backend beside the transfer sweep,
        from kvbridge.bench.transfer import GEOM  # with the transfer suite's bytes per token

        sweep, sweep_layers = sweep or _lengths(args.sweep, "--sweep"), GEOM["layers"]
    res = _run_with_bar(
        "kvbridge bench sglang",
        lambda say: bench_sglang(tokens=args.tokens, tp_tokens=args.tp_tokens, layers=args.layers, reps=reps,
                                 mc_tcp_max_queued=args.mc_tcp_max_queued, sweep=sweep, sweep_layers=sweep_layers,
                                 progress=say),
        args.json, sglang_steps(reps, sweep),
    )
    _stash(args, "sglang", res)
    if args.plot and args.suite != "all":
        res["plots"] = _plot_suites(args.plot, None, res)
    if args.json:
        _print_json(args, "sglang", res)
        return 0
    g = res["geometry"]
    _print_table(
        f"sglang: kvbridge vs SGLang's Mooncake backend, {g['tokens']} tokens (TP 2->1: {g['tp_tokens']}), "
        f"{g['layers']} layers x {g['heads']} heads x {g['head_dim']}, page {g['page_size']}, Mooncake TCP loopback",
        res,
        ["kvbridge_gbps", "sglang_mooncake_gbps", "ratio", "kvbridge_segments_same_tp", "sglang_segments_same_tp",
         "kvbridge_segments_tp2to1", "sglang_segments_tp2to1", "segments_ratio_tp2to1", "kvbridge_plan_tp2to1",
         "kvbridge_gbps_tp2to1", "sglang_mooncake_gbps_tp2to1", "ratio_tp2to1", "verified"],
    )
    for p in res["per_length"]:
        print(f"  {p['tokens']:>6} tokens: kvbridge {p['kvbridge_gbps']} GB/s, SGLang mooncake {p['sglang_mooncake_gbps']} GB/s")
    for f in res.get("plots", []):
        print(f"chart: {f}")
    return 0 if all(res["verified"].values()) else 1


def _lengths(text: str, flag: str) -> tuple[int, ...]:
    """Comma-separated prompt lengths."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"kvbridge: {flag} takes comma-separated token counts, got {text!r}") from None
    if not out or min(out) <= 0:
        raise SystemExit(f"kvbridge: {flag} needs positive token counts, got {text!r}")
    return out


def _plot_suites(out_dir: str, transfer: dict | None, sglang: dict | None) -> list[str]:
    """The charts the results at hand allow: GB/s and time breakdown per prompt length
    (transfer, with SGLang's backend beside it when the sglang suite ran a sweep), and the
    break-even chart from the link measured in this run."""
    from kvbridge.common.costmodel import MODEL_PRESETS, LinkProfile
    from kvbridge.bench.plots import plot_break_even, plot_sglang, plot_transfer

    files = []
    if transfer is not None:
        files += plot_transfer(transfer, out_dir, sglang=sglang)
        lk = transfer["link"]
        link = LinkProfile("Mooncake TCP, 127.0.0.1", lk["bandwidth_bytes_per_s"], lk["per_segment_s"], lk["setup_s"],
                           lk["repack_bytes_per_s"], source="measured in this run")
        files.append(plot_break_even(MODEL_PRESETS["llama3-8b"], link, {}, os.path.join(out_dir, "break_even_llama3-8b.png"),
                                      None))
    elif sglang is not None and sglang.get("per_length"):
        files += plot_sglang(sglang, out_dir)
    return files


def _bench_load(args: argparse.Namespace) -> int:
    from kvbridge.bench.load import bench_load
    from kvbridge.bench.report import _stamp, render_load, write_section

    kw = dict(count=args.count, inflight=args.inflight, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
              seed=args.seed)
    if args.json:
        res = bench_load(**kw)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("kvbridge bench load"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[detail]}"),
                      TimeElapsedColumn(), console=_console()) as bar:
            task = bar.add_task("load", total=args.count, detail="starting peers")
            res = bench_load(**kw, progress=lambda done, total, out: bar.update(task, completed=done,
                                                                                 detail=f"{out} in flight"))
    res["when"] = _stamp()
    if args.markdown:
        write_section(args.markdown, "load", "Load: concurrent handoffs", render_load(res), res)
    if args.json:
        _print_json(args, "load", res)
    else:
        _print_table(f"load: {args.count} handoffs, {args.inflight} in flight, {args.min_tokens}..{args.max_tokens} tokens, "
                     "Mooncake TCP loopback", res,
                     ["handoffs", "succeeded", "lost", "corrupted", "failed", "max_inflight", "mean_inflight", "p50_ms",
                      "p99_ms", "max_ms", "throughput_handoffs_s", "throughput_gbps", "peak_rss_mb_prefill",
                      "peak_rss_mb_decode", "blocks_leaked", "failure_reasons"])
        if args.markdown:
            print(f"section 'load' written to {args.markdown}")
    ok = res["lost"] == 0 and res["corrupted"] == 0 and not any(res["blocks_leaked"].values())
    return 0 if ok else 1


def _report(args: argparse.Namespace) -> int:
    from kvbridge.bench.report import generate

    opts = dict(count=args.count, inflight=args.inflight, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                seed=args.seed)
    names = generate(args.out, only=args.only.split(",") if args.only else None, options=opts)
    print(f"{args.out}: wrote sections {', '.join(names)}")
    return 0


def _bench_vllm(args: argparse.Namespace) -> int:
    """The same-engine anchor for vLLM (kvbridge.bench.vllm)."""
    from kvbridge.bench.vllm import bench_vllm

    res = bench_vllm()
    if args.json:
        _print_json(args, "vllm", res)
    else:
        print(f"vllm: {res['anchor']}: not run: {res['reason']}")
    return 0


BENCHES = {"layout": _bench_layout, "transfer": _bench_transfer, "link": _bench_link, "sglang": _bench_sglang,
           "load": _bench_load, "vllm": _bench_vllm}


def _bench_all(args: argparse.Namespace) -> int:
    """Every suite in turn; ``--json``: one object keyed by suite (plus ``plots``)."""
    rc = 0
    args.all_json = args.json
    for name, fn in BENCHES.items():
        rc |= fn(args)
    res = getattr(args, "results", {})
    files = _plot_suites(args.plot, res.get("transfer"), res.get("sglang")) if args.plot else []
    if args.json:
        print(json.dumps({**res, "plots": files}))
    else:
        for f in files:
            print(f"chart: {f}")
    return rc


class _DemoProgress:
    """The demo's steps as a rich progress display on stderr."""

    def __init__(self, progress):
        from kvbridge.demo.run import STEPS

        self.p = progress
        self.tasks = {s: progress.add_task(s, total=1, start=False, detail="") for s in STEPS}

    def start(self, step: str, detail: str = "") -> None:
        t = self.tasks[step]
        self.p.reset(t, total=1, start=True, detail=detail)

    def done(self, step: str, detail: str = "") -> None:
        self.p.update(self.tasks[step], completed=1, detail=detail)


def _demo_report(r: dict) -> None:
    """The demo's report, for a human, on stdout."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    ok = "[bold green]MATCH[/]" if r["match"] else "[bold red]MISMATCH[/]"
    con.rule(f"kvbridge demo: {r['prefill_engine']} prefill -> {r['decode_engine']} decode  {ok}")
    m = r["model"]
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    cm = r["cost_model"]
    rows = [
        ("prefill", r["prefill_detail"]),
        ("decode", r["decode_detail"]),
        ("transport", r["transport"]),
        ("model", f"{m['name']}: {m['attention']}, {m['layers']} layers, {m['heads']} heads; KV per token and layer: "
                  f"{m['kv']}, {m['dtype']} ({m['dir']})"),
        ("prompt ids", f"{r['prompt_len']} tokens: {r['prompt_ids']}"),
        ("generated ids", str(r["generated_ids"])),
        ("transformers", str(r["reference_ids"])),
        ("match", f"{ok}; first token: prefill {r['first_token']['prefill']}, received by decode "
                  f"{r['first_token']['decode_received']}, reference {r['first_token']['reference']}"),
        ("first-step logits", (f"max |diff| vs transformers {r['first_logits_max_abs_diff']:.2e}: "
                               if r["first_logits_max_abs_diff"] is not None else "") + r["first_logits_of"]),
        ("real servers", ", ".join(r["real_servers"]) or "none"),
        ("moved", f"{r['bytes']:,} B (expected {r['bytes_expected']:,}) in {r['segments']} segment(s)"),
        ("plan", f"{r['plan']}: {r['plan_reason']} [{r['plan_reason_source']}]"),
        ("time", f"{r['handoff_s'] * 1e3:.1f} ms, {r['gbps']:.4f} GB/s; {r['handoff_s_measures']}"
                 + (f"; on the wire {r['wire_gbps']:.3f} GB/s" if r.get("wire_gbps") else "")),
        ("cost model", f"{'MOVE' if cm['move'] else 'RECOMPUTE'}: predicted handoff {cm['predicted_handoff_s'] * 1e3:.2f} ms "
                       f"(measured {cm['measured_handoff_s'] * 1e3:.1f} ms); first token after "
                       f"{cm['disaggregated_ttft_s'] * 1e3:.2f} ms moved vs {cm['local_ttft_s'] * 1e3:.2f} ms recomputed"),
        ("", cm["verdict"]),
        ("", f"link {cm['link']}; {cm['assumptions']}"),
    ]
    for c in r.get("checks", []):
        rows.append((f"also {c['prompt_len']} tokens", f"{'match' if c['match'] else 'MISMATCH'}, {c['bytes']:,} B, "
                                                       f"{c['segments']} segment(s), {c['plan']}"))
    rows.append(("server log", f"{r['server']['log']} (up in {r['server']['ready_s']:.1f}s); demo {r['seconds']:.1f}s"))
    for k, v in rows:
        t.add_row(k, v)
    con.print(t)


def _demo(args: argparse.Namespace) -> int:
    """SGLang prefill -> TensorRT-LLM decode (``--reverse``: the other way; ``--prefill`` /
    ``--decode`` name the engines, vLLM among them) through the plugins, checked against
    transformers; a report (``--json``: one JSON object)."""
    import signal

    from kvbridge.demo.run import DemoError
    from kvbridge.demo.sglang_server import ServerError

    if args.router:
        return _demo_router(args)

    def _term(signum, frame):  # so that the server's process group is killed on the way out
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, _term)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C even where SIGINT was ignored
    console = _console()
    kw = dict(reverse=args.reverse, prompt_len=args.prompt_len, max_new=args.max_new, link=args.link, model_dir=args.model_dir, model=args.model,
              trtllm_version=args.trtllm_version, prefill=args.prefill, decode=args.decode,
              extra_prompt_lens=tuple(int(x) for x in args.also.split(",") if x) if args.also else ())
    try:
        if args.json and not console.is_terminal:
            report = _run_demo(kw, None)
        else:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
            from rich.table import Column

            with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}", table_column=Column(min_width=12, no_wrap=True)),
                          BarColumn(bar_width=10), TimeElapsedColumn(),
                          TextColumn("{task.fields[detail]}", table_column=Column(overflow="fold")), console=console) as p:
                report = _run_demo(kw, _DemoProgress(p))
    except (DemoError, ServerError, TimeoutError, ValueError) as e:
        console.print(f"[bold red]kvbridge demo failed:[/] {e}", markup=True, highlight=False)
        if args.json:
            print(json.dumps({"match": False, "error": str(e)}))
        return 1
    except KeyboardInterrupt:
        console.print("kvbridge demo: interrupted (servers stopped)")
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
    if args.json:
        print(json.dumps(report))
    else:
        _demo_report(report)
    return 0 if report["match"] else 1


def _run_demo(kw: dict, progress) -> dict:
    from kvbridge.demo import run_demo

    return run_demo(progress=progress, **kw)


def _plan(args: argparse.Namespace) -> int:
    from kvbridge.common.costmodel import MODEL_PRESETS, ModelGeometry, break_even_prompt_len, decide, load_link

    if args.config:
        model = ModelGeometry.from_hf_config(args.config, dtype_bytes=args.kv_dtype_bytes)
    else:
        model = MODEL_PRESETS[args.preset]
    link = load_link(args.link)
    kw = dict(output_len=args.output_len, prefill_tps=args.prefill_tps, decode_prefill_tps=args.decode_prefill_tps,
              queue_s=args.queue_ms / 1e3, tp=args.tp)
    try:
        d = decide(model, link, args.prompt_len, held_tokens=args.held_tokens, **kw)
    except ValueError as e:
        raise SystemExit(f"kvbridge plan: {e}") from None
    out = d.as_dict()
    if args.break_even or args.plot:
        out["break_even_prompt_len"] = break_even_prompt_len(model, link, **kw)
    if args.plot:
        from kvbridge.bench.plots import plot_break_even

        out["plot"] = plot_break_even(model, link, kw, args.plot, out["break_even_prompt_len"])
    if args.json:
        print(json.dumps(out))
        return 0
    from rich.console import Console
    from rich.table import Table

    h = d.handoff
    t = Table(title=f"{model.name} ({model.source}), prompt {args.prompt_len} tokens, link {link.describe()}")
    t.add_column("part")
    t.add_column("ms", justify="right")
    for name, v in [("KV bytes", None), ("handoff: setup", h.setup_s), ("handoff: wire", h.wire_s),
                    ("handoff: segments", h.segments_s), ("handoff: repack not hidden", h.repack_s),
                    ("handoff total", h.total_s), ("queue for prefill", d.queue_s), ("prefill on prefill worker", d.prefill_s),
                    ("first token, disaggregated", d.disaggregated_ttft_s), ("first token, recompute on decode", d.local_ttft_s)]:
        t.add_row(name, f"{h.bytes:,} B" if v is None else f"{v * 1e3:.2f}")
    Console().print(t)
    print(d.verdict)
    if "break_even_prompt_len" in out:
        print(f"break-even prompt length on this link: {out['break_even_prompt_len']}")
    return 0


def _load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=500, help="load: handoffs")
    p.add_argument("--inflight", type=int, default=32, help="load: handoffs outstanding at once")
    p.add_argument("--min-tokens", type=int, default=16, help="load: shortest prompt")
    p.add_argument("--max-tokens", type=int, default=8192, help="load: longest prompt (pools are sized for inflight of these)")
    p.add_argument("--seed", type=int, default=0, help="load: seed of the prompt lengths and the KV bytes")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for ``kvbridge``."""
    p = argparse.ArgumentParser(prog="kvbridge", description="Move KV caches between LLM serving engines.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks (ratios measured in one run)")
    bsub = bench.add_subparsers(dest="suite", required=True)
    for name in list(BENCHES) + ["all"]:
        b = bsub.add_parser(name, help=f"{name} benchmark")
        b.add_argument("--json", action="store_true", help="print one JSON object")
        b.add_argument("--plan-tokens", type=int, default=32768)
        b.add_argument("--repack-tokens", type=int, default=4096)
        b.add_argument("--reps", type=int, default=None, help="repetitions (default: 5 layout, 7 transfer, 3 link and sglang)")
        b.add_argument("--tokens", type=int, default=8192, help="transfer: request size in tokens")
        b.add_argument("--small-tokens", type=int, default=128, help="transfer: the small request")
        b.add_argument("--sweep", default="1024,2048,4096,8192,16384",
                       help="transfer: prompt lengths for the cost-model check (comma-separated)")
        b.add_argument("--plot", metavar="DIR",
                       help="write PNG charts into DIR (all: GB/s per prompt length for kvbridge, raw Mooncake and "
                            "SGLang's backend; time breakdown; break-even)")
        b.add_argument("--sglang-sweep", default="",
                       help="sglang: prompt lengths to measure both backends at (comma-separated; `all --plot`: --sweep)")
        b.add_argument("--out", help="link: write the measured link figures here (for `kvbridge plan --link FILE`)")
        b.add_argument("--tp-tokens", type=int, default=1024, help="sglang: request size of the TP 2 -> 1 case")
        b.add_argument("--layers", type=int, default=8, help="sglang: layers of the KV pools")
        b.add_argument("--mc-tcp-max-queued", type=int, default=None,
                       help="sglang: MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER for the worker processes (default: Mooncake's)")
        _load_args(b)
        b.add_argument("--markdown", metavar="FILE", help="load: also write its section of the reliability report into FILE")
        b.set_defaults(func=_bench_all if name == "all" else BENCHES[name])
    _add_route_bench(bsub)

    rep = sub.add_parser("report", help="regenerate the reliability report (load figures, fault matrix) in one go")
    rep.add_argument("--out", default="docs/reliability.md", help="markdown file (sections replaced between markers)")
    rep.add_argument("--only", help="comma-separated section names (default: all registered)")
    _load_args(rep)
    rep.set_defaults(func=_report)

    from kvbridge.common.costmodel import LINK_PRESETS, MODEL_PRESETS

    plan = sub.add_parser("plan", help="is moving a request's KV worth it? (the cost model)")
    src = plan.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="llama3-8b", help="built-in model geometry")
    src.add_argument("--config", help="a Hugging Face config.json (or its folder)")
    plan.add_argument("--kv-dtype-bytes", type=int, default=2, help="with --config: bytes per KV element")
    plan.add_argument("--prompt-len", type=int, required=True)
    plan.add_argument("--output-len", type=int, default=256)
    plan.add_argument("--link", default="tcp", help=f"a preset ({', '.join(LINK_PRESETS)}) or a file from `kvbridge bench link --out`")
    plan.add_argument("--prefill-tps", type=float, help="prefill tokens/s on the prefill worker (default: from FLOPs)")
    plan.add_argument("--decode-prefill-tps", type=float, help="prefill tokens/s on the decode worker (default: half)")
    plan.add_argument("--queue-ms", type=float, default=0.0, help="wait for the prefill worker")
    plan.add_argument("--held-tokens", type=int, default=0,
                      help="prompt tokens the decode worker already holds (prefix cache): neither moved nor recomputed")
    plan.add_argument("--tp", type=int, default=1, help="GPUs per worker")
    plan.add_argument("--break-even", action="store_true", help="also find the prompt length from which moving wins")
    plan.add_argument("--plot", help="write a PNG of first-token time against prompt length")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_plan)

    demo = sub.add_parser("demo", help="a request's KV moved between engines (default SGLang prefill -> TensorRT-LLM "
                                       "decode; --prefill/--decode name them: sglang, trtllm, vllm), checked, with a report")
    demo.add_argument("--json", action="store_true", help="print one JSON object (progress on stderr when it is a terminal)")
    demo.add_argument("--reverse", action="store_true", help="TensorRT-LLM prefill -> SGLang decode instead")
    demo.add_argument("--prefill", choices=("sglang", "trtllm", "vllm"), default=None,
                      help="the prefill's engine (vllm and sglang run their real servers; default: sglang)")
    demo.add_argument("--decode", choices=("sglang", "trtllm", "vllm"), default=None,
                      help="the decode's engine (default: trtllm, or what pairs with --prefill)")
    demo.add_argument("--prompt-len", type=int, default=70, help="prompt tokens (default 70: three 32-token blocks)")
    demo.add_argument("--max-new", type=int, default=32, help="tokens to generate")
    demo.add_argument("--also", default="", help="more prompt lengths through the same servers, e.g. 7,300")
    demo.add_argument("--link", default="tcp", help="the cost model's link: a preset or a `kvbridge bench link --out` file")
    demo.add_argument("--model", choices=("llama", "mla", "llama-hd32"), default=None,
                      help="the tiny model: llama (GQA, default), mla (DeepSeek-V3-style multi-head latent attention) "
                           "or llama-hd32 (GQA with head_dim 32: the default with vLLM, whose CPU backend serves no "
                           "head_dim 16)")
    demo.add_argument("--model-dir", help="a tiny model folder to use instead (default: built into ~/.cache/kvbridge/demo)")
    demo.add_argument("--trtllm-version", choices=("1.2", "main"), default="1.2",
                      help="the TensorRT-LLM version the executor stand-in models (default 1.2, PyPI's newest line)")
    demo.add_argument("--router", action="store_true",
                      help="the mixed deployment behind `kvbridge route`, driven by an OpenAI client (kvbridge.route.demo)")
    demo.set_defaults(func=_demo)

    ann = sub.add_parser("announce", help="tell a TensorRT-LLM server which handoff its next request with a prompt plays")
    ann.add_argument("--bus", required=True, help="the server's kvbridge bus, tcp://host:bus_port")
    ann.add_argument("--prompt-ids", required=True, help="the prompt's token ids, comma-separated")
    ann.add_argument("--handle", required=True,
                     help='the handle as JSON, e.g. \'{"op": "recv", "room": 42, "prefill": "tcp://10.0.0.1:18500"}\'')
    ann.add_argument("--ttl", type=float, default=60.0, help="seconds the server keeps it (default 60)")
    ann.set_defaults(func=_announce)
    _add_route_command(sub)
    return p


def _announce(args: argparse.Namespace) -> int:
    """``kvbridge announce``: what a router does before sending a request to a TensorRT-LLM
    server with the kvbridge connector (``kvbridge.adapters.trtllm.announce``)."""
    from kvbridge.adapters.trtllm import AnnounceError, Handle, HandleError, announce

    try:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        handle = Handle.from_dict(json.loads(args.handle))
        announce(args.bus, ids, handle, ttl_s=args.ttl)
    except (ValueError, HandleError, AnnounceError) as e:
        _console().print(f"kvbridge announce: {e}", markup=False, highlight=False)
        return 2
    return 0


def _add_route_command(sub) -> None:
    r = sub.add_parser("route", help="OpenAI-compatible front for a mixed disaggregated deployment (route.yaml)")
    r.add_argument("--config", required=True, help="the route.yaml (servers, links, deadlines, retry policy)")
    r.add_argument("--check", action="store_true", help="validate the file, probe every server, and exit (0: all good)")
    r.add_argument("--json", action="store_true", help="with --check: print the report as one JSON object")
    r.add_argument("--host", help="listen address (default: the file's listen.host)")
    r.add_argument("--port", type=int, help="listen port (default: the file's listen.port)")
    r.set_defaults(func=_route)


def _route(args: argparse.Namespace) -> int:
    """``kvbridge route``: serve (kvbridge.route.app.serve), or ``--check`` the deployment."""
    import asyncio

    from kvbridge.route import ConfigError, load_config

    try:
        cfg = load_config(args.config)
        if args.check:
            from kvbridge.route.check import check, format_report

            rep = asyncio.run(check(cfg))
            print(json.dumps(rep) if args.json else format_report(rep))
            return 0 if rep["ok"] else 1
        from kvbridge.route.app import serve

        logging.getLogger("kvbridge").setLevel(logging.INFO)
        serve(cfg, host=args.host, port=args.port, print_fn=lambda m: _console().print(m, markup=False))
    except ConfigError as e:
        _console().print(f"kvbridge route: {e}", markup=False, highlight=False)
        return 2
    return 0


def _add_route_bench(bsub) -> None:
    b = bsub.add_parser("route", help="route benchmark: a load through `kvbridge route`, a prefill killed part-way "
                                      "(not part of `bench all`: it starts five servers)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--requests", type=int, default=200, help="requests sent (default 200)")
    b.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    b.add_argument("--kill-after", type=float, default=0.3, help="kill a prefill after this fraction of the requests")
    b.add_argument("--max-new", type=int, default=16, help="tokens generated per request")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-trtllm", action="store_true", help="SGLang servers only (no TensorRT-LLM decode stand-in)")
    b.set_defaults(func=_bench_route)


def _bench_route(args: argparse.Namespace) -> int:
    from kvbridge.bench.route import bench_route, format_bench

    res = _run_with_status("kvbridge bench route", lambda say: bench_route(
        requests=args.requests, concurrency=args.concurrency, kill_after=args.kill_after, max_new=args.max_new,
        seed=args.seed, trtllm=not args.no_trtllm, progress=say), args.json)
    print(json.dumps(res) if args.json else format_bench(res))
    return 0 if res["lost"] == 0 and res["wrong"] == 0 else 1


def _demo_router(args: argparse.Namespace) -> int:
    """``kvbridge demo --router``: the mixed deployment behind ``kvbridge route`` (kvbridge.route.demo)."""
    from kvbridge.route.demo import format_router_demo, run_router_demo

    res = _run_with_status("kvbridge demo --router", lambda say: run_router_demo(
        model_dir=args.model_dir, prompt_len=args.prompt_len, max_new=args.max_new, trtllm_version=args.trtllm_version,
        progress=say), args.json)
    print(json.dumps(res) if args.json else format_router_demo(res))
    return 0 if res["match"] else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvbridge`` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
