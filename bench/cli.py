"""The ``kvbridge bench ...`` and ``kvbridge report`` commands: their arguments
(``add_commands``, called by ``kvbridge.cli.build_parser``) and what each runs and prints.

Suites: ``layout``, ``transfer``, ``link``, ``sglang``, ``load``, ``vllm`` (``BENCHES``),
``all`` (each of those in turn; ``--plot DIR``: the charts), and ``route`` and ``layerwise``
(apart: they start several servers).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from .console import console, print_table, run_with_bar, run_with_status

__all__ = ["BENCHES", "add_commands"]


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


def _warn(res: dict) -> None:
    """The machine's line and each warning of a result, on stderr (so ``--json`` stays one object)."""
    import sys

    from kvbridge.bench.machine import machine_line

    if res.get("machine"):
        print(machine_line(res["machine"]), file=sys.stderr)
    for w in res.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)


def _bench_layout(args: argparse.Namespace) -> int:
    from kvbridge.bench.layout import bench_layout

    res = run_with_status(
        "kvbridge bench layout",
        lambda say: bench_layout(plan_tokens=args.plan_tokens, repack_tokens=args.repack_tokens, reps=args.reps or 5,
                                 progress=say),
        args.json,
    )
    _warn(res)
    if args.json:
        _print_json(args, "layout", res)
        return 0
    print_table(
        "layout: SGLang page 64 (NHD) -> TensorRT-LLM block 32 (HND), 32 layers x 8 heads x 128, bf16",
        res,
        ["plan_ms_32k", "plan_kind", "segments_direct", "segments_staged", "segments_staged_contiguous_dst",
         "repack_bytes", "repack_path", "repack_gbps", "memcpy_one_thread_gbps", "memcpy_gbps", "repack_split_gbps",
         "memcpy_split_gbps", "gather_best_ratio_spread", "repack_ratio",
         "repack_ratio_spread", "repack_all_threads_ratio_spread", "one_thread_copy_share_spread",
         "repack_rows_ratio_spread", "repack_cold_ratio_spread", "warmup_reps", "threads"],
    )
    print(res["plan_reason"])
    d = res["digest"]
    print(f"content digest ({d['hash']}), GB/s:",
          ", ".join(f"{k} {v['median']} [{v['p10']}-{v['p90']}]" for k, v in d["gbps"].items()))
    v = res["vllm_cpu"]
    print_table(f"vLLM CPU caches per ISA: {v['geometry']}", v, [k for k in v if k.endswith(("_gbps", "_spread"))]
                + ["amx_to_vec_plan", "amx_to_vec_bytes_verified"])
    if res.get("cuda"):
        print("cuda:", res["cuda"])
    return 0


def _bench_transfer(args: argparse.Namespace) -> int:
    from kvbridge.bench.transfer import DATA_FIRST_GAP_S, bench_transfer, transfer_steps

    sweep = _lengths(args.sweep, "--sweep")
    reps = args.reps or 7  # loopback TCP here varies up to 2x between writes: medians of 7
    res = run_with_bar(
        "kvbridge bench transfer",
        lambda say: bench_transfer(tokens=args.tokens, small_tokens=args.small_tokens, reps=reps, sweep=sweep,
                                   progress=say),
        args.json, transfer_steps(reps, sweep),
    )
    _stash(args, "transfer", res)
    _warn(res)
    if args.plot and args.suite != "all":  # `bench all` draws them once every suite ran
        res["plots"] = _plot_suites(args.plot, res, None)
    if args.json:
        _print_json(args, "transfer", res)
        return 0
    print_table(
        f"transfer: {res['geometry']['tokens']} tokens, SGLang page 64 -> TensorRT-LLM block 32, Mooncake TCP loopback",
        res,
        ["bytes", "handoff_gbps", "raw_gbps", "ratio", "one_batch_raw_gbps", "one_batch_ratio", "scattered_gbps",
         "scattered_ratio", "same_layout_gbps", "same_layout_ratio", "small_handoff_ms",
         "small_raw_ms", "small_overhead_ms", "small_overhead_paired_ms", "plan", "segments", "scattered_segments",
         "chunks", "model_error_max"],
    )
    if res.get("best_raw_shape"):
        sh = res["best_raw_shape"]
        print(f"raw baseline: the fastest of {len(res['raw_shapes'])} write shapes, {sh['segment_mib']:g} MiB segments, "
              f"depth {sh['depth']}: " + ", ".join(f"{r['segment_mib']:g} MiB/{r['depth']} {r['gbps']}"
                                                   for r in res["raw_shapes"]) + " GB/s")
    if res["cpu_s_per_gib"]:
        print("CPU s per GiB (both peers): " + ", ".join(f"{k} {v}" for k, v in res["cpu_s_per_gib"].items()))
    if res.get("copy_floor"):
        f = res["copy_floor"]
        print(f"one copy of every byte here (one thread): {f['cpu_s_per_gib']} CPU s per GiB ({f['gbps']} GB/s); "
              f"{f['small_ms']} ms for the small request's {f['small_bytes'] / 2**20:g} MiB")
    if res.get("small_timeline_ms"):
        print(f"small request ({res['small_tokens']} tokens), its critical path in ms (median [p10-p90]): "
              + ", ".join(f"{k} {v['median']} [{v['p10']}-{v['p90']}]" for k, v in res["small_timeline_ms"].items())
              + f"; the raw write {res['small_raw_ms']}")
    for o, v in res.get("small_orders", {}).items():
        d = v["overhead_ms"]
        print(f"small request, {o}: overhead {d['median']} ms [{d['p10']}-{d['p90']}] over {d['n']} pairs "
              f"(handoff {v['handoff_ms']['median']}, raw {v['raw_ms']['median']}): {v['what']}; its path (medians): "
              + ", ".join(f"{k} {t['median']}" for k, t in v.get("timeline_ms", {}).items()))
    if res.get("control_floor_ms"):
        f = res["control_floor_ms"]
        print(f"control floor: a bare ZMQ request and reply between the peers after {DATA_FIRST_GAP_S * 1e3:g} ms idle, "
              f"{f['median']} ms [{f['p10']}-{f['p90']}] over {f['n']} (two of the small request's hops, no work)")
    if res.get("auth_cost"):
        a = res["auth_cost"]
        print(f"auth: small request sealed {a['sealed_ms']['median']} ms [{a['sealed_ms']['p10']}-{a['sealed_ms']['p90']}], "
              f"without a secret {a['plain_ms']['median']} ms [{a['plain_ms']['p10']}-{a['plain_ms']['p90']}]; "
              f"ratio {a['ratio']['median']} [{a['ratio']['p10']}-{a['ratio']['p90']}] over {a['ratio']['n']} pairs")
    for c in res.get("integrity_cost", []):
        print(f"integrity: {c['tokens']}-token request verified {c['verified_ms']['median']} ms "
              f"[{c['verified_ms']['p10']}-{c['verified_ms']['p90']}], unverified {c['unverified_ms']['median']} ms "
              f"[{c['unverified_ms']['p10']}-{c['unverified_ms']['p90']}]; ratio {c['ratio']['median']} "
              f"[{c['ratio']['p10']}-{c['ratio']['p90']}] over {c['ratio']['n']} pairs")
    if res.get("copy_threads_cost"):
        c = res["copy_threads_cost"]
        print(f"copy threads: {c['tokens']}-token handoff, gather on all threads {c['all_threads_ms']['median']} ms "
              f"[{c['all_threads_ms']['p10']}-{c['all_threads_ms']['p90']}], on one {c['one_thread_ms']['median']} ms "
              f"[{c['one_thread_ms']['p10']}-{c['one_thread_ms']['p90']}]; ratio {c['ratio']['median']} "
              f"[{c['ratio']['p10']}-{c['ratio']['p90']}] over {c['ratio']['n']} pairs")
    for p in res["model_check"]:
        print(f"  {p['tokens']:>6} tokens: measured {p['measured_ms']:.1f} ms, predicted {p['predicted_ms']:.1f} ms, error {p['error']:.1%}")
    for f in res.get("plots", []):
        print(f"chart: {f}")
    return 0


def _bench_link(args: argparse.Namespace) -> int:
    from kvbridge.bench.transfer import bench_transfer, transfer_steps

    res = run_with_bar("kvbridge bench link", lambda say: bench_transfer(reps=args.reps or 3, link_only=True, progress=say),
                        args.json, transfer_steps(args.reps or 3, link_only=True))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res["link"], f, indent=1)
    if args.json:
        _print_json(args, "link", res)
    else:
        lk = res["link"]
        print_table("link: Mooncake TCP on 127.0.0.1 (measured)", lk, [k for k in lk if k != "samples"])
        for k, v in lk.get("samples", {}).items():
            print(f"  {k}: median {v['median']} [p10 {v['p10']}, p90 {v['p90']}] over {v['n']} pairs")
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
    res = run_with_bar(
        "kvbridge bench sglang",
        lambda say: bench_sglang(tokens=args.tokens, tp_tokens=args.tp_tokens, layers=args.layers, reps=reps,
                                 mc_tcp_max_queued=args.mc_tcp_max_queued, sweep=sweep, sweep_layers=sweep_layers,
                                 progress=say, nixl_tls=args.nixl_tls),
        args.json, sglang_steps(reps, sweep),
    )
    _stash(args, "sglang", res)
    if args.plot and args.suite != "all":
        res["plots"] = _plot_suites(args.plot, None, res)
    if args.json:
        _print_json(args, "sglang", res)
        return 0
    g = res["geometry"]
    print_table(
        f"sglang: kvbridge vs SGLang's Mooncake and NIXL backends, {g['tokens']} tokens (TP 2->1: {g['tp_tokens']}), "
        f"{g['layers']} layers x {g['heads']} heads x {g['head_dim']}, page {g['page_size']}, Mooncake TCP loopback",
        res,
        ["kvbridge_gbps", "sglang_mooncake_gbps", "ratio", "sglang_nixl_gbps", "ratio_vs_nixl",
         "kvbridge_segments_same_tp", "sglang_segments_same_tp",
         "kvbridge_segments_tp2to1", "sglang_segments_tp2to1", "segments_ratio_tp2to1", "kvbridge_plan_tp2to1",
         "kvbridge_gbps_tp2to1", "sglang_mooncake_gbps_tp2to1", "ratio_tp2to1", "verified"],
    )
    for p in res["per_length"]:
        print(f"  {p['tokens']:>6} tokens: kvbridge {p['kvbridge_gbps']} GB/s, SGLang mooncake {p['sglang_mooncake_gbps']} GB/s"
              + (f", SGLang NIXL {p['sglang_nixl_gbps']} GB/s" if "sglang_nixl_gbps" in p else ""))
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
                           lk["repack_bytes_per_s"], source="measured in this run",
                           repack_overlap=lk.get("repack_overlap", LinkProfile.repack_overlap))
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
                      TimeElapsedColumn(), console=console()) as bar:
            task = bar.add_task("load", total=args.count, detail="starting peers")
            res = bench_load(**kw, progress=lambda done, total, out: bar.update(task, completed=done,
                                                                                 detail=f"{out} in flight"))
    res["when"] = _stamp()
    if args.markdown:
        write_section(args.markdown, "load", "Load: concurrent handoffs", render_load(res), res)
    if args.json:
        _print_json(args, "load", res)
    else:
        print_table(f"load: {args.count} handoffs, {args.inflight} in flight, {args.min_tokens}..{args.max_tokens} tokens, "
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


def _load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=500, help="load: handoffs")
    p.add_argument("--inflight", type=int, default=32, help="load: handoffs outstanding at once")
    p.add_argument("--min-tokens", type=int, default=16, help="load: shortest prompt")
    p.add_argument("--max-tokens", type=int, default=8192, help="load: longest prompt (pools are sized for inflight of these)")
    p.add_argument("--seed", type=int, default=0, help="load: seed of the prompt lengths and the KV bytes")


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

    res = run_with_status("kvbridge bench route", lambda say: bench_route(
        requests=args.requests, concurrency=args.concurrency, kill_after=args.kill_after, max_new=args.max_new,
        seed=args.seed, trtllm=not args.no_trtllm, progress=say), args.json)
    print(json.dumps(res) if args.json else format_bench(res))
    return 0 if res["lost"] == 0 and res["wrong"] == 0 else 1


def _add_layerwise_bench(bsub) -> None:
    b = bsub.add_parser("layerwise", help="first-token time with KV sent layer by layer during the prefill vs whole "
                                          "after it (not part of `bench all`: it starts three or four servers)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--plot", metavar="DIR", help="write a PNG chart into DIR")
    b.add_argument("--prompt-lens", default="1024,4096", help="prompt lengths (comma-separated; default 1024,4096)")
    b.add_argument("--reps", type=int, default=3, help="measured pairs (whole, layer-wise) per length (default 3)")
    b.add_argument("--warmup", type=int, default=1, help="unmeasured pairs first, per length (default 1)")
    b.add_argument("--max-new", type=int, default=4, help="tokens the decode generates (recorded, compared)")
    b.add_argument("--layers", type=int, default=None, help="decoder layers of the model (default 8)")
    b.add_argument("--head-dim", type=int, default=None, help="head size: sets the KV bytes per token (default 256)")
    b.add_argument("--kv-heads", type=int, default=None, help="KV heads = attention heads (default 2)")
    b.add_argument("--attention-heads", type=int, default=None,
                   help="query heads, a multiple of the KV heads (default: as many): the prefill's attention work "
                        "grows with them, the KV bytes do not")
    b.add_argument("--hidden", type=int, default=None, help="residual stream width (default 32; intermediate: twice it)")
    b.add_argument("--engine", default="trtllm", choices=("trtllm", "sglang"),
                   help="trtllm: the stand-in (three servers); sglang: SGLang's real servers (four)")
    b.add_argument("--model-dir", help="write the model here and keep it (default: a temporary folder)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--link-rate", metavar="MBIT|auto", default=None,
                   help="the KV crosses a loopback shaped with tc to MBIT Mbit/s (root; the host's loopback, for the "
                        "run only), or 'auto': per length, the rate at which moving its KV takes as long as its "
                        "prefill (default: unshaped)")
    b.set_defaults(func=_bench_layerwise)


def _bench_layerwise(args: argparse.Namespace) -> int:
    from kvbridge.bench.layerwise import bench_layerwise, layerwise_steps

    lens = _lengths(args.prompt_lens, "--prompt-lens")
    geo = {k: v for k, v in (("num_hidden_layers", args.layers), ("head_dim", args.head_dim),
                             ("num_key_value_heads", args.kv_heads),
                             ("num_attention_heads", args.attention_heads or args.kv_heads),
                             ("hidden_size", args.hidden), ("intermediate_size", args.hidden and 2 * args.hidden))
           if v is not None}
    from kvbridge.bench.link import LinkShapingError

    rate = args.link_rate
    if rate is not None and rate != "auto":
        try:
            rate = float(rate)
        except ValueError:
            raise SystemExit(f"kvbridge bench layerwise: --link-rate {rate!r}: Mbit/s (a number) or 'auto'") from None
    try:
        res = run_with_bar("kvbridge bench layerwise", lambda say: bench_layerwise(
            lens, reps=args.reps, warmup=args.warmup, max_new=args.max_new, geometry=geo, engine=args.engine,
            model_dir=args.model_dir, seed=args.seed, link_mbit=rate, progress=say), args.json,
            layerwise_steps(lens, args.reps, args.warmup))
    except (ValueError, LinkShapingError) as e:
        raise SystemExit(f"kvbridge bench layerwise: {e}") from None
    if args.plot:
        from kvbridge.bench.plots import plot_layerwise

        res["plots"] = plot_layerwise(res, args.plot)
    if args.json:
        print(json.dumps(res))
        return 0 if all(r["outputs_equal"] for r in res["lengths"]) else 1
    g = res["geometry"]
    print(f"layerwise: {res['engine']}; {g['num_hidden_layers']} layers, {g['num_key_value_heads']} KV heads of "
          f"{g['head_dim']}, {g['token_bytes']:,} B/token; {res['reps']} interleaved pairs after {res['warmup']} warm-up")
    print(f"  link: {res['link']}")
    for r in res["lengths"]:
        tw, tl, q = r["ttft_whole_ms"], r["ttft_layerwise_ms"], r["ttft_ratio"]
        print(f"  {r['prompt_len']:>6} tokens ({r['bytes'] / 2**20:.1f} MiB): prefill {r['prefill_ms']:.1f} ms, "
              f"transfer {r['transfer_ms']:.1f} ms, decode step {r['decode_step_ms']:.1f} ms"
              + (f", link {r['link_rate_mbit']:.0f} Mbit/s" if "link_rate_mbit" in r else ""))
        print(f"         ttft_whole_ms {tw['median']:.1f} [{tw['p10']:.1f}-{tw['p90']:.1f}], ttft_layerwise_ms "
              f"{tl['median']:.1f} [{tl['p10']:.1f}-{tl['p90']:.1f}], ttft_ratio {q['median']:.3f} "
              f"[{q['p10']:.3f}-{q['p90']:.3f}]")
        print(f"         bound: layer-wise {r['bound_layerwise_ms']:.1f} ms vs whole {r['bound_whole_ms']:.1f} ms "
              f"(ratio {r['bound_ratio']:.3f}); layer-wise / its bound {r['layerwise_over_bound']:.3f}; outputs "
              f"{'equal' if r['outputs_equal'] else 'DIFFER'} (transformers' generate())")
    for w in res["warnings"]:
        print(f"warning: {w}")
    for f in res.get("plots", []):
        print(f"chart: {f}")
    return 0 if all(r["outputs_equal"] for r in res["lengths"]) else 1


def add_commands(sub) -> None:
    """Add ``bench`` (every suite, ``all`` and ``route``) and ``report`` to the ``kvbridge``
    command's subparsers."""
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
        b.add_argument("--nixl-tls", default="tcp",
                       help="sglang: UCX_TLS for SGLang's NIXL backend (default tcp, as the Mooncake backends here; "
                            "'' lets UCX choose, shared memory on one host)")
        _load_args(b)
        b.add_argument("--markdown", metavar="FILE", help="load: also write its section of the reliability report into FILE")
        b.set_defaults(func=_bench_all if name == "all" else BENCHES[name])
    _add_route_bench(bsub)
    _add_layerwise_bench(bsub)

    rep = sub.add_parser("report", help="regenerate the reliability report (load figures, fault matrix) in one go")
    rep.add_argument("--out", default="docs/reliability.md", help="markdown file (sections replaced between markers)")
    rep.add_argument("--only", help="comma-separated section names (default: all registered)")
    _load_args(rep)
    rep.set_defaults(func=_report)
