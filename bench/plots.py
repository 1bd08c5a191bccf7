"""PNG charts of benchmark results (matplotlib, headless).

Every chart says what was measured and where: the geometry, the pair of layouts, the
link (Mooncake TCP over 127.0.0.1 here) and the host's CPU count, since on a small CPU
host the sender's repack and both peers' TCP copies share the same cores. This module
takes plain result dicts; it imports no engine (``kvbridge bench all`` hands it the SGLang
suite's results).
"""

from __future__ import annotations

import os
import textwrap

__all__ = ["plot_break_even", "plot_transfer", "plot_sglang", "plot_layerwise"]

_MARK = dict(markersize=5, linewidth=1.6)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _where() -> str:
    return f"measured on one host, {os.cpu_count()} CPU cores, Mooncake TCP over 127.0.0.1 (no NIC)"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _length_axis(ax, lens: list[int]) -> None:
    """Log-2 prompt-length axis with one labelled tick per measured length."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(lens, [f"{n:,}" for n in lens])
    ax.minorticks_off()
    ax.set_xlabel("prompt length (tokens)")


def _footer(fig, lines: list[str], width: int = 150) -> float:
    """Grey notes under the axes, wrapped to the figure; returns the figure fraction they take."""
    wrapped = [w for line in lines for w in textwrap.wrap(line, width, subsequent_indent="  ")]
    fig.text(0.01, 0.01, "\n".join(wrapped), ha="left", va="bottom", fontsize=7, color="dimgrey")
    return 0.02 + 0.026 * len(wrapped)


def _gbps_chart(path: str, series: list[tuple], title: str, notes: list[str]) -> str:
    """``series``: (label, style, lengths, GB/s medians, [min, max] per length or None)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.2, 5.8))
    lens = sorted({n for _, _, xs, _, _ in series for n in xs})
    top = 0.0
    for k, (label, style, xs, ys, ranges) in enumerate(series):
        pts = [(x, y, r) for x, y, r in zip(xs, ys, ranges or [None] * len(xs)) if y is not None]
        if not pts:
            continue
        nudge = 2 ** ((k - (len(series) - 1) / 2) * 0.03)  # series side by side, so their bars do not overlap
        line, = ax.plot([p[0] * nudge for p in pts], [p[1] for p in pts], style, label=label, **_MARK)
        top = max(top, max(p[1] for p in pts))
        spread = [p for p in pts if p[2]]
        if spread:  # min..max over the runs
            ax.errorbar([p[0] * nudge for p in spread], [p[1] for p in spread],
                        yerr=[[p[1] - p[2][0] for p in spread], [p[2][1] - p[1] for p in spread]],
                        fmt="none", ecolor=line.get_color(), elinewidth=1, capsize=3, alpha=0.7)
            top = max(top, max(p[2][1] for p in spread))
    _length_axis(ax, lens)
    ax.set_ylim(0, top * 1.1 if top else 1)
    ax.set_ylabel("effective bandwidth (GB/s = 1e9 B/s)\npayload bytes / wall time of the whole transfer")
    ax.set_title(title, fontsize=10.5)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, _footer(fig, notes), 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_transfer(res: dict, out_dir: str, sglang: dict | None = None) -> list[str]:
    """From ``bench_transfer`` output: effective GB/s against prompt length (raw Mooncake,
    kvbridge, and, when ``sglang`` (``bench_sglang`` output) has ``per_length`` figures,
    SGLang's own Mooncake backend and kvbridge's SGLang backend on the same SGLang pools),
    and the handoff time breakdown per prompt length. Returns the files written."""
    os.makedirs(out_dir, exist_ok=True)
    rows = res["model_check"]
    lens = [r["tokens"] for r in rows]
    geo = res["geometry"]
    per_tok = rows[0]["bytes"] / rows[0]["tokens"] if rows else 0
    shape = f"{geo['layers']} layers x {geo['total_heads']} KV heads x {geo['head_dim']}, {geo['dtype']}"
    series = [
        (f"raw Mooncake write of the same bytes (4 MiB pieces, no layout change; {_mib(per_tok)}/token)", "o--", lens,
         [r["raw_gbps"] for r in rows], [r.get("raw_gbps_range") for r in rows]),
        (f"kvbridge handoff, {geo['src']} -> {geo['dst']} ({_mib(per_tok)}/token)", "s-", lens,
         [r["handoff_gbps"] for r in rows], [r.get("handoff_gbps_range") for r in rows]),
    ]
    runs = rows[0].get("runs") if rows else None
    notes = [_where() + f"; points: medians, bars: min..max over the {runs or 'few'} runs at each length "
             "(a shared, noisy host: read differences inside the bars as noise).",
             f"{shape}: {_mib(per_tok)} of KV per token ({_mib(per_tok * lens[0])} at {lens[0]:,} tokens, "
             f"{_mib(per_tok * lens[-1])} at {lens[-1]:,}); kvbridge: request to done, incl. control messages."]
    pts = (sglang or {}).get("per_length") or []
    if pts:
        sl = [p["tokens"] for p in pts]
        sg = sglang["geometry"]
        s_tok = pts[0]["bytes"] / pts[0]["tokens"]
        pair = f"SGLang page {sg['page_size']} -> SGLang page {sg['page_size']}"
        series += [(f"SGLang's own mooncake backend, {pair} ({_mib(s_tok)}/token)", "^-", sl,
                    [p["sglang_mooncake_gbps"] for p in pts], [p.get("sglang_mooncake_gbps_range") for p in pts]),
                   (f"kvbridge as SGLang backend, {pair} ({_mib(s_tok)}/token)", "v:", sl, [p["kvbridge_gbps"] for p in pts],
                    [p.get("kvbridge_gbps_range") for p in pts])]
        if pts[0].get("sglang_nixl_gbps") is not None:
            series.append((f"SGLang's own NIXL backend, {pair} ({_mib(s_tok)}/token)", "s--", sl,
                           [p["sglang_nixl_gbps"] for p in pts], [p.get("sglang_nixl_gbps_range") for p in pts]))
        same = "same bytes per token" if abs(s_tok - per_tok) < 1 else f"{_mib(s_tok)} per token (differs!)"
        notes.append(f"SGLang curves: `bench sglang`, run after the transfer suite (not interleaved with it): real "
                     f"SGLang pools and KVManager/Sender/Receiver, {pts[0].get('layers', sg['layers'])} layers x "
                     f"{sg['heads']} x {sg['head_dim']} ({same}), timed from send_metadata to Success on decode; "
                     f"the SGLang backends alternate within that run.")
    files = [_gbps_chart(os.path.join(out_dir, "transfer_gbps.png"), series,
                         "Effective bandwidth vs prompt length, one request at a time (measured)", notes)]
    files.append(_breakdown_chart(rows, os.path.join(out_dir, "transfer_breakdown.png"),
                                  f"{shape}, {geo['src']} -> {geo['dst']}"))
    return files


def plot_sglang(res: dict, out_dir: str) -> list[str]:
    """From ``bench_sglang`` output with ``per_length``: every backend's effective GB/s
    against prompt length."""
    os.makedirs(out_dir, exist_ok=True)
    pts = res["per_length"]
    sg = res["geometry"]
    sl = [p["tokens"] for p in pts]
    pair = f"SGLang page {sg['page_size']} -> SGLang page {sg['page_size']}"
    series = [(f"SGLang's own mooncake backend, {pair}", "^-", sl, [p["sglang_mooncake_gbps"] for p in pts],
               [p.get("sglang_mooncake_gbps_range") for p in pts]),
              (f"kvbridge as SGLang backend, {pair}", "v:", sl, [p["kvbridge_gbps"] for p in pts],
               [p.get("kvbridge_gbps_range") for p in pts])]
    if pts[0].get("sglang_nixl_gbps") is not None:
        series.append((f"SGLang's own NIXL backend ({res['nixl']['transport']}), {pair}", "s--", sl,
                       [p["sglang_nixl_gbps"] for p in pts], [p.get("sglang_nixl_gbps_range") for p in pts]))
    notes = [_where() + "; points: medians, bars: min..max over the runs.",
             f"{pts[0].get('layers', sg['layers'])} layers x {sg['heads']} x {sg['head_dim']}, {sg['dtype']}; real SGLang "
             f"pools and KVManager/Sender/Receiver; send_metadata -> Success on decode."]
    return [_gbps_chart(os.path.join(out_dir, "sglang_gbps.png"), series,
                        "SGLang backends: effective bandwidth vs prompt length (measured)", notes)]


def _breakdown_chart(rows: list[dict], path: str, what: str) -> str:
    """Stacked plan / repack / transfer / notify per prompt length, as a share of each
    handoff's wall time (labelled with the wall time in ms), so short and long handoffs
    read alike on one axis."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.2, 5.0))
    parts = [("plan", "plan: build the transfer plan", "#8172b3"),
             ("repack", "repack: gather into staging (earlier parts are on the wire meanwhile)", "#dd8452"),
             ("transfer", "transfer: submit Mooncake writes and wait for them", "#4c72b0"),
             ("notify", "notify: control messages, completion, the rest of the wall time", "#55a868")]
    plan_ms = [r["breakdown_ms"]["plan"] for r in rows]
    parts[0] = ("plan", f"plan: build the transfer plan ({min(plan_ms):.1f}-{max(plan_ms):.1f} ms)", parts[0][2])
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for key, label, color in parts:
        vals = []
        for r in rows:
            total = sum(r["breakdown_ms"].values()) or 1.0
            vals.append(100.0 * r["breakdown_ms"][key] / total)
        ax.bar(x, vals, bottom=bottom, label=label, color=color, width=0.62)
        for i, (r, v, b0) in enumerate(zip(rows, vals, bottom)):
            if v >= 7:  # the part's own milliseconds, where there is room
                ax.text(i, b0 + v / 2, f"{r['breakdown_ms'][key]:,.0f} ms", ha="center", va="center", fontsize=7.5,
                        color="white")
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        ax.text(i, 101.5, f"{r['measured_ms']:,.1f} ms for {_mib(r['bytes'])}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [f"{r['tokens']:,}" for r in rows])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("share of the handoff's wall time (%)")
    ax.set_ylim(0, 112)
    ax.set_yticks(range(0, 101, 20))
    ax.set_title("Where a kvbridge handoff's time goes (measured; wall time above each bar)", fontsize=10.5)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    notes = [_where() + ".",
             f"{what}; the sender thread's time, median run per length: plan, repack and transfer follow one another "
             "on that thread (writes of earlier parts run during a gather), notify is the wall time left. On a "
             "2-core host the gather competes with both peers' TCP copies; on a GPU host it is a device copy."]
    fig.tight_layout(rect=(0, _footer(fig, notes), 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_break_even(model, link, kw: dict, path: str, break_even) -> str:
    """PNG: first-token time disaggregated vs recompute over prompt lengths, saying which
    inputs are measured and which are presets or modelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from kvbridge.common.costmodel import decide

    if break_even is None:
        from kvbridge.common.costmodel import break_even_prompt_len

        break_even = break_even_prompt_len(model, link, **kw)
    top = 131072 if not break_even else min(1 << 21, max(131072, int(break_even * 2)))
    lens = np.unique(np.geomspace(64, top, 48).astype(int))
    ds = [decide(model, link, int(n), **kw) for n in lens]
    fig, ax = plt.subplots(figsize=(8.2, 5.0))
    ax.plot(lens, [d.disaggregated_ttft_s * 1e3 for d in ds], label="prefill worker + KV handoff")
    ax.plot(lens, [d.handoff.total_s * 1e3 for d in ds], "--", label="KV handoff alone")
    ax.plot(lens, [d.local_ttft_s * 1e3 for d in ds], label="recompute on the decode worker")
    if break_even:
        ax.axvline(break_even, color="grey", lw=0.8)
        ax.text(break_even * 0.93, 0.04, f"break-even: {break_even:,} tokens", rotation=90, fontsize=8, ha="right",
                va="bottom", transform=ax.get_xaxis_transform())
    else:
        ax.text(0.98, 0.04, "moving never wins in this range", ha="right", fontsize=8, transform=ax.transAxes)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens, log)")
    ax.set_ylabel("time to first token (ms, log)")
    measured = link.source.startswith("measured")
    ax.set_title(f"Move the KV or recompute? {model.name} (cost model predictions)\nlink "
                 f"{'measured' if measured else 'preset'}: {link.name}; prefill compute "
                 f"{'given' if kw.get('prefill_tps') else 'modelled from FLOPs'}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, which="major")
    tps = kw.get("prefill_tps"), kw.get("decode_prefill_tps")
    compute = ("prefill tokens/s given: prefill worker {}, decode worker {}".format(*tps) if any(tps) else
               "prefill compute MODELLED from FLOPs: 989 TFLOP/s x 45% MFU (H100-class), the decode worker at half that")
    notes = [f"link: {link.describe()}",
             f"model geometry: {model.name} ({model.source}); {compute}; prefill queue {kw.get('queue_s', 0) * 1e3:.0f} ms.",
             "Curves are predictions of kvbridge.common.costmodel, not measurements."]
    import textwrap

    lines = [w for n in notes for w in textwrap.wrap(n, 150, subsequent_indent="  ")]
    fig.text(0.01, 0.01, "\n".join(lines), ha="left", va="bottom", fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.02 + 0.026 * len(lines), 1, 1))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_layerwise(res: dict, out_dir: str) -> list[str]:
    """``kvbridge bench layerwise``: first-token time per prompt length, whole and layer by
    layer (medians, p10-p90 bars), with each mode's bound. Returns the file written."""
    plt = _plt()
    rows = res["lengths"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = list(range(len(rows)))
    w = 0.35
    for off, key, bound, label in ((-w / 2, "ttft_whole_ms", "bound_whole_ms", "whole after the prefill"),
                                   (w / 2, "ttft_layerwise_ms", "bound_layerwise_ms", "layer by layer")):
        med = [r[key]["median"] for r in rows]
        err = [[r[key]["median"] - r[key]["p10"] for r in rows], [r[key]["p90"] - r[key]["median"] for r in rows]]
        ax.bar([i + off for i in x], med, w, yerr=err, capsize=3, label=label)
        ax.scatter([i + off for i in x], [r[bound] for r in rows], marker="_", s=400, color="k", zorder=3)
    ax.set_xticks(x, [f"{r['prompt_len']:,} tokens\nratio {r['ttft_ratio']['median']:.2f}" for r in rows])
    ax.set_ylabel("first-token time, ms (median, p10-p90)")
    g = res["geometry"]
    ax.set_title("\n".join(textwrap.wrap(
        f"layer-wise KV sends, {res['engine']}; {g['num_hidden_layers']} layers, {g['token_bytes']:,} B/token "
        f"(black: bounds); {_where()}", 80)), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "layerwise_ttft.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
