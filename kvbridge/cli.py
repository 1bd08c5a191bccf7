"""The ``kvbridge`` command line: ``bench``, ``demo``."""

from __future__ import annotations

import argparse
import json
import logging
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


def _print_table(title: str, result: dict, keys: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k in keys:
        if k in result:
            v = result[k]
            table.add_row(k, f"{v:,}" if isinstance(v, int) else str(v))
    Console().print(table)


def _bench_layout(args: argparse.Namespace) -> int:
    from kvbridge.layout.bench import bench_layout

    res = _run_with_status(
        "kvbridge bench layout",
        lambda say: bench_layout(plan_tokens=args.plan_tokens, repack_tokens=args.repack_tokens, reps=args.reps or 5,
                                 progress=say),
        args.json,
    )
    if args.json:
        print(json.dumps(res))
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
    from kvbridge.common.bench_transfer import bench_transfer

    res = _run_with_status(
        "kvbridge bench transfer",
        lambda say: bench_transfer(tokens=args.tokens, small_tokens=args.small_tokens, reps=args.reps or 3, progress=say),
        args.json,
    )
    if args.json:
        print(json.dumps(res))
        return 0
    _print_table(
        f"transfer: {res['geometry']['tokens']} tokens, SGLang page 64 -> TensorRT-LLM block 32, Mooncake TCP loopback",
        res,
        ["bytes", "handoff_gbps", "raw_gbps", "ratio", "scattered_gbps", "scattered_ratio", "small_handoff_ms",
         "small_raw_ms", "small_overhead_ms", "plan", "segments", "scattered_segments", "chunks"],
    )
    return 0


BENCHES = {"layout": _bench_layout, "transfer": _bench_transfer}


def _bench_all(args: argparse.Namespace) -> int:
    rc = 0
    for name, fn in BENCHES.items():
        rc |= fn(args)
    return rc


def _demo(args: argparse.Namespace) -> int:
    """Until the mixed-engine demo lands, the demo is the layout benchmark."""
    _console().print("[bold]kvbridge demo[/]: layout benchmark (the SGLang -> TensorRT-LLM demo arrives with the plugins)")
    return _bench_layout(args)


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
        b.add_argument("--reps", type=int, default=None, help="repetitions (default: 5 layout, 3 transfer)")
        b.add_argument("--tokens", type=int, default=8192, help="transfer: request size in tokens")
        b.add_argument("--small-tokens", type=int, default=128, help="transfer: the small request")
        b.set_defaults(func=_bench_all if name == "all" else BENCHES[name])

    demo = sub.add_parser("demo", help="run the main demo and print its report")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=_demo, plan_tokens=32768, repack_tokens=4096, reps=5)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvbridge`` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
