"""Stand-in TensorRT-LLM servers for the tests (``kvbridge.demo.trtllm``), and what the
tests check on them: outputs, KV read through the engine's own indexing, blocks."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from tests.helpers.engine_kv import as_float, assert_kv_close, transformers_kv, trtllm_kv
from kvbridge.demo.trtllm.server import StandInServer, run_until

__all__ = ["PLUGIN", "VERSION_PAIRS", "run_until", "check_clean", "lag_layerwise_ranks", "server_kv", "wait_done"]

# short timeouts: failure cases end in seconds
PLUGIN = dict(host="127.0.0.1", deadline_s=8.0, heartbeat_s=0.2, peer_timeout_s=1.0, quiesce_s=0.5, chunk_bytes=1 << 20)
# (prefill version, decode version): each version on each side
VERSION_PAIRS = [pytest.param("1.2", "main", id="1.2->main"), pytest.param("main", "1.2", id="main->1.2")]


def wait_done(servers, server: StandInServer, rids: Sequence[int], timeout_s: float = 60.0) -> int:
    """Step ``servers`` until ``server`` answered every request in ``rids`` and every
    server is drained (nothing active, every block back)."""
    return run_until(servers, lambda: all(r in server.responses for r in rids) and all(s.drained() for s in servers),
                     timeout_s)


def check_clean(server: StandInServer) -> list[dict]:
    """Every rank: every block back, nothing pinned or held, no room left open in the
    connector's sender or receiver, no byte outside the blocks requests used changed, and
    no block changed after its last holder let it go (a late write into a freed block,
    reused since or not)."""
    states = []
    for r in range(len(server.ranks)):
        st = server.state(r)
        assert st["free"] == st["total"] and st["pinned"] == 0 and st["held"] == 0, (r, st)
        assert not st["changed_since_freed"], f"rank {r}: blocks {st['changed_since_freed']} changed after they were freed"
        assert st["sender_rooms"] == 0 and st["receiver_rooms"] == 0, (r, st)
        pool = server.pool(r)
        fresh = torch.empty_like(pool).view(-1).view(torch.uint8)
        g = torch.Generator().manual_seed(7 * 1009 + r)  # how the rank filled its pool (executor._open_pools)
        fresh.copy_(torch.randint(0, 256, fresh.shape, dtype=torch.uint8, generator=g))
        fresh = fresh.view(pool.dtype).view(pool.shape)
        if pool.dtype == torch.float32:
            fresh.view(-1).clamp_(-1e4, 1e4).nan_to_num_(0.0)
        untouched = sorted(set(range(pool.shape[0])) - set(st["ever"]))
        assert torch.equal(pool[untouched].view(torch.uint8), fresh[untouched].view(torch.uint8)), \
            f"rank {r}: bytes outside every request's blocks changed"
        states.append(st)
    return states


def server_kv(server: StandInServer, blocks: Sequence[int], head_dim: int, positions: Sequence[int],
              fp8: bool = False, block_order: str = "HND") -> torch.Tensor:
    """``[layers, kv, T, heads, head_dim]`` float32 over every rank of ``server`` (heads
    concatenated in rank order; MLA's replicated latent read from rank 0)."""
    parts = []
    for r in range(len(server.ranks)):
        kv = trtllm_kv(server.pool(r), blocks, server.tokens_per_block, head_dim, positions, block_order)
        parts.append(as_float(kv, fp8))
        if kv.shape[1] == 1:  # MLA: the same latent row on every rank
            break
    return torch.cat(parts, dim=3)


def assert_matches_transformers(server: StandInServer, model_dir, prompt: Sequence[int], blocks: Sequence[int],
                                head_dim: int, what: str, fp8: bool = False, block_order: str = "HND") -> None:
    """The server's KV of ``prompt`` (in ``blocks``) is what transformers' forward computes."""
    got = server_kv(server, blocks, head_dim, range(len(prompt)), fp8, block_order)
    assert_kv_close(got, transformers_kv(model_dir, prompt), what, fp8)


def lag_layerwise_ranks(seconds: float) -> None:
    """A stand-in rank's ``setup`` hook (``("tests.helpers.trtllm_servers:lag_layerwise_ranks",
    s)``): every rank but 0 starts each forward that streams layers ``seconds`` late, as a
    rank of a loaded host does; rank 0 runs ahead, samples and orders the ``Send`` first."""
    import time

    from kvbridge.adapters.trtllm.worker import KVBridgeConnectorWorker

    start = KVBridgeConnectorWorker.start_load_kv

    def late_start_load_kv(self, stream):
        meta = self.get_connector_meta()
        if self.rank != 0 and getattr(meta, "layers", None):
            time.sleep(seconds)
        return start(self, stream)

    KVBridgeConnectorWorker.start_load_kv = late_start_load_kv


def no_idle_wake(_arg=None) -> None:
    """A stand-in rank's ``setup`` hook: the plugin never wakes an idle executor (the
    control that shows what TensorRT-LLM 1.2 does without it)."""
    from kvbridge.adapters.trtllm.worker import KVBridgeConnectorWorker

    KVBridgeConnectorWorker._attach_idle_wake = lambda self: None
