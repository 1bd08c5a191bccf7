"""Mutation checks: each guarantee the README makes has a test that fails without it.

A mutation removes one guarantee by an exact text replacement in one source file. For
each, this script applies it in a scratch copy of the repository, runs the tests listed
for it, and puts the file back: the tests must fail (the mutation is *caught*); passing
tests mean the guarantee is unguarded (*survived*). The working tree is never touched.

The scratch copy holds the tracked files and the untracked ones git does not ignore (and
the package's built extension modules), and is imported as ``kvbridge`` instead of the
editable install: its ``kvbridge/`` folder gets links to the subpackage folders
(``pyproject.toml``'s ``package-dir``), so Python's path finder resolves every
``kvbridge.*`` module there, before the editable install's finder, in pytest and in every
process a test starts (``PYTHONPATH`` names the copy). A probe checks that before any run.

Usage: python scripts/mutants.py [--list] [--only NAME ...] [--jobs N]   (``make mutants``)
Exit status: 0 when every mutation was caught, 1 when one survived or could not run, 2
when the unmutated tests fail or the copy does not import as itself.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST = ("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider")


@dataclass(frozen=True)
class Mutation:
    """One guarantee removed: ``old`` (exactly once in ``file``) becomes ``new``; every
    run of ``tests`` (pytest node ids) must then fail."""

    name: str
    file: str
    old: str
    new: str
    guarantee: str
    tests: tuple[str, ...]
    timeout_s: int = 420
    also: tuple[tuple[str, str, str], ...] = ()  # more (file, old, new) edits of the same removal

    @property
    def edits(self) -> tuple[tuple[str, str, str], ...]:
        return ((self.file, self.old, self.new), *self.also)


RR = "tests/faults/test_release_rule.py"
SGK = "tests/sglang/test_sglang_server_kvbridge.py"
MUTATIONS: tuple[Mutation, ...] = (
    # -- the release rule and the write guards (README: The transfer core; The release rule)
    Mutation(
        "write-guard", "common/send_pipeline.py",
        '        check_segments_inside(wire.dst, wire.length, allowed, f"room {r.room}")\n',
        "        pass\n",
        "before any byte moves, the sender checks that every segment lies inside the blocks the receiver "
        "allocated for that room",
        (f"{RR}::test_write_guard_refuses_a_plan_outside_the_room[direct]",)),
    Mutation(
        "piece-guard", "common/writes.py",
        "                why = self._guard() if self._guard is not None else None\n",
        "                why = None\n",
        "each write piece is guarded right before it enters the transfer engine",
        ("tests/core/test_transport.py::test_write_guard_stops_before_the_next_piece",)),
    Mutation(
        "resume-guard", "common/send_pipeline.py",
        "            if silent > self.config.peer_timeout_s:\n",
        "            if False:\n",
        "a sender whose decode peer was silent past peer_timeout_s (it was stopped, or partitioned) sends no "
        "further piece",
        ("tests/core/test_release_guards.py::test_resume_guard_refuses_the_next_piece_to_a_peer_silent_past_the_timeout",
         f"{RR}::test_stopped_prefill_resumes_into_quarantined_blocks[direct]")),
    Mutation(
        "quiet-check", "common/receiver.py",
        "        return all(v in (PeerState.DONE, PeerState.FAILED) for v in r.peers.values())\n",
        "        return all(v is not PeerState.PENDING for v in r.peers.values())\n",
        "a decode's blocks go back only when no sender can still write into them (a failed sender not proven "
        "quiet keeps them quarantined)",
        ("tests/core/test_release_guards.py::test_a_failed_sender_that_is_not_quiet_keeps_the_blocks",
         f"{RR}::test_decode_abort_releases_only_when_the_sender_is_quiet[direct]")),
    Mutation(
        "quiet-waits-for-our-scatter", "common/receiver.py",
        "                if r.peers[peer] is PeerState.SCATTERING:\n",
        "                if False:\n",
        "a sender's quiet answer does not release a room while this side's scatter or content check of what it "
        "sent still runs",
        ("tests/core/test_release_guards.py::test_a_quiet_answer_during_our_scatter_or_check_keeps_the_blocks_until_it_ends",)),
    Mutation(
        "abort-waits-for-our-scatter", "common/receiver.py",
        "                if r.peers[peer] not in (PeerState.FAILED, PeerState.SCATTERING):\n",
        "                if r.peers[peer] is not PeerState.FAILED:\n",
        "a sender's Abort does not release a room while this side's scatter or content check of what it sent "
        "still runs",
        ("tests/core/test_release_guards.py::test_a_quiet_answer_during_our_scatter_or_check_keeps_the_blocks_until_it_ends",)),
    Mutation(
        "probe-answer-proves-life", "common/receiver.py",
        "        elif peer in self._closed_at and msg.room >= self._closed_at[peer][1]:\n",
        "        elif peer in self._closed_at and msg.room > self._closed_at[peer][1]:\n",
        "a prefill whose control connection closed and that answers the probe is alive: its rooms are not "
        "released as if its process were gone",
        ("tests/core/test_release_guards.py::test_an_answer_to_the_probe_after_a_closed_connection_proves_the_process_lives",)),
    Mutation(
        "failing-worker-holds-room", "common/send_pipeline.py",
        "        except (TransportError, LayoutError, HandoffFailed) as e:\n            self.side.fail(r.room, str(e), \"transfer\")\n",
        "        except (TransportError, LayoutError, HandoffFailed) as e:\n            with self._lock:\n"
        "                r.busy = False\n            self.side.fail(r.room, str(e), \"transfer\")\n",
        "a send worker whose write failed holds the room until it has failed: no second worker writes while the "
        "first one's settle says quiet",
        ("tests/core/test_release_guards.py::test_a_failing_send_worker_holds_its_room_until_the_room_has_failed",)),
    Mutation(
        "answers-bound-to-attempt", "common/receiver.py",
        "        if msg.attempt != r.attempt:  # about an earlier request under this room id (a late answer to its Abort)\n",
        "        if False:  # about an earlier request under this room id (a late answer to its Abort)\n",
        "an answer to an earlier request under the same room id (a late quiet reply to its Abort) neither fails "
        "the new request nor proves its sender quiet",
        ("tests/core/test_release_guards.py::test_a_late_answer_to_an_earlier_request_under_the_same_room_id_changes_nothing",)),
    Mutation(
        "scatter-inside-room-tokens", "common/receiver.py",
        "            if ch.start < r.tokens[0] or ch.stop > r.tokens[1]:  # e.g. prefix tokens other requests share\n",
        "            if False:  # e.g. prefix tokens other requests share\n",
        "the decode's own scatter writes only the tokens its request asked for, never a prefix it already holds",
        ("tests/core/test_release_guards.py::test_a_scatter_writes_only_the_tokens_the_room_asked_for",)),
    Mutation(
        "sender-quiet-only-when-settled", "common/sender.py",
        "                    self._send(peer, P.TransferFailed(room=room, reason=reason, code=code, quiet=False))\n",
        "                    self._send(peer, P.TransferFailed(room=room, reason=reason, code=code, quiet=True))\n",
        "a sender says quiet only once every piece it handed the transfer engine is final",
        (f"{RR}::test_prefill_abort_keeps_source_blocks_until_settled[direct]",)),
    Mutation(
        "prefill-pages-until-settled", "common/sender.py",
        "        if r.state is RoomState.FAILED and not r.settled and r.chunks:\n",
        "        if False:\n",
        "on the prefill side a failed room reads Transferring until it settled (its engine keeps the pages a "
        "piece still reads)",
        (f"{RR}::test_prefill_abort_keeps_source_blocks_until_settled[direct]",)),
    Mutation(
        "refusal-not-proof", "common/sender.py",
        "        self._send(peer, P.TransferFailed(room=room, reason=reason, code=code, quiet=not loud))\n",
        "        self._send(peer, P.TransferFailed(room=room, reason=reason, code=code, quiet=True))\n",
        "a refusal such as conflict, where a replay of the request may be the one being served, is not proof "
        "that the sender is quiet",
        (f"{RR}::test_replayed_request_served_first_keeps_the_genuine_blocks[direct]",)),
    Mutation(
        "abort-again-each-heartbeat", "common/receiver.py",
        "                    self._send(ep, self._abort_msg(r.room, r.reason))\n",
        "                    pass\n",
        "the decode asks every sender it has no proof from to stop again each heartbeat_s",
        ("tests/core/test_guards_mutants.py::test_a_sender_not_proven_quiet_is_asked_to_stop_every_heartbeat",)),
    Mutation(
        "release-exactly-once", "common/blocks.py",
        "            if self._released:\n",
        "            if False:\n",
        "each side's blocks are released exactly once",
        ("tests/core/test_guards_mutants.py::test_blocks_go_back_once_whoever_releases_them",)),
    # -- sealed frames (README: Settings, secret; docs/security.md)
    Mutation(
        "seal-covers-payload", "common/auth.py",
        "        h.update(header)\n        h.update(payload)\n",
        "        h.update(header)\n",
        "every frame is sealed: HMAC-SHA256 over all of it (the payload)",
        ("tests/core/test_auth.py::test_every_byte_is_covered",)),
    Mutation(
        "seal-covers-header", "common/auth.py",
        "        h.update(header)\n        h.update(payload)\n",
        "        h.update(payload)\n",
        "every frame is sealed: HMAC-SHA256 over all of it (key id, time, nonce)",
        ("tests/core/test_auth.py::test_every_byte_is_covered",)),
    Mutation(
        "seal-covers-channel", "common/auth.py",
        '        h.update(domain + b"\\x00")\n',
        "",
        "a frame sealed for one channel (control, bus, rank record) is refused on another",
        ("tests/core/test_auth.py::test_unsigned_unknown_key_and_wrong_domain_are_refused",)),
    Mutation(
        "replay-window", "common/auth.py",
        "        if abs(skew) > self.window_s:\n",
        "        if False:\n",
        "a sealed frame older (or newer) than replay_window_s is refused",
        ("tests/core/test_auth.py::test_replay_is_refused_and_the_window_bounds_the_cache",)),
    Mutation(
        "replay-nonce", "common/auth.py",
        "            if nb in self._seen:\n",
        "            if False:\n",
        "a sealed frame seen before inside the window (a replay) is refused",
        ("tests/core/test_auth.py::test_replay_is_refused_and_the_window_bounds_the_cache",)),
    Mutation(
        "routable-bind-needs-secret", "common/auth.py",
        "    if secret or is_loopback(host):\n        return\n",
        "    return\n",
        "without a secret a prefill rank refuses a routable bind",
        ("tests/core/test_auth.py::test_routable_bind_without_a_secret_is_refused",)),
    Mutation(
        "bootstrap-registration-seal", "common/bootstrap.py",
        "    if canonical(_open(body, keyring)) != canonical(_unsealed(body)):\n",
        "    if False:\n",
        "a rank's bootstrap registration (PUT /route) is taken only with a valid seal over all of it",
        ("tests/hostile/test_bootstrap_auth.py::test_unsealed_registration_is_refused_and_the_sealed_one_taken",)),
    Mutation(
        "bootstrap-entry-seal", "common/bootstrap.py",
        "    rec = _open(entry, keyring)\n",
        "    rec = _unsealed(entry)\n",
        "a reader trusts a rank record only as its seal carries it",
        ("tests/hostile/test_bootstrap_auth.py::test_a_reader_never_trusts_a_forged_or_altered_record",)),
    Mutation(
        "control-frame-bound-to-link", "common/protocol.py",
        '    return CONTROL + (b"\\x00to-prefill\\x00" if to_prefill else b"\\x00to-decode\\x00") + prefill.encode()\n',
        '    return CONTROL + (b"\\x00to-prefill\\x00" if to_prefill else b"\\x00to-decode\\x00")\n',
        "a sealed control frame is bound to its prefill rank: one taken off another rank's link is refused both ways",
        ("tests/core/test_auth.py::test_a_control_frame_is_bound_to_its_direction_and_its_prefill_rank",
         "tests/hostile/test_hostile_input.py::test_frames_sealed_for_another_link_are_refused_both_ways")),
    Mutation(
        "bus-result-from-its-worker", "adapters/trtllm/scheduler.py",
        "                if not (msg.rank < self.world_size and self._workers.get(msg.rank) == peer):\n",
        "                if False:\n",
        "on the TensorRT-LLM bus a rank's load result (and release) counts only from that rank's worker, even "
        "sealed with the secret",
        ("tests/hostile/test_bus_auth.py::test_forged_load_result_is_refused_and_the_honest_one_decides",)),
    Mutation(
        "request-sealed", "common/rooms.py",
        "        self.channel.send(peer, P.seal(data, self._keyring, self._link(peer, outgoing=True)))\n",
        "        self.channel.send(peer, data)\n",
        "a decode's request, sent from the encoding it already checked, is sealed like every other control frame",
        ("tests/core/test_handoff.py::test_failures_end_on_both_sides_with_reasons_and_free_blocks",)),
    Mutation(
        "fail-before-refusal", "common/sender.py",
        '            self._fail(req.room, reason, code="incompatible", notify=True)\n'
        '            self._refuse(peer, req.room, reason, "incompatible")\n',
        '            self._refuse(peer, req.room, reason, "incompatible")\n'
        '            self._fail(req.room, reason, code="incompatible", notify=True)\n',
        "a refused room has failed, with its reason, before the refusal goes out (an engine's abort notice "
        "answering it cannot take the reason's place)",
        ("tests/core/test_release_guards.py::test_a_refused_room_has_failed_before_its_refusal_goes_out",)),
    Mutation(
        "wire-layout-regions", "common/protocol.py",
        "Meta(min_length=1, max_length=1 << 16)]\n",
        "Meta(max_length=1 << 16)]\n",
        "a layout off the wire names the memory regions its addresses are checked against",
        ("tests/hostile/test_hostile_input.py::test_a_layout_off_the_wire_names_its_memory",)),
    Mutation(
        "bounded-peer-maps", "common/limits.py",
        "            while len(self) >= self.cap:\n",
        "            while False:\n",
        "peer-keyed maps are bounded (a flood of peers evicts the oldest, counted)",
        ("tests/core/test_limits.py::test_bounded_map_drops_the_oldest_and_counts",)),
    Mutation(
        "message-size-cap", "common/protocol.py",
        "    if size > max_bytes:\n",
        "    if False:\n",
        "a control message over the size limit is refused before it is parsed",
        ("tests/core/test_protocol.py::test_size_cap",)),
    # -- what a room admits (README: The transfer core; Integrity)
    Mutation(
        "prefix-not-resent", "common/send_pipeline.py",
        "        start, stop = max(c.start, req.token_start), min(c.stop, req.token_stop)\n",
        "        start, stop = c.start, min(c.stop, req.token_stop)\n",
        "prefix reuse: only the tokens the decode lacks move",
        ("tests/core/test_handoff.py::test_cross_format_handoff_chunked_with_prefix[sglang-16-trtllm-32]",)),
    Mutation(
        "layer-accounting", "common/receiver.py",
        "        short = np.flatnonzero(r.layer_bytes < per_layer)\n",
        "        short = np.flatnonzero(r.layer_bytes < 0)\n",
        "the receiver admits a room only when every layer of every part is accounted for",
        ("tests/core/test_handoff_layerwise.py::test_a_done_missing_a_layer_is_not_admitted",)),
    Mutation(
        "integrity-verify", "common/receiver.py",
        "        if why:\n            m.integrity_failures.inc()\n        return why\n",
        '        if why:\n            m.integrity_failures.inc()\n        return ""\n',
        "integrity on: a room whose landed content differs from what the prefill moved fails (code integrity)",
        ("tests/faults/test_integrity.py::test_a_byte_flipped_in_flight_fails_the_room",)),
    Mutation(
        "digest-canonical-order", "layout/digest.py",
        "            addr = int(layout.base[layer, kv]) + head[:, None] + tok[None, :]  # [heads, tokens]: canonical order\n",
        "            addr = int(layout.base[layer, kv]) + head[None, :] + tok[:, None]\n",
        "the content digest reads rows in the canonical order (layer, K/V, head, token), the same whatever "
        "layout holds them",
        ("tests/layout/test_digest.py::test_both_sides_digest_the_same_content_and_name_a_flipped_byte",)),
    Mutation(
        "digest-runs-contiguous", "layout/digest.py",
        "        cut[1:] |= tok[1:] != tok[:-1] + layout.head_bytes\n",
        "",
        "a host pool's content digest hashes each unit's rows where they lie, a run of rows back to back "
        "at a time: never bytes between them",
        ("tests/layout/test_digest.py::test_both_sides_digest_the_same_content_and_name_a_flipped_byte",)),
    Mutation(
        "digest-split-layers", "layout/digest.py",
        "            out[a:b] = _hash_grid(layout, bases[a:b], head, *runs[0], per_row, seeds[a:b])",
        "            out[a:b] = _hash_grid(layout, bases[:b - a], head, *runs[0], per_row, seeds[a:b])",
        "a content digest spread over several threads hashes each thread's own layers",
        ("tests/layout/test_digest.py::test_both_sides_digest_the_same_content_and_name_a_flipped_byte",)),
    Mutation(
        "digest-c-loop-checked", "layout/digest.py",
        "    if got.tolist() != want:\n",
        "    if False:\n",
        "the content digest's C loop is used only where it computes the xxhash package's own values",
        ("tests/layout/test_digest.py::test_the_c_loop_is_used_only_where_it_agrees_with_the_xxhash_package",)),
    Mutation(
        "digest-fp8-scales", "layout/digest.py",
        "    return np.where(s == 1.0, 0, s.view(np.uint32)).astype(np.uint64)\n",
        "    return np.zeros(s.shape, dtype=np.uint64)\n",
        "an fp8 unit's content digest covers its scale: equal bytes under another scale differ",
        ("tests/layout/test_digest.py::test_fp8_scales_seed_the_units_they_scale",)),
    Mutation(
        "digest-torch-exact", "layout/digest.py",
        "        h = torch.remainder(part[lane] * _weights(chunks, lane + 2, dev), _P).sum(-1)\n",
        "        h = part[lane].sum(-1)\n",
        "the torch reduction (a GPU pool's content digest) weighs each chunk of a unit, so a change "
        "anywhere in the unit, or chunks in another order, changes its value",
        ("tests/layout/test_digest.py::test_the_torch_reduction_sees_every_single_word_change_and_every_scale",)),
    Mutation(
        "digest-torch-seeded", "layout/digest.py",
        "    for lane, seed in ((0, seeds), (1, seeds >> 1)):\n",
        "    for lane, seed in ((0, seeds * 0), (1, seeds * 0)):\n",
        "the torch reduction covers an fp8 unit's scale, as XXH3-64 does",
        ("tests/layout/test_digest.py::test_the_torch_reduction_sees_every_single_word_change_and_every_scale",)),
    Mutation(
        "digest-algorithm-asked", "common/sender.py",
        "            algorithm = digest_algorithm_for(self.layout, req.digest_algorithms) if req.digest else \"\"\n",
        "            algorithm = digest_algorithm_for(self.layout, []) if req.digest else \"\"\n",
        "a sender digests with an algorithm its receiver accepts (the one it asked for)",
        ("tests/faults/test_integrity.py::test_a_byte_flipped_in_flight_fails_the_room",)),
    Mutation(
        "digest-algorithm-refused", "common/sender.py",
        "            algorithm = digest_algorithm_for(self.layout, req.digest_algorithms) if req.digest else \"\"\n",
        "            algorithm = req.digest_algorithms[0] if req.digest and req.digest_algorithms else \"\"\n",
        "a request for a content digest by an algorithm the sender does not compute is refused, naming it, "
        "before any byte moves",
        ("tests/hostile/test_hostile_input.py::test_trusted_but_wrong_requests_are_refused_before_any_byte_moves",)),
    Mutation(
        "sender-unregisters-staging", "common/send_pipeline.py",
        "                self.transport.unregister(buf.data_ptr())\n",
        "                pass\n",
        "nothing leaked: a closed sender gives back the staging it registered with the transport",
        ("tests/core/test_transport.py::test_a_closed_sender_gives_back_its_staging_registration",)),
    # -- vLLM's CPU ISAs and staging on both sides (docs/vllm.md)
    Mutation(
        "vllm-amx-v-tokens", "layout/vllm_pool.py",
        "    v = (((block_size // 2, 32 * e), (2, e)),",
        "    v = (((block_size // 2, 2 * e), (2, e)),",
        "vLLM's 'amx' tiles are read where vLLM's own reshape kernel wrote them",
        ("tests/vllm/test_vllm_layout.py::test_amx_every_byte_both_ways",)),
    Mutation(
        "staged-both-chunk-offsets", "common/send_pipeline.py",
        "                landed += chunk.nbytes\n",
        "\n",
        "a staged_both send's chunks land one after another in the receiver's staging",
        ("tests/core/test_handoff.py::test_vllm_cpu_isas_and_block_sizes_meet",)),
    # -- the prestage (README: The transfer core)
    Mutation(
        "prestage-used", "common/send_pipeline.py",
        "                pre = self._usable_prestage(r, t, c, plan)\n",
        "                pre = None\n",
        "a request of the usual shape sends the first part gathered before it came (bytes on the wire right "
        "after its plan)",
        ("tests/core/test_handoff.py::test_first_part_gathered_before_the_request",)),
    Mutation(
        "prestage-ascending-blocks", "common/send_pipeline.py",
        "                and t.blocks.size >= pre.nblk and bool(np.all(t.blocks[1:pre.nblk] > t.blocks[:pre.nblk - 1]))):\n",
        "                and t.blocks.size >= pre.nblk):\n",
        "a prestaged part is used only for ascending block ids (any other request is served as before)",
        ("tests/core/test_handoff.py::test_first_part_gathered_before_the_request",)),
    Mutation(
        "link-read-once", "common/settings.py",
        '        link = self.__dict__.get("_link")\n',
        "        link = None\n",
        "a deployment's link is resolved once per settings object: every cost comes from the same figures",
        ("tests/core/test_settings.py::test_link_file_from_bench_link",)),
    # -- the layout core (README: The layout model)
    Mutation(
        "tp-head-slice", "layout/heads.py",
        "        return cls(lo, hi - lo, lo - src.head_offset, lo - dst.head_offset)\n",
        "        return cls(lo, hi - lo, lo - src.head_offset, 0)\n",
        "prefill TP != decode TP: each decode rank pulls exactly its heads",
        ("tests/layout/test_layout_unit.py::test_tp_head_slices_and_maps",
         "tests/core/test_handoff.py::test_tensor_parallel_head_maps[2-1]")),
    Mutation(
        "partial-last-page", "layout/segments.py",
        "    i0, i1 = (spec.start - first) // tpb, -(-(spec.stop - first) // tpb)\n",
        "    i0, i1 = (spec.start - first) // tpb, (spec.stop - first) // tpb\n",
        "page sizes differ: prompts need not fill a page on either side (a last page partly filled moves too)",
        ("tests/layout/test_layout_unit.py::test_local_repack_between_pools_is_exact",)),
    Mutation(
        "runs-cut-at-source-pages", "layout/copyspec.py",
        "            np.arange(self.src_first_token + tpb_s * ((self.start - self.src_first_token) // tpb_s + 1), self.stop, tpb_s),\n",
        "            np.arange(0),\n",
        "a direct plan's runs end at every page boundary of the prefill's pool (a run never reads across "
        "into a block the request does not own)",
        ("tests/layout/test_layout_properties.py::test_every_plan_moves_exactly_the_request",)),
    Mutation(
        "runs-cut-at-destination-pages", "layout/copyspec.py",
        "            np.arange(self.dst_first_token + tpb_d * ((self.start - self.dst_first_token) // tpb_d + 1), self.stop, tpb_d),\n",
        "            np.arange(0),\n",
        "a direct plan's runs end at every page boundary of the decode's pool (a run never writes across "
        "into a block of another request)",
        ("tests/layout/test_layout_properties.py::test_every_plan_moves_exactly_the_request",)),
    Mutation(
        "trtllm-kv-order", "layout/trtllm_pool.py",
        "    base = pool_ptr + layers[:, None] * layer_bytes + np.arange(kv_factor, dtype=np.int64)[None, :] * block_kv_bytes\n",
        "    base = pool_ptr + layers[:, None] * layer_bytes + np.arange(kv_factor, dtype=np.int64)[None, ::-1] * block_kv_bytes\n",
        "a TensorRT-LLM pool is read and written as TensorRT-LLM lays it out (K before V in a block)",
        ("tests/layout/test_layout_unit.py::test_trtllm_pool_geometry_is_hnd_and_rejects_bad_shapes",)),
    Mutation(
        "mismatch-named", "layout/geometry.py",
        '    for name in ("num_layers", "layer_offset", "kv_factor", "total_heads", "head_dim", "dtype"):\n',
        '    for name in ("num_layers", "layer_offset", "kv_factor", "total_heads", "head_dim"):\n',
        "incompatible layouts (layers, heads, head_dim, dtype, kv_factor) raise LayoutMismatchError naming "
        "each mismatch",
        ("tests/layout/test_layout_unit.py::test_incompatible_layouts_name_every_mismatch",)),
    # -- the plugins (README: SGLang plugin; TensorRT-LLM plugin)
    Mutation(
        "sglang-prefix-page-rounding", "adapters/sglang/sender.py",
        "        self._prefix = held - held % ps\n",
        "        self._prefix = held\n",
        "a decode prefix off the prefill's page grid: the prefill sends from it rounded down to its own page",
        ("tests/sglang/test_sglang_backend.py::test_handoff[mha-p64-d1-tp1to2-prefix]",)),
    Mutation(
        "sglang-release-after-quiet", "adapters/sglang/manager.py",
        "        return self.kv_receiver is None or self.kv_receiver.settled(bootstrap_room)\n",
        "        return True\n",
        "a real SGLang decode gets an aborted request's pages back only once no prefill can still write into them",
        (f"{SGK}::test_decode_abort_with_a_piece_in_flight_keeps_sglangs_pages_until_the_prefill_is_quiet",),
        timeout_s=600),
    Mutation(
        "sglang-exact-tokens", "adapters/sglang/receiver.py",
        "        ntok = self._transfer_tokens if self._transfer_tokens is not None else pages.size * ps\n",
        "        ntok = pages.size * ps\n",
        "SGLang pairs: exactly the prompt's tokens land in the decode's pool, not its pages' worth",
        ("tests/sglang/test_sglang_server_page_sizes.py::test_16_to_64_chunked_prefill",), timeout_s=600,
        also=(("adapters/sglang/sender.py",
               "        ntok = int(num_kv_tokens) if num_kv_tokens is not None else pages.size * ps\n",
               "        ntok = pages.size * ps\n"),)),  # the prefill sends its pages' worth too: outputs stay right
    Mutation(
        "trtllm-refuses-host-cache", "adapters/trtllm/refusals.py",
        '    if _get(llm_args, "kv_cache_config.host_cache_size", None):\n',
        "    if False:\n",
        "the TensorRT-LLM plugin refuses host cache offloading (which 1.2 lets through) at start-up",
        ("tests/trtllm/test_trtllm_refusals.py::test_host_cache_offloading_is_refused[1.2]",)),
    Mutation(
        "trtllm-refuses-reuse-off", "adapters/trtllm/refusals.py",
        '    if not _get(llm_args, "kv_cache_config.enable_block_reuse", True):\n',
        "    if False:\n",
        "the TensorRT-LLM plugin refuses a server whose block reuse is off, naming what turned it off",
        ("tests/trtllm/test_trtllm_refusals.py::test_flashinfer_turns_block_reuse_off_and_is_refused[1.2]",)),
    Mutation(
        "trtllm-rank-takes-rank0-settings", "adapters/trtllm/config.py",
        "        if same_host:\n            return rank0\n",
        "        if same_host:\n            return mine\n",
        "a TensorRT-LLM rank that no setting reached runs with rank 0's (the deployment's secret included)",
        ("tests/trtllm/test_trtllm_refusals.py::test_ranks_with_settings_of_their_own_must_agree",
         "tests/trtllm/test_trtllm_refusals.py::test_a_rank_no_setting_reached_takes_rank0s")),
    Mutation(
        "trtllm-refuses-sliding-window", "adapters/trtllm/refusals.py",
        "        if short:\n",
        "        if False:\n",
        "the TensorRT-LLM plugin refuses sliding-window attention at start-up, naming the windows",
        ("tests/trtllm/test_trtllm_refusals.py::test_sliding_window_attention_is_refused[sliding-window-1.2]",)),
    Mutation(
        "trtllm-wakes-idle-executor", "adapters/trtllm/worker.py",
        "            self._idle_wake.attach(self._executor.cancel_request)\n",
        "            pass\n",
        "a TensorRT-LLM 1.2 executor idle while a prefill's blocks are pinned is woken: the blocks come back "
        "within the room's deadline, not at the next request",
        ("tests/trtllm/test_trtllm_idle.py::test_prefill_blocks_come_back_within_the_deadline_on_an_idle_executor[1.2]",)),
    Mutation(
        "trtllm-clears-wake-ids", "adapters/trtllm/worker.py",
        "                forget_wake_ids(self._executor, self._let_go_of)\n",
        "                pass\n",
        "the ids the plugin used to wake TensorRT-LLM 1.2's executor leave its cancelled ids again (no list that "
        "grows by one per request)",
        ("tests/trtllm/test_trtllm_idle.py::test_prefill_blocks_come_back_within_the_deadline_on_an_idle_executor[1.2]",)),
    Mutation(
        "trtllm-released-from-its-rank", "adapters/trtllm/scheduler.py",
        "                if msg.rank < self.world_size and self._workers.get(msg.rank) == peer:\n",
        "                if msg.rank < self.world_size:\n",
        "rank 0 counts a rank's release of a request's blocks only from the worker that joined as that rank",
        ("tests/trtllm/test_trtllm_unit.py::test_released_is_taken_only_from_that_ranks_worker",)),
    Mutation(
        "trtllm-ordered-dispatch", "adapters/trtllm/worker.py",
        "        def apply(o=o):\n            with self._lock:\n                self._send(o)\n        self._dispatch.call(apply)\n",
        "        with self._lock:\n            self._send(o)\n",
        "a layer-wise TensorRT-LLM prefill hands its sender calls over in order: a room's end never overtakes "
        "layers still waiting on the device",
        ("tests/core/test_guards_mutants.py::test_trtllm_send_waits_for_layers_queued_on_the_device",)),
    Mutation(
        "layout-compares-fp8-scales", "layout/geometry.py",
        "    if not mism and src.dtype in SCALED_DTYPES:\n        mism += scale_mismatches(src, dst)\n",
        "",
        "two fp8 layouts exchange KV only where their scales agree: bytes move as they are",
        ("tests/layout/test_layout_unit.py::test_fp8_scales_must_agree_on_every_head_both_hold",
         "tests/core/test_handoff.py::test_fp8_scales_that_differ_fail_the_room_naming_both")),
    Mutation(
        "layout-slots-disjoint", "layout/geometry.py",
        "        if disjoint:\n            self._check_disjoint()\n",
        "",
        "a layout (a peer's or an adapter's) whose slots or blocks would share bytes is refused by name",
        ("tests/layout/test_layout_unit.py::test_a_layout_whose_slots_share_bytes_is_refused",
         "tests/layout/test_layout_unit.py::test_the_overlap_check_agrees_with_enumerating_every_row",
         "tests/hostile/test_hostile_input.py::test_trusted_but_wrong_requests_are_refused_before_any_byte_moves")),
    Mutation(
        "sglang-carries-fp8-scales", "adapters/sglang/manager.py",
        "        return lay.with_scales(scales)\n",
        "        return lay\n",
        "an SGLang rank's fp8 layout carries the scales its model's attention layers read the cache with",
        ("tests/sglang/test_sglang_backend.py::test_fp8_caches_with_other_scales_fail_naming_both",)),
    Mutation(
        "trtllm-carries-fp8-scales", "adapters/trtllm/worker.py",
        "        self.layout = model_scales(self._executor, pool_layout(kv_cache_tensor, geo))\n",
        "        self.layout = pool_layout(kv_cache_tensor, geo)\n",
        "a TensorRT-LLM rank's fp8 layout carries its model's kv_cache_scaling_factor per layer",
        ("tests/trtllm/test_trtllm_connector.py::test_fp8_scales_that_differ_are_recomputed_not_moved",)),
    Mutation(
        "vllm-views-token-stride", "layout/vllm_pool.py",
        "block_stride=t0.stride(0) * isz, token_stride=t0.stride(2) * isz,",
        "block_stride=t0.stride(0) * isz, token_stride=t0.stride(1) * isz,",
        "vLLM's logical cache views are described by their own strides (each stride order of KVCacheLayout)",
        ("tests/vllm/test_vllm_layout.py::test_every_kv_cache_layout_of_vllm_moves_to_and_from_sglang_and_trtllm",)),
    Mutation(
        "vllm-views-v-after-k", "layout/vllm_pool.py",
        "np.arange(kv, dtype=np.int64)[None, :] * head_size * isz",
        "np.arange(kv, dtype=np.int64)[None, :] * 0",
        "V sits after K's head_size elements in a vLLM logical view's content",
        ("tests/vllm/test_vllm_layout.py::test_every_kv_cache_layout_of_vllm_moves_to_and_from_sglang_and_trtllm",)),
    Mutation(
        "vllm-carries-fp8-scales", "adapters/vllm/worker.py",
        "            scales[i, k] = s\n    return lay.with_scales(scales)\n",
        "            scales[i, k] = s\n    return lay\n",
        "a vLLM rank's fp8 layout carries the _k_scale / _v_scale vLLM loaded into each attention layer",
        ("tests/vllm/test_vllm_layout.py::test_fp8_caches_carry_the_scales_vllm_loaded",)),
    # -- one vocabulary, one rank start-up (docs/design.md)
    Mutation(
        "layout-description-bounds", "common/protocol.py",
        "Int62 = Annotated[int, Meta(ge=0, lt=2**62)]\n",
        "Int62 = int\n",
        "a layout description off the wire is refused on decode, naming the field, when a value is out of bounds",
        ("tests/core/test_protocol.py::test_absurd_request_values",)),
    Mutation(
        "rank-receiver-staging", "common/rank.py",
        "        self.receiver = KVReceiver(layout, self.transport, config=self.settings.handoff(receiver=True))\n",
        "        self.receiver = KVReceiver(layout, self.transport, config=self.settings.handoff())\n",
        "every plugin's decode rank offers the deployment's recv_staging_bytes to its senders (staged_recv plans)",
        ("tests/core/test_settings.py::test_every_plugin_starts_its_rank_the_same_way",)),
    Mutation(
        "announce-refusal-answered", "adapters/trtllm/bus.py",
        '                answer = Expected(key=head.key, ok=False, nonce=head.nonce, reason=f"invalid announcement: {e}")\n',
        "                answer = None\n",
        "an announcement whose handle is not valid is answered naming why, not left to time out",
        ("tests/trtllm/test_trtllm_unit.py::test_announce_is_refused_with_a_reason_and_times_out_on_silence",)),
    Mutation(
        "copy-split-offset", "layout/tiles.py",
        "            split.run(lambda a, b: self.native_copy(a, b, flat[(a - i) * box:], scatter=scatter), i, j, box)\n",
        "            split.run(lambda a, b: self.native_copy(a, b, flat, scatter=scatter), i, j, box)\n",
        "a gather or scatter spread over several threads puts each range of boxes at its own place in staging",
        ("tests/layout/test_gather_tiles.py::test_gather_split_over_threads_matches_reference",
         "tests/core/test_handoff.py::test_gather_and_scatter_over_two_threads_move_the_same_bytes")),
    Mutation(
        "copy-choice-tcp", "common/copy_choice.py",
        "    if protocol not in CPU_FREE_PROTOCOLS:\n",
        "    if False:\n",
        "beside a transport whose copies need the CPU (TCP), the gather keeps to one thread",
        ("tests/core/test_copy_choice.py::test_one_thread_beside_tcp_all_where_rdma_or_nvlink_leave_the_cpu_and_it_measured_faster",)),
    Mutation(
        "calibration-busy-cached", "common/copy_choice.py",
        "    if busy is not None and busy > BUSY:\n",
        "    if False:\n",
        "a copy calibration taken while other processes kept the CPUs busy is not cached for the host",
        ("tests/core/test_copy_choice.py::test_a_calibration_taken_beside_a_busy_process_is_used_but_not_cached",)),
    Mutation(
        "calibration-affinity", "common/copy_choice.py",
        "                if mine is not None and int(name[3:]) not in mine:\n",
        "                if False:\n",
        "a calibration's contention is counted on the CPUs its process may run on, not the whole host",
        ("tests/core/test_copy_choice.py::test_others_cpu_counts_only_the_cpus_this_process_may_run_on",)),
    Mutation(
        "copy-split-wired", "common/send_pipeline.py",
        "                    gather.run(region, rows=(a, b), split=self._split)\n",
        "                    gather.run(region, rows=(a, b))\n",
        "the sender's gather runs on the threads the host's copy choice gives it",
        ("tests/core/test_handoff.py::test_gather_and_scatter_over_two_threads_move_the_same_bytes",)),
    Mutation(
        "copy-split-wired-receiver", "common/receiver.py",
        "            Scatter(spec).run(self._staging[off + ch.offset : off + ch.offset + spec.nbytes], split=self._split)\n",
        "            Scatter(spec).run(self._staging[off + ch.offset : off + ch.offset + spec.nbytes])\n",
        "the receiver's scatter runs on the threads the host's copy choice gives it",
        ("tests/core/test_handoff.py::test_gather_and_scatter_over_two_threads_move_the_same_bytes",)),
    Mutation(
        "repack-overlap", "layout/plan.py",
        "        hidden = self.repack_overlap * self.hideable_s(rep, wire) if self.overlap_repack else 0.0\n",
        "        hidden = self.hideable_s(rep, wire) if self.overlap_repack else 0.0\n",
        "a staged plan is priced with the share of its repack the link was measured to hide behind the wire",
        ("tests/core/test_costmodel.py::test_handoff_prediction_parts",)),
)


# -- the scratch copy ---------------------------------------------------------------------


def _git_files() -> list[str]:
    """Tracked files and untracked ones git does not ignore, plus the package's built
    extension modules (ignored, but imported)."""
    def ls(*args: str) -> list[str]:
        out = subprocess.run(["git", "ls-files", "-z", *args], cwd=ROOT, check=True, capture_output=True).stdout
        return [p for p in out.decode().split("\0") if p]

    files = ls("--cached", "--others", "--exclude-standard")
    built = [p for p in ls("--others", "--ignored", "--exclude-standard", "--directory") if p.endswith(".so")]
    return sorted({p for p in files + built if (ROOT / p).is_file()})


def _package_links() -> dict[str, str]:
    """kvbridge's first-level subpackages and their folders (``package-dir``)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = cfg["tool"]["setuptools"]["package-dir"]
    return {name.split(".")[1]: path for name, path in dirs.items() if name.count(".") == 1}


def make_scratch(files: list[str]) -> Path:
    """A copy of ``files`` that imports as ``kvbridge``."""
    scratch = Path(tempfile.mkdtemp(prefix="kvbridge-mutants-"))
    for rel in files:
        dst = scratch / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst)
    for sub, folder in _package_links().items():
        link = scratch / "kvbridge" / sub
        if not link.exists():
            link.symlink_to(Path(os.path.relpath(scratch / folder, link.parent)), target_is_directory=True)
    return scratch


def scratch_env(scratch: Path) -> dict[str, str]:
    """The environment of every run in ``scratch`` (its processes inherit ``PYTHONPATH``)."""
    env = dict(os.environ)
    env.pop("KVBRIDGE_RELIABILITY_DIR", None)  # a mutated run's fault rows go nowhere
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not Path(p).resolve().is_relative_to(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(scratch)] + keep)
    # the vLLM venv's scripts (tests/helpers/vllm_env.py) import the scratch copy's kvbridge too
    vllm = env.get("KVBRIDGE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if os.access(vllm, os.X_OK):
        env["KVBRIDGE_VLLM_PYTHON"] = vllm
    env["KVBRIDGE_VLLM_PYTHONPATH"] = str(scratch)
    return env


_PROBE_MODULES = ("kvbridge", "kvbridge.cli", "kvbridge.common.receiver", "kvbridge.layout.digest",
                  "kvbridge.adapters.trtllm.worker", "kvbridge.adapters.sglang.sender", "kvbridge.bench",
                  "kvbridge.demo", "kvbridge.route", "tests.helpers.kvhelpers")
_PROBE = """
import importlib, json, multiprocessing as mp, subprocess, sys
MODS = %r
CHILD = "import importlib, json; print(json.dumps({m: importlib.import_module(m).__file__ for m in %r}))"

def where(_=None):
    return {m: importlib.import_module(m).__file__ for m in MODS}

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])  # as pytest's `pythonpath = ["."]` does
    seen = {"pytest's process": where()}
    with mp.get_context("spawn").Pool(1) as pool:
        seen["a spawned process"] = pool.apply(where)
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd="/", check=True).stdout
    seen["a subprocess"] = json.loads(out)
    print(json.dumps(seen))
""" % (_PROBE_MODULES, _PROBE_MODULES)


def probe(scratch: Path, env: dict[str, str]) -> list[str]:
    """Where ``kvbridge`` resolves in ``scratch``: in the process pytest will run in, in a
    spawned process and in a subprocess. Returns what resolves outside the copy (none: good)."""
    import json

    src = scratch / "_mutants_probe.py"
    src.write_text(_PROBE)
    try:
        res = subprocess.run([sys.executable, str(src), str(scratch)], cwd=scratch, env=env, capture_output=True,
                             text=True, timeout=300)
    finally:
        src.unlink()
    if res.returncode:
        return [f"probe failed: {res.stderr.strip()[-2000:]}"]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    bad = []
    for where, files in seen.items():
        for mod, f in files.items():
            p = Path(f)
            if not (p.is_relative_to(scratch) and p.resolve().is_relative_to(scratch)):
                bad.append(f"{where}: {mod} -> {f}")
    return bad


# -- runs -----------------------------------------------------------------------------------


def _drop_bytecode(path: Path) -> None:
    """Remove ``path``'s cached bytecode, so the next import compiles what the file holds now."""
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def run_pytest(scratch: Path, env: dict[str, str], tests, timeout_s: float) -> tuple[str, str, float]:
    """(outcome, output, seconds) of pytest on ``tests`` in ``scratch``: outcome ``passed``,
    ``failed`` (a test failed or errored), ``crashed`` (the process died, e.g. a copy through
    a wrong address), ``timeout`` or ``error`` (pytest could not run them)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, *PYTEST, *tests], cwd=scratch, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", out, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - t0
    if proc.returncode == 0 and re.search(r"\b\d+ skipped\b", out):
        return "error", out + "\n(a listed test was skipped: it proves nothing here)", seconds
    if proc.returncode == 0:
        return "passed", out, seconds
    if proc.returncode < 0 or "Fatal Python error" in out:
        return "crashed", out, seconds
    if proc.returncode == 1 and any(line.startswith(("FAILED ", "ERROR ")) for line in out.splitlines()):
        return "failed", out, seconds
    return "error", out, seconds


def first_failure(out: str) -> str:
    """The first FAILED/ERROR line of a pytest summary, shortened."""
    for line in out.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:150]
    return ""


def run_mutation(m: Mutation, scratch: Path, env: dict[str, str]) -> tuple[str, float, str]:
    """(result, seconds, detail): result ``caught``, ``survived``, ``stale`` or ``error``."""
    originals: dict[Path, str] = {}
    for file, old, _ in m.edits:
        path = scratch / file
        text = originals.setdefault(path, path.read_text() if path.is_file() else "")
        n = text.count(old)
        if n != 1:
            return "stale", 0.0, f"stale mutation: its text occurs {n} times in {file}, not once"
    try:
        changed = dict(originals)
        for file, old, new in m.edits:
            changed[scratch / file] = changed[scratch / file].replace(old, new)
        for path, text in changed.items():
            path.write_text(text)
            _drop_bytecode(path)
        outcome, out, seconds = run_pytest(scratch, env, m.tests, m.timeout_s)
    finally:
        for path, text in originals.items():
            path.write_text(text)
            _drop_bytecode(path)
    if outcome == "failed":
        return "caught", seconds, first_failure(out)
    if outcome == "crashed":
        return "caught", seconds, "pytest crashed: " + next((line for line in out.splitlines()
                                                            if "Fatal Python error" in line), "killed by a signal")[:120]
    if outcome == "passed":
        return "survived", seconds, "its tests pass with the guarantee removed"
    tail = " | ".join(out.strip().splitlines()[-3:])[-300:]
    return "error", seconds, f"{outcome}: {tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    ap.add_argument("--markdown", action="store_true", help="with --list: as the table in docs/testing.md")
    ap.add_argument("--only", action="append", metavar="NAME", help="run this mutation only (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="mutations run at once, each in its own copy (default 1)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies (their paths are printed)")
    args = ap.parse_args(argv)

    names = [m.name for m in MUTATIONS]
    assert len(set(names)) == len(names), "mutation names must be unique"
    chosen = list(MUTATIONS)
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            ap.error(f"unknown mutation(s) {unknown}; --list shows them")
        chosen = [m for m in MUTATIONS if m.name in args.only]
    if args.list and args.markdown:
        print("| mutation | guarantee it removes | tests that catch it |\n|---|---|---|")
        for m in chosen:
            tests = "<br>".join(f"`{t.removeprefix('tests/')}`" for t in m.tests)
            files = ", ".join(dict.fromkeys(f"`{f}`" for f, _, _ in m.edits))
            print(f"| `{m.name}` ({files}) | {m.guarantee} | {tests} |")
        return 0
    if args.list:
        for m in chosen:
            print(f"{m.name}  ({', '.join(dict.fromkeys(f for f, _, _ in m.edits))})\n  removes: {m.guarantee}\n  tests:   " + "\n           ".join(m.tests))
        return 0

    t_start = time.monotonic()
    files = _git_files()
    jobs = max(1, min(args.jobs, len(chosen)))
    scratches = [make_scratch(files) for _ in range(jobs)]
    try:
        for s in scratches:
            bad = probe(s, scratch_env(s))
            if bad:
                print("the scratch copy does not import as itself; refusing to run:\n  " + "\n  ".join(bad))
                return 2
        print(f"scratch copies ({len(files)} files each): {', '.join(map(str, scratches))}; kvbridge resolves "
              "there (here, in spawned processes, in subprocesses)", flush=True)

        tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
        print(f"unmutated: {len(tests)} test(s) must pass ...", flush=True)
        outcome, out, seconds = run_pytest(scratches[0], scratch_env(scratches[0]), tests, 1800)
        if outcome != "passed":
            print(out[-4000:])
            print(f"the listed tests do not pass unmutated ({outcome}, {seconds:.0f} s): the run is invalid")
            return 2
        print(f"unmutated: passed in {seconds:.0f} s", flush=True)

        work: queue.Queue = queue.Queue()
        for i, m in enumerate(chosen):
            work.put((i, m))
        results: dict[int, tuple[str, float, str]] = {}

        def worker(scratch: Path) -> None:
            env = scratch_env(scratch)
            while True:
                try:
                    i, m = work.get_nowait()
                except queue.Empty:
                    return
                res = run_mutation(m, scratch, env)
                results[i] = res
                print(f"  {m.name}: {res[0]} ({res[1]:.0f} s) {res[2]}", flush=True)

        threads = [threading.Thread(target=worker, args=(s,)) for s in scratches]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if args.keep:
            print(f"kept: {', '.join(map(str, scratches))}")
        else:
            for s in scratches:
                shutil.rmtree(s, ignore_errors=True)

    width = max(len(m.name) for m in chosen)
    print(f"\n{'mutation':<{width}}  {'result':<8}  {'s':>4}  first failing test / why")
    for i, m in enumerate(chosen):
        result, seconds, detail = results[i]
        print(f"{m.name:<{width}}  {result:<8}  {seconds:>4.0f}  {detail}")
    counts = {k: sum(r[0] == k for r in results.values()) for k in ("caught", "survived", "stale", "error")}
    print(f"\n{counts['caught']} caught, {counts['survived']} survived, {counts['stale']} stale, {counts['error']} error "
          f"of {len(chosen)} mutation(s) in {time.monotonic() - t_start:.0f} s")
    return 0 if counts["caught"] == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
