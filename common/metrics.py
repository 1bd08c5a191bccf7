"""Per-handoff figures: a Python record and Prometheus metrics.

Prometheus names (all prefixed ``kvbridge_``):

- ``handoffs_total{role, result, plan}``: finished handoffs (result: success, failed, aborted,
  declined: the decode side computes the prompt itself; counted on both sides)
- ``handoff_bytes_total{role, plan}``, ``handoff_segments_total{role, plan}``
- ``handoff_seconds{role, plan}``: histogram of handoff wall time (request to done)
- ``handoff_transfer_gbps{role, plan}``: histogram of payload GB/s
- ``handoffs_inflight{role}``: gauge
- ``blocks_held{role}``: gauge of blocks leased to handoffs and not yet released
- ``quarantined_blocks{role, peer, reason}``: gauge of blocks of ended rooms kept from
  the engine because ``peer`` may still write into (or read from) them; released the
  moment that peer is proven quiet (``reason``: why the room ended)
- ``quarantines_total{role, reason}``: rooms whose blocks entered quarantine
- ``fallbacks_total{role, reason}``: requests whose KV was not moved (``reason``:
  ``below_break_even``: the cost gate judged recomputing on the decode side cheaper;
  ``handoff_failed``: a failed handoff was recomputed, TensorRT-LLM decode), counted by
  the decode side (``role="receiver"``)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["HandoffRecord", "KVBridgeMetrics", "quarantined_in"]


@dataclass
class HandoffRecord:
    """What one handoff did, on one side."""

    room: int
    role: str  # "sender" or "receiver"
    plan: str = ""
    plan_reason: str = ""
    bytes: int = 0
    segments: int = 0
    chunks: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    result: str = "pending"  # pending, success, failed, aborted, declined (decode recomputes instead)
    reason: str = ""
    plan_s: float = 0.0
    repack_s: float = 0.0
    transfer_s: float = 0.0
    digest_s: float = 0.0  # taking the content digest (sender) or taking and comparing it (receiver)
    digest_algorithm: str = ""  # the content digest's algorithm (kvbridge.layout.digest), where one was taken
    copy_threads: int = 0  # the most threads one gather (sender) or scatter (receiver) copy ran on; 0: none ran
    # the handoff's timeline (time.monotonic(), host-wide; 0.0: not reached). Sender: the
    # first decode request's frame arrived (``heard_at``), that request was accepted
    # (``asked_at``), the first piece went to the transport, the last TransferDone was handed
    # to the control channel. Receiver: ``started`` is its request, ``heard_at`` the last
    # TransferDone's frame arriving, ``finished`` the room settled.
    heard_at: float = 0.0
    asked_at: float = 0.0
    wrote_at: float = 0.0
    done_at: float = 0.0

    @property
    def seconds(self) -> float:
        """Wall time from start to finish (or to now)."""
        return (self.finished or time.monotonic()) - self.started

    @property
    def gbps(self) -> float:
        """Payload GB/s over the wall time."""
        s = self.seconds
        return self.bytes / s / 1e9 if s > 0 else 0.0

    def as_dict(self) -> dict:
        """Plain data, with derived seconds and GB/s."""
        d = asdict(self)
        d["seconds"] = self.seconds
        d["gbps"] = self.gbps
        return d


class KVBridgeMetrics:
    """Prometheus metrics of one process; pass a registry to keep them apart (tests)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        from prometheus_client import REGISTRY

        self.registry = registry if registry is not None else REGISTRY
        r = self.registry
        self.handoffs = Counter("kvbridge_handoffs", "Finished handoffs", ["role", "result", "plan"], registry=r)
        self.bytes = Counter("kvbridge_handoff_bytes", "Payload bytes moved", ["role", "plan"], registry=r)
        self.segments = Counter("kvbridge_handoff_segments", "Wire segments issued", ["role", "plan"], registry=r)
        self.seconds = Histogram(
            "kvbridge_handoff_seconds", "Handoff wall time", ["role", "plan"], registry=r,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.gbps = Histogram(
            "kvbridge_handoff_transfer_gbps", "Payload GB/s per handoff", ["role", "plan"], registry=r,
            buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 400),
        )
        self.inflight = Gauge("kvbridge_handoffs_inflight", "Handoffs in progress", ["role"], registry=r)
        self.blocks_held = Gauge("kvbridge_blocks_held", "Blocks leased to handoffs", ["role"], registry=r)
        self.quarantined = Gauge("kvbridge_quarantined_blocks", "Blocks of ended rooms kept from the engine until "
                                 "the peer that may write into them is proven quiet", ["role", "peer", "reason"], registry=r)
        self.quarantines = Counter("kvbridge_quarantines", "Rooms whose blocks entered quarantine", ["role", "reason"],
                                   registry=r)
        self.fallbacks = Counter("kvbridge_fallbacks", "Requests whose KV was not moved (decode side computes it)",
                                 ["role", "reason"], registry=r)
        self.prestaged = Counter("kvbridge_prestaged_parts", "First parts a sender gathered before the request came, "
                                 "by whether the request could use them", ["outcome"], registry=r)
        self.auth_refused = Counter("kvbridge_refused_frames", "Frames refused before they changed anything, by "
                                    "channel (control, bus, rank_record, sglang_abort) and why (unsigned, unknown_key, "
                                    "stale, bad_tag, replay, too_large, bad_message)", ["channel", "reason"], registry=r)
        self.evictions = Counter("kvbridge_bounded_evictions", "Entries dropped from a peer-keyed map at its cap",
                                 ["map"], registry=r)
        self.integrity = Counter("kvbridge_integrity_checks", "Content digests a receiver compared, by result "
                                 "(verified, mismatch, missing: the sender sent none)", ["result"], registry=r)
        self.integrity_failures = Counter("kvbridge_integrity_failures", "Rooms failed because what landed is not "
                                          "what the sender moved (content digest mismatch or missing)", registry=r)

        self._children: dict = {}

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, looked up once per label set (a finished handoff
        touches several on its critical path)."""
        key = (metric, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def refused(self, channel: str, reason: str) -> None:
        """Count one frame refused on ``channel`` for ``reason`` (``kvbridge_refused_frames_total``)."""
        self.child(self.auth_refused, channel, reason).inc()

    def evicted(self, name: str) -> None:
        """Count one entry dropped from peer-keyed map ``name`` at its cap (``kvbridge_bounded_evictions_total``)."""
        self.child(self.evictions, name).inc()

    def observe(self, rec: HandoffRecord) -> None:
        """Account one finished handoff."""
        plan = rec.plan or "none"
        self.child(self.handoffs, rec.role, rec.result, plan).inc()
        if rec.result == "success":
            self.child(self.bytes, rec.role, plan).inc(rec.bytes)
            self.child(self.segments, rec.role, plan).inc(rec.segments)
            self.child(self.seconds, rec.role, plan).observe(rec.seconds)
            self.child(self.gbps, rec.role, plan).observe(rec.gbps)


def quarantined_in(exposition: str) -> list[dict]:
    """The quarantined blocks a process reports in its Prometheus text ``exposition``
    (its ``/metrics``): one dict per (role, peer, reason) with blocks above zero."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(exposition):
        if fam.name != "kvbridge_quarantined_blocks":
            continue
        for smp in fam.samples:
            if smp.value > 0:
                out.append({**{k: smp.labels.get(k, "") for k in ("role", "peer", "reason")}, "blocks": int(smp.value)})
    return out
