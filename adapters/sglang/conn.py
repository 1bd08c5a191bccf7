"""kvbridge as an SGLang transfer backend: manager, sender, receiver, bootstrap server.

Discovery is SGLang's own: the classes subclass ``CommonKVManager`` / ``CommonKVSender``
/ ``CommonKVReceiver`` / ``CommonKVBootstrapServer`` (``srt/disaggregation/common/conn.py``),
so the router and decode servers find prefill ranks through the prefill's bootstrap
server as with any built-in backend. Each prefill rank adds a ``kvbridge`` record to
what it registers there (its kvbridge control endpoint, Mooncake session and layout);
the bootstrap server returns it with the rank's route and lists all of them at
``GET /kvbridge/ranks``, so any kvbridge receiver, SGLang or not, can find them.

The per-room exchange and the bytes are kvbridge's: the decode rank's ``KVReceiver``
sends each prefill rank it pulls from a ``TransferRequest`` (its layout and page ids),
the prefill rank's ``KVSender`` plans (head slices for different TP, staging when
layouts differ) and writes over the Mooncake transport after every prefill chunk, and
reports ``TransferDone`` with the first output token and the metadata row.

Cost gate (decode, off by default; ``KVBRIDGE_COST_GATE_ENABLED`` turns it on, see
``kvbridge.common.gate``): SGLang 0.5.23's disaggregated decode cannot compute a prompt
itself. Its scheduler only builds PREBUILT batches from requests whose KV arrived
(``_get_new_prebuilt_batch`` / ``prepare_for_prebuilt`` in disaggregation/decode.py: no
extend forward runs there), and a receiver that reports ``KVPoll.Failed`` makes it abort
the request (``prepare_abort``, HTTP 500 with the failure reason) and free its pages.
So below break-even the receiver fails fast in ``send_metadata``, before asking any
prefill rank for bytes (no page is written), with a reason starting ``recompute:
below break-even``; the prefill ranks are told (the room is declined), so they release
the room; the decision is logged and counted in
``kvbridge_fallbacks_total{role="receiver", reason="below_break_even"}``. A router that
sees that reason sends the request to a non-disaggregated server; one that wants to
know first asks the same cost model (``kvbridge plan`` or ``CostGate.check``).

Units: SGLang exchanges PAGE ids (page 0 is padding), each side in its OWN page size;
kvbridge's ranges are in tokens, so the two servers' page sizes need not agree. The
decode asks for exactly the prompt's tokens past ``decode_prefix_len`` (the count comes
from the decode scheduler's ``_send_kv_metadata``, see ``note_transfer_tokens``), into its
pages; the prefill sends from ``decode_prefix_len`` rounded down to its own page (its
scheduler slices its page list from there), each chunk as the exact tokens
``num_kv_tokens`` names; kvbridge writes only tokens the decode does not hold.

Pairing: SGLang's ``try_ensure_parallel_info`` refuses (raises, on the decode
scheduler's event loop) prefill servers whose page size or KV dtype differs. kvbridge's
bootstrap server leaves both out of its server-wide answer (each rank's kvbridge record
carries its layout, page size and dtype included, and kvbridge checks the layouts per
request, naming every mismatch), and the decode manager turns anything SGLang still
refuses into a failure of each request to that prefill, never an exception.
"""


from __future__ import annotations

from .bootstrap import KVBridgeKVBootstrapServer
from .geometry import layout_from_kv_args, resolve_kv_dtype
from .manager import KVBridgeKVManager
from .receiver import KVBridgeKVReceiver
from .sender import KVBridgeKVSender

__all__ = [
    "KVBridgeKVBootstrapServer",
    "KVBridgeKVManager",
    "KVBridgeKVReceiver",
    "KVBridgeKVSender",
    "layout_from_kv_args",
    "resolve_kv_dtype",
]
