"""The fault-matrix section of the reliability report (``kvbridge report --only faults``).

``run_faults`` runs the repository's fault-injection and cross-host tests
(tests/faults/test_faults.py, tests/faults/test_cross_host.py; prefill and decode in separate OS
processes over Mooncake TCP, both plugins) with their results directed to a fresh
folder, and returns what they recorded (``faults.json``, ``cross_host.json``) with the
pytest outcome; ``render_faults`` turns that into the markdown tables. It needs a source
checkout (the tests are not installed with the package).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time

__all__ = ["run_faults", "render_faults", "FAULT_ROWS"]

log = logging.getLogger(__name__)

FAULT_ROWS = [
    ("kill_decode", "decode killed mid-transfer (SIGKILL); throttled writes"),
    ("kill_prefill", "prefill killed mid-transfer (SIGKILL); throttled writes"),
    ("kill_decode_defaults", "decode killed mid-transfer; transport defaults, two hosts, rate-limited link"),
    ("kill_prefill_defaults", "prefill killed mid-transfer; transport defaults, two hosts, rate-limited link"),
    ("sigstop_prefill", "prefill hangs (SIGSTOP mid-transfer, SIGCONT after); shipped transport, window held"),
    ("abort_prefill", "abort from the prefill side mid-transfer (TensorRT-LLM: the client cancels the request); "
                      "shipped transport, window held"),
    ("abort_decode", "abort from the decode side mid-transfer (TensorRT-LLM: the client cancels the request); "
                     "shipped transport, window held"),
    ("never_peer", "room that never gets its peer (both directions)"),
    ("bootstrap_down", "bootstrap server (SGLang) / discovery bus (TensorRT-LLM) down"),
    ("link_cut", "link cut between two hosts mid-transfer (netns + veth); throttled writes"),
    ("link_cut_defaults", "link cut between two hosts mid-transfer; transport defaults, rate-limited link"),
    ("gate_recompute", "decode recompute fallback with the cost gate on (below break-even; prefill gone)"),
]
NOT_APPLICABLE = {("sglang", "gate_recompute"): "n/a: SGLang 0.5.23's disaggregated decode cannot compute a prompt; "
                  "its gate fails the request fast (tests/sglang/test_sglang_backend.py)"}
PLUGINS = [("sglang", "SGLang plugin"), ("trtllm", "TensorRT-LLM plugin")]
TESTS = ("tests/faults/test_faults.py", "tests/faults/test_cross_host.py", "tests/faults/test_release_rule.py")
RELEASE_ROWS = [
    ("abort_decode", "decode abort"),
    ("abort_prefill", "prefill abort, its write timeout (1 s) passed twice over while the piece is held"),
    ("deadline", "the decode's deadline"),
    ("sigstop_prefill", "prefill stopped (SIGSTOP) past the peer timeout, then resumed"),
    ("conflict", "a replay of the decode's request served first; the genuine one refused (conflict)"),
    ("kill_prefill", "prefill killed (SIGKILL)"),
]


def _checkout() -> str:
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
    if not all(os.path.exists(os.path.join(root, t)) for t in TESTS):
        raise RuntimeError(f"the fault matrix runs {', '.join(TESTS)} from a source checkout; none at {root}")
    return root


def run_faults(opts: dict) -> dict:
    """Run the fault-injection and cross-host tests; returns their recorded results."""
    root = _checkout()
    out = tempfile.mkdtemp(prefix="kvbridge-faults-")
    env = dict(os.environ, KVBRIDGE_RELIABILITY_DIR=out)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=root, env=env,
                          capture_output=True, text=True, timeout=float(opts.get("faults_timeout_s", 1200)))
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    res: dict = {"pytest_rc": proc.returncode, "pytest_summary": summary, "skipped": skipped,
                 "seconds": round(time.monotonic() - t0, 1), "rows": [], "cross_host": {}}
    for name, key in (("faults.json", "rows"), ("cross_host.json", "cross_host"), ("release.json", "release")):
        path = os.path.join(out, name)
        if os.path.exists(path):
            data = json.load(open(path))
            res[key] = data["rows"] if key in ("rows", "release") else data
            if key == "rows":
                res["peer_timeout_s"] = data.get("peer_timeout_s")
    if proc.returncode != 0:
        log.warning("fault tests failed (%s):\n%s", summary, proc.stdout[-4000:])
    from kvbridge.bench.report import _stamp

    res["when"] = _stamp()
    return res


def _cell(r: dict | None) -> str:
    if r is None:
        return "not run"
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    sides = "; ".join(f"{s['side']} {s['state'].lower()} in {s['seconds']:.2f} s (bound {s['bound_s']:g} s)"
                      for s in r["sides"])
    extra = []
    if r.get("recompute_ok"):
        extra.append("decode recomputed with the model, KV equal to transformers'")
    held = r.get("in_flight")
    if held:
        extra.append(f"held past the write guard: batch {held['held_batch']} ({held['held_bytes']} B) of a write of "
                     f"{held['pieces']} piece{'s' if held['pieces'] != 1 else ''}, {held['bytes']} B, each its own "
                     "batch")
    if r.get("quarantined_s") is not None:
        extra.append(f"{r.get('quarantined_blocks', '?')} blocks kept from the engine {r['quarantined_s']:.2f} s "
                     f"after Failed, back {r['released_after_let_go_s']:.3f} s after the batch was let go, "
                     "unchanged since")
    if r.get("note"):
        extra.append(r["note"])
    checks = "blocks released once" if r.get("blocks_ok") and not r.get("double_releases") else "BLOCKS"
    nxt = "next request byte-exact" if r.get("next_ok") else "NEXT REQUEST FAILED"
    if r.get("known_gap"):
        extra.append(f"**known gap (xfail, strict): {r['known_gap']}**")
    elif r.get("late_write_after_resume") is False:
        extra.append("no write into the decode's released pages after the prefill resumed")
    head = "known gap" if r.get("known_gap") else ("ok" if r.get("ok") else "FAIL")
    return f"{head}: {sides}; {checks}; {nxt}" + (f"; {'; '.join(extra)}" if extra else "")


def render_faults(r: dict) -> str:
    """Markdown for ``run_faults`` results: the fault matrix and the cross-host handoffs."""
    by = {(x["plugin"], x["fault"]): x for x in r.get("rows", [])}
    lines = [f"`kvbridge report --only faults` runs {' and '.join(TESTS)} (pytest: {r.get('pytest_summary', '?')}, "
             f"{r.get('seconds', '?')} s). Prefill and decode in separate OS processes over Mooncake TCP (SGLang: its "
             "real pools and kvbridge's backend classes; TensorRT-LLM: the TensorRT-LLM stand-in, one process per rank "
             "running the tiny Llama's real forward). A fault is injected once the transfer is under way, in one of three "
             "ways, named in each row: **shipped transport, window held** (the transport's own piece size and in-flight "
             "bound, no delay; a test hook holds one batch of the prefill's write past kvbridge's write guard while "
             "the fault is injected and the decode reports Failed, then lets it go, so it lands: the decode's blocks "
             "must go back only after that, and not one byte of them change once they did), **throttled writes** "
             "(a test hook: while armed, the Mooncake transport sends "
             "16 KiB pieces, one in flight per peer, each held 20 ms (SGLang) / 60 ms (TensorRT-LLM) before it goes to "
             "the engine; the fault after the second piece, with most of the transfer still to go), or the "
             "**transport's defaults** (its own piece size and in-flight bound, no delay; prefill and decode on two "
             "hosts, network namespaces whose link is rate-limited with `tc tbf` so the transfer takes about a "
             "second; the fault as soon as the first piece is submitted). Figures from throttled rows are for "
             "throttled writes. Short timeouts (peer timeout "
             f"{r.get('peer_timeout_s', '?')} s). A cell: each side's state as it reports it (SGLang: its KVPoll; "
             "TensorRT-LLM: the connector worker's record of the load or send; a cancelled request: TensorRT-LLM's "
             "finish reason) with the time from the fault, against its bound (asserted: within bound + 1 s, with a "
             "reason naming the fault), every block released exactly once (kvbridge's lease gauges back to zero and no "
             "refused second release; TensorRT-LLM also: the KV cache manager's blocks all free, nothing pinned, no "
             "room open, no byte outside the requests' blocks changed, no block changed after it was freed; SGLang "
             "also: the pages of a failed decode request unchanged once SGLang has them back), and the next request "
             "between the surviving (or restarted) peers byte-exact. Blocks a sender may still write stay "
             "quarantined until it is proven quiet (README, \"The release rule\"): a decode reports Failed after "
             f"the peer timeout plus `quiesce_s`. Run {r.get('when', '')}.",
             "", "| fault | " + " | ".join(p for _, p in PLUGINS) + " |", "|---|" + "---|" * len(PLUGINS)]
    for key, label in FAULT_ROWS:
        lines.append(f"| {label} | " + " | ".join(NOT_APPLICABLE.get((p, key)) or _cell(by.get((p, key)))
                                                 for p, _ in PLUGINS) + " |")
    ch = r.get("cross_host", {})
    lines += ["", "Across hosts (two network namespaces joined by a veth pair, 10.203.0.1 / 10.203.0.2; TensorRT-LLM "
              "connector; endpoints advertised with each host's address, no listener on 127.0.0.1):", "",
              "| handoff | result (seconds: the decode's handoff, from its receiver's record) |", "|---|---|"]
    p2p, etcd = ch.get("p2p_handoff"), ch.get("etcd_handoff")
    lines.append("| P2PHANDSHAKE metadata, discovery through the prefill's bus | "
                 + (f"byte-exact, {p2p['bytes']:,} B in {p2p['seconds']:.2f} s |" if p2p else "not run |"))
    lines.append("| etcd metadata server (`etcd-server`, in the prefill's namespace) | "
                 + (f"byte-exact, {etcd['bytes']:,} B in {etcd['seconds']:.2f} s; etcd keys: "
                    f"{', '.join('`' + k + '`' for k in etcd.get('etcd_keys', []))} |" if etcd else "not run |"))
    for key, what in (("link_cut", "throttled writes"), ("link_cut_defaults", "transport defaults, rate-limited link")):
        cut = by.get(("trtllm", key))
        lines.append(f"| link cut mid-transfer ({what}) | " + _cell(cut)
                     + (f"; prefill blocks back after {cut['blocks_back_s']} s" if cut and "blocks_back_s" in cut else "")
                     + " |")
    lines += _render_release(r.get("release") or [])
    if r.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(s.replace("SKIPPED ", "") for s in r["skipped"])]
    return "\n".join(lines) + "\n"


def _release_cell(x: dict | None) -> str:
    if x is None:
        return "not run"
    flight = (f"{x['engine_pieces']} piece(s), {x['engine_bytes']:,} B in the transfer engine + "
              f"{x['held_bytes']:,} B held past the write guard")
    if "released_s" in x:
        how = f"blocks back {x['released_s']:.2f} s after the kill (process gone)"
    else:
        how = (f"Failed {x['failed_s']:.2f} s after the fault; " if "failed_s" in x else "") + \
              (f"{x['quarantined_blocks']} blocks quarantined from then (and while the test checked them) until the "
               f"sender proved quiet, {x['let_go_s']:.2f} s after its held piece was let go")
    return f"{'ok' if x.get('poison_ok') else 'LATE WRITE'}: {flight}; {how}; poisoned blocks unchanged"


def _render_release(rows: list[dict]) -> list[str]:
    """The release-rule table (tests/faults/test_release_rule.py)."""
    if not rows:
        return []
    by = {(x["plan"], x["fault"]): x for x in rows}
    plans = sorted({x["plan"] for x in rows})
    out = ["", "Release rule (tests/faults/test_release_rule.py): prefill and decode processes over Mooncake TCP with "
           "the transport as shipped (4 MiB pieces, up to 1024 in flight per peer), 32 MiB of KV per room, a direct "
           "plan of about a thousand segments and a staged send of parts up to 8 MiB. The sender's second piece is "
           "held past its write guard while the fault is injected, and let go only once the decode has reported "
           "Failed; every block the decode's engine gets back is filled with a poison pattern at that moment and "
           "read again after the sender settled or died. A cell: what was in flight at the fault, how the room "
           "ended, how long its blocks stayed quarantined.", "",
           "| fault | " + " | ".join(plans) + " |", "|---|" + "---|" * len(plans)]
    for key, label in RELEASE_ROWS:
        out.append(f"| {label} | " + " | ".join(_release_cell(by.get((p, key))) for p in plans) + " |")
    return out
