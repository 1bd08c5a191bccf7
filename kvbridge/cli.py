"""The ``kvbridge`` command line. Every command:

- ``kvbridge demo``: a request's KV moved between engines (``--prefill``/``--decode``:
  sglang, trtllm, vllm; ``--reverse``; ``--router``: the deployment behind ``route``), checked
  against transformers.
- ``kvbridge bench layout|transfer|link|sglang|load|vllm|all``: the benchmarks
  (``kvbridge.bench``); ``all`` runs every one of them, ``--plot DIR`` draws charts.
- ``kvbridge bench route``: a load through ``kvbridge route`` with a prefill killed part-way
  (not part of ``all``).
- ``kvbridge bench layerwise``: first-token time with the KV sent layer by layer during the
  prefill vs whole after it (not part of ``all``).
- ``kvbridge report``: regenerate the reliability report (``docs/reliability.md``).
- ``kvbridge plan``: is moving a request's KV worth it, and sending it layer by layer
  during the prefill (the cost model).
- ``kvbridge announce``: a router's handoff announcement to a TensorRT-LLM server.
- ``kvbridge doctor``: what this machine imposes on kvbridge's copies (THP policy, CPUs,
  governor, threads, load).
- ``kvbridge route``: the OpenAI-compatible front of a mixed disaggregated deployment
  (``--check``: probe it and exit).

The ``bench`` and ``report`` commands (arguments, runs, tables) and all benchmark,
report and chart code live in ``kvbridge.bench`` (``kvbridge.bench.cli``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvbridge.bench.console import console, run_with_status

__all__ = ["main"]


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

    from kvbridge.demo.secret import ensure_secret

    ensure_secret()  # every server the demo starts shares it: control frames sealed, as deployed
    if args.router:
        return _demo_router(args)

    def _term(signum, frame):  # so that the server's process group is killed on the way out
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, _term)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C even where SIGINT was ignored
    con = console()
    kw = dict(reverse=args.reverse, prompt_len=args.prompt_len, max_new=args.max_new, link=args.link, model_dir=args.model_dir, model=args.model,
              trtllm_version=args.trtllm_version, prefill=args.prefill, decode=args.decode,
              extra_prompt_lens=tuple(int(x) for x in args.also.split(",") if x) if args.also else ())
    try:
        if args.json and not con.is_terminal:
            report = _run_demo(kw, None)
        else:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
            from rich.table import Column

            with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}", table_column=Column(min_width=12, no_wrap=True)),
                          BarColumn(bar_width=10), TimeElapsedColumn(),
                          TextColumn("{task.fields[detail]}", table_column=Column(overflow="fold")), console=con) as p:
                report = _run_demo(kw, _DemoProgress(p))
    except (DemoError, ServerError, TimeoutError, ValueError) as e:
        con.print(f"[bold red]kvbridge demo failed:[/] {e}", markup=True, highlight=False)
        if args.json:
            print(json.dumps({"match": False, "error": str(e)}))
        return 1
    except KeyboardInterrupt:
        con.print("kvbridge demo: interrupted (servers stopped)")
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
    from kvbridge.common.costmodel import (MODEL_PRESETS, ModelGeometry, break_even_prompt_len, decide, decide_layerwise,
                                           load_link)

    if args.config:
        model = ModelGeometry.from_hf_config(args.config, dtype_bytes=args.kv_dtype_bytes)
    else:
        model = MODEL_PRESETS[args.preset]
    link = load_link(args.link)
    kw = dict(output_len=args.output_len, prefill_tps=args.prefill_tps, decode_prefill_tps=args.decode_prefill_tps,
              queue_s=args.queue_ms / 1e3, tp=args.tp)
    try:
        d = decide(model, link, args.prompt_len, held_tokens=args.held_tokens, **kw)
        lw = decide_layerwise(model, link, args.prompt_len, held_tokens=args.held_tokens, prefill_s=d.prefill_s,
                              margin=args.layerwise_margin)
    except ValueError as e:
        raise SystemExit(f"kvbridge plan: {e}") from None
    out = d.as_dict()
    out["layerwise"] = lw.as_dict()
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
    for name, v in [("layer-wise: first token, whole send", lw.ttft_whole_s),
                    ("layer-wise: first token, layer by layer", lw.ttft_layerwise_s),
                    ("layer-wise: bound, max(prefill, transfer) + one layer", lw.bound_layerwise_s),
                    ("layer-wise: one layer's send", lw.one_layer_s),
                    ("layer-wise: per-layer cost added", lw.overhead_layerwise_s)]:
        t.add_row(name, f"{v * 1e3:.2f}")
    Console().print(t)
    print(d.verdict)
    print(f"layer-wise sends ({lw.layers} layers, {lw.segments_layerwise} segments vs {lw.segments_whole} whole): "
          + lw.reason)
    if "break_even_prompt_len" in out:
        print(f"break-even prompt length on this link: {out['break_even_prompt_len']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for ``kvbridge``."""
    p = argparse.ArgumentParser(prog="kvbridge", description="Move KV caches between LLM serving engines.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    from kvbridge.bench.cli import add_commands

    add_commands(sub)

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
    plan.add_argument("--layerwise-margin", type=float, default=0.1,
                      help="layer-wise sends when they bring the first token earlier by more than this fraction")
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
                      help="the mixed deployment behind `kvbridge route`, driven by an OpenAI client (kvbridge.demo.route_demo)")
    demo.set_defaults(func=_demo)

    doc = sub.add_parser("doctor", help="what this machine imposes on kvbridge's copies (THP, CPUs, governor, threads, load)")
    doc.add_argument("--json", action="store_true", help="print one JSON object")
    doc.add_argument("--metrics", nargs="+", default=(), metavar="URL",
                     help="serving processes' /metrics to read too: blocks they hold quarantined (kvbridge_quarantined_blocks)")
    doc.add_argument("--recalibrate", action="store_true",
                     help="measure the gather's copy again (one thread against all) and replace this host's cached figures")
    doc.set_defaults(func=_doctor)

    ann = sub.add_parser("announce", help="tell a TensorRT-LLM server which handoff its next request with a prompt plays")
    ann.add_argument("--bus", required=True, help="the server's kvbridge bus, tcp://host:bus_port")
    ann.add_argument("--prompt-ids", required=True, help="the prompt's token ids, comma-separated")
    ann.add_argument("--handle", required=True,
                     help='the handle as JSON, e.g. \'{"op": "recv", "room": 42, "prefill": "tcp://10.0.0.1:18500"}\'')
    ann.add_argument("--ttl", type=float, default=60.0, help="seconds the server keeps it (default 60)")
    ann.set_defaults(func=_announce)
    _add_route_command(sub)
    return p


def _doctor(args: argparse.Namespace) -> int:
    """``kvbridge doctor``: the machine's settings that bound kvbridge's copies, one line,
    what one copy of every byte costs here (measured: about a second), then one line per
    setting or floor that does bound them here. Changes nothing; exit status 0."""
    from kvbridge.bench.machine import copy_floor, machine_line, machine_notes

    notes = machine_notes()
    floor = copy_floor()
    notes["copy_floor"] = floor
    notes["warnings"] = notes["warnings"] + floor["warnings"]
    notes["quarantine"] = _quarantine(args.metrics, notes["warnings"])
    notes["gather_copy"] = _gather_copy(args.recalibrate)
    notes["native"] = _native(notes["warnings"])
    if args.json:
        print(json.dumps(notes))
        return 0
    print(machine_line(notes))
    print(f"one copy of every byte (one thread): {floor['cpu_s_per_gib']} CPU s per GiB ({floor['gbps']} GB/s), "
          f"{floor['small_ms']} ms for {floor['small_bytes'] / 2**20:g} MiB")
    print(f"copy rate past the cache, {floor['share_bytes'] >> 20} MiB: one thread {floor['one_thread_gbps']} GB/s, "
          f"all {floor['threads']} thread(s) {floor['all_threads_gbps']} GB/s (one thread's share {floor['one_thread_share']})")
    gc = notes["gather_copy"]
    cal = gc["calibration"]
    print(f"gather copy, one thread {cal['one_gbps']} GB/s, {cal['threads']} thread(s) {cal['all_gbps']} GB/s "
          f"(calibrated {cal.get('measured', '?')} at load {cal.get('loadavg', '?')}, other processes "
          f"{cal.get('others_cpu', '?')} of the CPU time"
          f"{', cached in ' + cal['cached'] if cal.get('cached') else ''}"
          f"{'; not cached: ' + cal['not_cached'] if cal.get('not_cached') else ''}; "
          "`kvbridge doctor --recalibrate` measures again):")
    for proto, c in gc["choice"].items():
        print(f"  {proto}: {c['threads']} thread{'s' if c['threads'] > 1 else ''} ({c['reason']})")
    nat = notes["native"]
    print(f"C kernels: tile copy {'built' if nat['tile_copy'] else 'NOT built'}; content digest loop "
          f"{'built' if nat['digest_loop'] else 'NOT built'} (xxhash {nat['xxhash']})")
    for w in notes["warnings"]:
        print(f"note: {w}")
    if not notes["warnings"]:
        print("nothing here bounds kvbridge's copies")
    return 0


def _gather_copy(refresh: bool = False) -> dict:
    """For ``kvbridge doctor``: this host's copy calibration (measured once and cached, or
    again with ``refresh``) and the gather's threads it gives each transport when
    ``gather_threads`` is 0."""
    from kvbridge.common.copy_choice import CPU_FREE_PROTOCOLS, choose, host_calibration

    cal = host_calibration(refresh=refresh)
    return {"calibration": cal,
            "choice": {p: vars(choose(p, 0, lambda: cal)) for p in ("tcp", *CPU_FREE_PROTOCOLS)}}


def _native(warnings: list) -> dict:
    """For ``kvbridge doctor``: whether the package's C kernels were built and load (the
    gather's tile copy, the content digest's loop around xxhash's functions), with a
    warning for each that is missing."""
    import xxhash

    from kvbridge.layout.digest import xxh3_functions
    from kvbridge.layout.tiles import native_tile_copy

    out = {"tile_copy": native_tile_copy(), "digest_loop": xxh3_functions() is not None, "xxhash": xxhash.VERSION}
    if not out["tile_copy"]:
        warnings.append("kvbridge.layout._tilecopy is not built (no C compiler at install?): the gather and "
                        "scatter use torch's copies, slower on one thread")
    if not out["digest_loop"]:
        warnings.append("the content digest's C loop is not there (kvbridge.layout._runhash not built, or the "
                        "xxhash package's library does not give XXH3's functions): with integrity on, digests "
                        "hash in Python, several times slower")
    return out


def _quarantine(urls, warnings: list) -> dict:
    """For ``kvbridge doctor --metrics``: what each URL's process holds quarantined (or why
    it could not be read), with a warning per process that holds any."""
    import urllib.request

    from kvbridge.common.metrics import quarantined_in

    out = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                held = quarantined_in(resp.read().decode())
        except (OSError, ValueError) as e:
            out[url] = {"error": f"{type(e).__name__}: {e}"}
            warnings.append(f"{url}: not read ({type(e).__name__}: {e})")
            continue
        out[url] = {"quarantined": held}
        for q in held:
            warnings.append(f"{url}: {q['blocks']} block(s) quarantined ({q['role']}, reason {q['reason']}) until "
                            f"{q['peer']} is proven quiet: it acknowledges, or its process ends")
    return out


def _announce(args: argparse.Namespace) -> int:
    """``kvbridge announce``: what a router does before sending a request to a TensorRT-LLM
    server with the kvbridge connector (``kvbridge.adapters.trtllm.announce``)."""
    from kvbridge.adapters.trtllm import AnnounceError, Handle, HandleError, announce

    try:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        handle = Handle.from_dict(json.loads(args.handle))
        announce(args.bus, ids, handle, ttl_s=args.ttl)
    except (ValueError, HandleError, AnnounceError) as e:
        console().print(f"kvbridge announce: {e}", markup=False, highlight=False)
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
        serve(cfg, host=args.host, port=args.port, print_fn=lambda m: console().print(m, markup=False))
    except ConfigError as e:
        console().print(f"kvbridge route: {e}", markup=False, highlight=False)
        return 2
    return 0


def _demo_router(args: argparse.Namespace) -> int:
    """``kvbridge demo --router``: the mixed deployment behind ``kvbridge route`` (kvbridge.demo.route_demo)."""
    from kvbridge.demo.route_demo import format_router_demo, run_router_demo

    res = run_with_status("kvbridge demo --router", lambda say: run_router_demo(
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
