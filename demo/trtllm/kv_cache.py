"""TensorRT-LLM's KV cache manager as the executor and the connector use it.

Modelled on ``_torch/pyexecutor/resource_manager.py`` ``KVCacheManager`` and the C++
``KVCacheManager`` / ``BlockManager`` behind it (``cpp/tensorrt_llm/batch_manager/
kvCacheManager.cpp``):

- one primary pool per rank, ``[num_blocks, layers, kv_factor, heads_per_rank *
  tokens_per_block * head_dim]`` (``get_unique_primary_pool()``), HND inside a block;
  ``kv_factor`` 1 for MLA; fp8 stored as uint8;
- ``tokens_per_block`` is what the executor creator passed (possibly forced: see
  ``executor.create_py_executor``), ``num_kv_heads_per_layer`` and
  ``total_num_kv_heads_per_layer`` both hold PER-RANK head counts
  (``ceil(num_kv_heads / tp_size)``), ``dtype`` is a bindings ``DataType``;
- ``addSequence`` with block reuse matches full blocks of the prompt already cached on
  the device under the same cache salt (``prepopulatedPromptLen``), and only then asks the connector
  (``getNumNewMatchedTokens`` with a C++ request copy, never for dummy requests); with
  reuse off the connector is never asked ("The KV Cache Connector will be ignored.");
- ``store_blocks_for_reuse(req, pin=True)`` keeps a request's blocks until unpinned
  (``AsyncTransferManager.start_transfer`` / ``end_transfer``); ``free_resources``
  returns a finished request's blocks, full ones kept (evictable) for reuse.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections import OrderedDict
from typing import Any

import torch

from .request import CppLlmRequest, cpp_copy

__all__ = ["DataType", "KVCacheManager", "OutOfBlocks"]

log = logging.getLogger(__name__)


class DataType(enum.Enum):
    """``tensorrt_llm.bindings.DataType`` (the KV cache's)."""

    FLOAT = "float32"
    HALF = "float16"
    BF16 = "bfloat16"
    FP8 = "fp8"


class OutOfBlocks(RuntimeError):
    """No free block left (the capacity scheduler should not have admitted the request)."""


class KVCacheManager:
    """One rank's KV cache: the primary pool, block allocation and device prefix reuse."""

    def __init__(self, pool: torch.Tensor, *, tokens_per_block: int, num_kv_heads: int, head_dim: int,
                 tp_size: int, kv_factor: int, dtype: DataType, enable_block_reuse: bool, max_seq_len: int = 8192,
                 max_attention_window: list[int] | None = None):
        self._pool = pool
        self.tokens_per_block = int(tokens_per_block)
        self.head_dim = int(head_dim)
        layers = int(pool.shape[1])
        self.num_layers = self.num_local_layers = layers
        per_rank = 1 if kv_factor == 1 else -(-int(num_kv_heads) // int(tp_size))
        self.num_kv_heads_per_layer = [per_rank] * layers
        self.total_num_kv_heads_per_layer = [per_rank] * layers  # per-rank counts, over all layers
        self.kv_factor = int(kv_factor)
        self.dtype = dtype
        self.layer_offsets = {i: i for i in range(layers)}
        self.num_pools = 1
        self.enable_block_reuse = bool(enable_block_reuse)
        # resource_manager.py KVCacheManager.__init__: [max_seq_len] without windows, else
        # each clamped to max_seq_len; several sizes make it VSWA. (Only the attributes: the
        # stand-in's attention never slides a window.)
        self.max_seq_len = int(max_seq_len)
        self.max_attention_window_vec = ([self.max_seq_len] if not max_attention_window
                                         else [min(self.max_seq_len, int(w)) for w in max_attention_window])
        self.is_vswa = len(set(self.max_attention_window_vec)) > 1
        self.max_blocks = int(pool.shape[0])
        self._free: list[int] = list(range(self.max_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._blocks: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}
        self._cached: OrderedDict[tuple, int] = OrderedDict()  # prefix tokens -> block (reusable, LRU)
        self._key_of: dict[int, tuple] = {}
        self._pinned: set[int] = set()
        self._warned = False
        self.ever: set[int] = set()  # every block a request ever held (for byte checks)
        self._at_free: dict[int, bytes] = {}  # block no request holds -> digest of its bytes when let go

    # -- what the connector sees -----------------------------------------------------
    def get_unique_primary_pool(self) -> torch.Tensor:
        return self._pool

    def get_cache_indices(self, request: Any) -> list[int]:
        return list(self._blocks[request.request_id])

    # -- allocation ----------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        """Blocks not held by a live request (free or cached for reuse)."""
        return len(self._free) + sum(1 for b in self._cached.values() if self._refs.get(b, 0) == 0)

    def _take(self) -> int:
        if not self._free:
            for key, b in list(self._cached.items()):  # evict the least recently used unreferenced block
                if self._refs.get(b, 0) == 0:
                    del self._cached[key]
                    self._key_of.pop(b, None)
                    self._free.append(b)
                    break
        if not self._free:
            raise OutOfBlocks(f"all {self.max_blocks} blocks are in use")
        b = self._free.pop()
        self._refs[b] = 1
        self.ever.add(b)
        self._at_free.pop(b, None)
        return b

    def add_sequence(self, request: CppLlmRequest, connector_manager: Any = None) -> None:
        """C++ ``addSequence`` for a request's first context chunk: reuse cached prefix
        blocks, ask the connector (block reuse on, not a dummy request), allocate the
        rest of the prompt, ``setPrepopulatedPromptLen``."""
        tpb, toks = self.tokens_per_block, request.get_tokens(0)
        prompt_len = request.prompt_len
        blocks: list[int] = []
        salt = request.cache_salt_id
        if self.enable_block_reuse:
            for i in range((prompt_len - 1) // tpb):  # full blocks, at least one prompt token left to compute
                key = (salt, tuple(toks[:(i + 1) * tpb]))
                b = self._cached.get(key)
                if b is None:
                    break
                self._cached.move_to_end(key)
                self._refs[b] = self._refs.get(b, 0) + 1
                self._at_free.pop(b, None)
                blocks.append(b)
        prepop = len(blocks) * tpb
        matched = 0
        if connector_manager is not None:
            if not self.enable_block_reuse:
                if not self._warned:
                    log.warning("KV Cache Connector specified when block reuse is disabled. "
                                "The KV Cache Connector will be ignored.")
                    self._warned = True
            elif not request.is_dummy_request:
                matched = int(connector_manager.get_num_new_matched_tokens(cpp_copy(request), prepop))
        while len(blocks) * tpb < prompt_len:
            blocks.append(self._take())
        self._blocks[request.request_id] = blocks
        request._set_prepopulated(prepop + matched, tpb)

    def add_token(self, request: Any, position: int) -> None:
        """Room for a token at ``position`` (a new block when it starts one)."""
        blocks = self._blocks[request.request_id]
        while len(blocks) * self.tokens_per_block <= position:
            blocks.append(self._take())

    def store_blocks_for_reuse(self, request: Any, pin: bool) -> None:
        """The request's full blocks into the reuse cache; ``pin`` keeps them allocated
        until ``unpin``."""
        self._store(request)
        if pin:
            self._pinned.add(request.request_id)

    def _store(self, request: Any) -> None:
        if not self.enable_block_reuse:
            return
        toks, tpb = request.get_tokens(0), self.tokens_per_block
        computed = len(toks) - 1  # the last sampled token has no KV yet
        for i, b in enumerate(self._blocks.get(request.request_id, ())):
            if (i + 1) * tpb > computed:
                break
            key = (request.cache_salt_id, tuple(toks[:(i + 1) * tpb]))  # a cache salt isolates reuse
            if key not in self._cached and b not in self._key_of:
                self._cached[key] = b
                self._key_of[b] = key

    def unpin(self, request_id: int) -> None:
        self._pinned.discard(request_id)

    def is_pinned(self, request_id: int) -> bool:
        return request_id in self._pinned

    def free_resources(self, request: Any) -> None:
        """The request's blocks back: full ones stay cached for reuse."""
        if request.request_id in self._pinned:
            raise RuntimeError(f"request {request.request_id}: blocks pinned by a transfer are freed only after unpin")
        if request.request_id not in self._blocks:
            raise RuntimeError(f"request {request.request_id}: its blocks were already freed")
        self._store(request)
        for b in self._blocks.pop(request.request_id):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._at_free[b] = self._digest(b)
                if b not in self._key_of:
                    del self._refs[b]
                    self._free.append(b)

    def _digest(self, b: int) -> bytes:
        return hashlib.blake2b(self._pool[b].contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).digest()

    def changed_since_freed(self) -> list[int]:
        """Blocks no request holds (free, or cached for reuse) whose bytes changed since
        their last holder let them go: a write that landed after the free. Test
        instrument of the stand-in, not TensorRT-LLM's."""
        return sorted(b for b, d in self._at_free.items() if self._digest(b) != d)

    def holds(self, request_id: int) -> bool:
        return request_id in self._blocks
