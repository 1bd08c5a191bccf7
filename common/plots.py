"""PNG charts of benchmark results (matplotlib, headless)."""

from __future__ import annotations

import os

__all__ = ["plot_transfer"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_transfer(res: dict, out_dir: str, sglang: dict | None = None) -> list[str]:
    """From ``bench_transfer`` output: effective GB/s against prompt length (kvbridge, raw
    Mooncake, and SGLang's own backend when ``sglang`` gives per-length figures), and the
    handoff time breakdown per prompt length. Returns the files written."""
    plt = _plt()
    os.makedirs(out_dir, exist_ok=True)
    rows = res["model_check"]
    lens = [r["tokens"] for r in rows]
    geo = res["geometry"]
    what = (f"{geo['layers']} layers x {geo['total_heads']} KV heads x {geo['head_dim']}, {geo['dtype']}; "
            f"{geo['src']} -> {geo['dst']}; {geo['link']}")
    files = []

    fig, ax = plt.subplots(figsize=(7.5, 4.3))
    ax.plot(lens, [r["raw_gbps"] for r in rows], "o-", label="raw Mooncake write (4 MiB pieces, no layout change)")
    ax.plot(lens, [r["handoff_gbps"] for r in rows], "s-", label="kvbridge handoff (request to done, NHD -> HND)")
    if sglang and sglang.get("per_length"):
        pts = sglang["per_length"]
        ax.plot([p["tokens"] for p in pts], [p["gbps"] for p in pts], "^-", label="SGLang mooncake backend")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lens, [str(n) for n in lens])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("effective GB/s (payload / wall time)")
    ax.set_title("Effective bandwidth, same run", fontsize=11)
    fig.text(0.5, 0.005, what, ha="center", fontsize=7, color="grey")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    p = os.path.join(out_dir, "transfer_gbps.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    files.append(p)

    fig, ax = plt.subplots(figsize=(7.5, 4.3))
    parts = ["plan", "repack", "transfer", "notify"]
    colors = ["#8172b3", "#dd8452", "#4c72b0", "#55a868"]
    x = range(len(lens))
    bottom = [0.0] * len(lens)
    for part, c in zip(parts, colors):
        vals = [r["breakdown_ms"][part] for r in rows]
        ax.bar(x, vals, bottom=bottom, label=part, color=c, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(list(x), [r["measured_ms"] for r in rows], "k_", markersize=22, label="measured wall time")
    ax.set_xticks(list(x), [str(n) for n in lens])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("ms")
    ax.set_title("Where a handoff's time goes (sender view; repack overlaps earlier transfers)", fontsize=10)
    fig.text(0.5, 0.005, what + "\nnotify = control messages and the rest of the wall time", ha="center", fontsize=7,
             color="grey")
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    p = os.path.join(out_dir, "transfer_breakdown.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    files.append(p)
    return files
