"""TensorRT-LLM's request objects as the connector meets them: the C++ ``LlmRequest``
binding and the PyTorch backend's Python subclass.

Facts modelled (NVIDIA/TensorRT-LLM; commits in ``versions.py``):

- ``cpp/tensorrt_llm/nanobind/batch_manager/bindings.cpp`` (``nb::class_<GenLlmReq>``):
  only the names bound there exist on the C++ object. Read-write fields (``def_rw``):
  ``request_id, prompt_len, max_new_tokens, end_id, pad_id, seq_slot``; read-write
  properties (``def_prop_rw``): ``state, context_current_position, context_chunk_size,
  is_dummy_request, draft_tokens, streaming``; everything else modelled here is
  read-only (``def_prop_ro``: assigning raises AttributeError), among them
  ``orig_prompt_len, prepopulated_prompt_len, context_phase_params,
  is_context_only_request, is_generation_only_request, llm_request_type,
  is_context_finished, is_finished, context_remaining_length, is_first_context_chunk,
  is_last_context_chunk, cache_salt_id, lora_task_id``. ``client_id`` is a constructor
  argument, not a property. Methods: ``get_tokens(beam)``, ``get_num_tokens(beam)``,
  ``add_new_token``, ``add_new_tokens``, ``move_to_next_context_chunk``.
- ``nb::class_<tb::LlmRequest, GenLlmReq>(..., nb::dynamic_attr())`` with a copy
  constructor: ``kvCacheConnector.cpp``'s trampoline hands ``get_num_new_matched_tokens``
  a ``tb::LlmRequest const&``, which nanobind casts with ``rv_policy::copy``: Python gets a
  NEW object of the bound base type. It has no ``py_*`` attribute; new attributes can be
  set (dynamic_attr) but land on the copy only.
- ``_torch/pyexecutor/llm_request.py``: the Python ``LlmRequest`` subclasses the binding,
  sets ``py_*`` attributes (1.2: no ``py_disaggregated_params``; main: it has one, and
  ``cache_salt``), and defines ``is_generation_only_request`` as a METHOD (on the C++
  object it is a bool property; a bound method is always truthy).
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

__all__ = ["LlmRequestState", "LlmRequestType", "CppLlmRequest", "PyLlmRequest", "ContextPhaseParams",
           "cpp_copy"]


class LlmRequestState(enum.IntEnum):
    """``tensorrt_llm.bindings.LlmRequestState`` (the members the executor uses)."""

    UNKNOWN = 0
    ENCODER_INIT = 1
    DISAGG_GENERATION_INIT = 8
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 9
    CONTEXT_INIT = 10
    GENERATION_IN_PROGRESS = 13
    GENERATION_TO_COMPLETE = 14
    GENERATION_COMPLETE = 20
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 21
    DISAGG_CONTEXT_COMPLETE = 22
    DISAGG_GENERATION_TRANS_COMPLETE = 23
    DISAGG_TRANS_ERROR = -1


class LlmRequestType(enum.IntEnum):
    """``tensorrt_llm.bindings.internal.batch_manager.LlmRequestType``."""

    LLMREQUEST_TYPE_CONTEXT_AND_GENERATION = 0
    LLMREQUEST_TYPE_CONTEXT_ONLY = 1
    LLMREQUEST_TYPE_GENERATION_ONLY = 2


class ContextPhaseParams:
    """``tensorrt_llm.bindings.executor.ContextPhaseParams``: every field read-only."""

    __slots__ = ("_f",)

    def __init__(self, first_gen_tokens: Sequence[int], req_id: int, opaque_state: bytes | None = None,
                 draft_tokens: Sequence[int] | None = None):
        object.__setattr__(self, "_f", (list(first_gen_tokens), int(req_id), opaque_state, draft_tokens))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ContextPhaseParams.{name} is read-only")

    first_gen_tokens = property(lambda self: list(self._f[0]))
    req_id = property(lambda self: self._f[1])
    opaque_state = property(lambda self: self._f[2])
    draft_tokens = property(lambda self: self._f[3])


class _Core:
    """The C++ request's state (what a copy copies)."""

    __slots__ = ("request_id", "prompt_len", "max_new_tokens", "end_id", "pad_id", "seq_slot", "tokens", "state",
                 "context_current_position", "context_chunk_size", "orig_prompt_len", "prepopulated_prompt_len",
                 "llm_request_type", "context_phase_params", "cache_salt_id", "lora_task_id", "is_dummy_request",
                 "streaming", "draft_tokens", "client_id", "finish_reason")

    def copy(self) -> "_Core":
        c = _Core()
        for name in self.__slots__:
            v = getattr(self, name)
            setattr(c, name, list(v) if isinstance(v, list) else v)
        return c


def _rw(name: str) -> property:
    return property(lambda self: getattr(self._core, name), lambda self, v: setattr(self._core, name, v),
                    doc=f"read-write binding ``{name}``")


def _ro(name: str) -> property:
    return property(lambda self: getattr(self._core, name), doc=f"read-only binding ``{name}``")


class CppLlmRequest:
    """The C++ ``LlmRequest`` as nanobind exposes it (``tensorrt_llm.bindings.internal.
    batch_manager.LlmRequest``): the bound names only. Instances carry a ``__dict__``
    (``nb::dynamic_attr``), so unbound attributes may be SET, but none exist until then."""

    def __init__(self, other: "CppLlmRequest | None" = None, *, request_id: int = 0,
                 input_tokens: Sequence[int] = (), max_new_tokens: int = 1, end_id: int = -1, pad_id: int = -1,
                 llm_request_type: LlmRequestType = LlmRequestType.LLMREQUEST_TYPE_CONTEXT_AND_GENERATION,
                 context_phase_params: ContextPhaseParams | None = None, cache_salt_id: int = 0,
                 client_id: int | None = None):
        if other is not None:  # nb::init<tb::LlmRequest const&>(): the copy constructor
            object.__setattr__(self, "_core", other._core.copy())
            return
        c = _Core()
        c.request_id, c.prompt_len, c.max_new_tokens = int(request_id), len(input_tokens), int(max_new_tokens)
        c.end_id, c.pad_id, c.seq_slot = int(end_id), int(pad_id), None
        c.tokens = [int(t) for t in input_tokens]
        c.state = (LlmRequestState.DISAGG_GENERATION_INIT
                   if llm_request_type == LlmRequestType.LLMREQUEST_TYPE_GENERATION_ONLY else LlmRequestState.CONTEXT_INIT)
        c.context_current_position, c.context_chunk_size = 0, len(input_tokens)
        c.orig_prompt_len, c.prepopulated_prompt_len = len(input_tokens), 0
        c.llm_request_type, c.context_phase_params = LlmRequestType(llm_request_type), context_phase_params
        c.cache_salt_id, c.lora_task_id, c.is_dummy_request, c.streaming = int(cache_salt_id), None, False, False
        c.draft_tokens, c.client_id, c.finish_reason = None, client_id, None
        object.__setattr__(self, "_core", c)

    # read-write fields (def_rw) and properties (def_prop_rw)
    request_id = _rw("request_id")
    prompt_len = _rw("prompt_len")
    max_new_tokens = _rw("max_new_tokens")
    end_id = _rw("end_id")
    pad_id = _rw("pad_id")
    seq_slot = _rw("seq_slot")
    state = _rw("state")
    context_current_position = _rw("context_current_position")
    @property
    def context_chunk_size(self) -> int:
        return self._core.context_chunk_size

    @context_chunk_size.setter
    def context_chunk_size(self, size: int) -> None:
        """C++ ``setContextChunkSize``: context phase only, clamped to what is left."""
        c = self._core
        if c.state != LlmRequestState.CONTEXT_INIT:
            raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: setContextChunkSize is only possible during "
                               "the context phase.")
        if size < 0:
            raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: The chunk size of context ({size}) can't be negative.")
        c.context_chunk_size = min(int(size), c.prompt_len - c.context_current_position)

    is_dummy_request = _rw("is_dummy_request")
    streaming = _rw("streaming")
    draft_tokens = _rw("draft_tokens")
    # read-only (def_prop_ro)
    orig_prompt_len = _ro("orig_prompt_len")
    prepopulated_prompt_len = _ro("prepopulated_prompt_len")
    context_phase_params = _ro("context_phase_params")
    llm_request_type = _ro("llm_request_type")
    cache_salt_id = _ro("cache_salt_id")
    lora_task_id = _ro("lora_task_id")

    @property
    def is_context_only_request(self) -> bool:
        return self._core.llm_request_type == LlmRequestType.LLMREQUEST_TYPE_CONTEXT_ONLY

    @property
    def is_generation_only_request(self) -> bool:
        return self._core.llm_request_type == LlmRequestType.LLMREQUEST_TYPE_GENERATION_ONLY

    @property
    def context_remaining_length(self) -> int:
        return self._core.prompt_len - self._core.context_current_position

    @property
    def is_context_finished(self) -> bool:
        return self._core.context_current_position >= self._core.prompt_len

    @property
    def is_first_context_chunk(self) -> bool:
        return self._core.context_current_position == self._core.prepopulated_prompt_len

    @property
    def is_last_context_chunk(self) -> bool:
        c = self._core
        return c.context_current_position + c.context_chunk_size >= c.prompt_len

    @property
    def is_finished(self) -> bool:
        return self._core.state == LlmRequestState.GENERATION_COMPLETE

    # methods
    def get_tokens(self, beam: int | None = None):
        """Tokens of beam ``beam`` (prompt, then generated); all beams without it."""
        return list(self._core.tokens) if beam is not None else [list(self._core.tokens)]

    def get_num_tokens(self, beam: int) -> int:
        return len(self._core.tokens)

    def add_new_token(self, token: int, beam: int) -> None:
        self._core.tokens.append(int(token))

    def add_new_tokens(self, beam_tokens: Sequence[int]) -> None:
        self._core.tokens.extend(int(t) for t in beam_tokens)

    def move_to_next_context_chunk(self) -> None:
        """C++ ``moveToNextContextChunk``: past this chunk; the chunk size goes back to 0."""
        c = self._core
        c.context_current_position += c.context_chunk_size
        c.context_chunk_size = 0

    def _set_prepopulated(self, n: int, tokens_per_block: int) -> None:
        """C++ ``setPrepopulatedPromptLen`` (the KV cache manager's call, not bound): the
        context starts at ``n``; a chunk that does not reach the end is cut back to a block
        boundary, and the chunk never exceeds what is left."""
        c = self._core
        if not 0 <= n < c.prompt_len:
            raise RuntimeError(f"[TensorRT-LLM][ERROR] Invalid state: prepopulatedPromptLen ({n}) >= promptLen "
                               f"({c.prompt_len}) for request {c.request_id}")
        c.prepopulated_prompt_len = int(n)
        if n > 0:
            chunk = c.context_chunk_size
            if n + chunk < c.prompt_len:
                chunk = (n + chunk) // tokens_per_block * tokens_per_block - n
            c.context_current_position = int(n)
            c.context_chunk_size = min(chunk, c.prompt_len - n)

    def _finish(self, reason: str) -> None:
        """C++ ``finishByReason`` (the executor's call)."""
        self._core.finish_reason = reason
        self._core.state = LlmRequestState.GENERATION_COMPLETE


class PyLlmRequest(CppLlmRequest):
    """``tensorrt_llm._torch.pyexecutor.llm_request.LlmRequest`` of one engine version:
    the binding plus ``py_*`` attributes; ``is_generation_only_request`` is a method."""

    def __init__(self, *, version: Any, request_id: int, input_tokens: Sequence[int], max_new_tokens: int,
                 llm_request_type: LlmRequestType = LlmRequestType.LLMREQUEST_TYPE_CONTEXT_AND_GENERATION,
                 context_phase_params: ContextPhaseParams | None = None, cache_salt: str | None = None,
                 disaggregated_params: Any = None, end_id: int = -1, client_id: int | None = None):
        super().__init__(request_id=request_id, input_tokens=input_tokens, max_new_tokens=max_new_tokens, end_id=end_id,
                         llm_request_type=llm_request_type, context_phase_params=context_phase_params,
                         cache_salt_id=_salt_id(cache_salt), client_id=client_id)
        self.py_request_id = request_id
        self.py_client_id = client_id if client_id is not None else request_id
        self.py_llm_request_type = LlmRequestType(llm_request_type)
        self.py_prompt_len = len(input_tokens)
        self.py_orig_prompt_len = len(input_tokens)
        self.py_max_new_tokens = max_new_tokens
        self.py_end_id = end_id
        self.py_seq_slot = None
        self.py_batch_idx = None
        self.py_draft_tokens = []
        self.py_decoding_iter = 0
        self.py_return_log_probs = False
        self.py_kv_transfer_start_time = None
        self.py_kv_transfer_timed_out = False
        self.py_result = None
        if version.py_disaggregated_params:  # main copies the executor request's params
            self.py_disaggregated_params = disaggregated_params
            self.cache_salt = cache_salt

    def is_generation_only_request(self) -> bool:  # noqa: D401 - a method on the Python request
        """True for a generation-only request (a METHOD here, a property on the C++ object)."""
        return self.py_llm_request_type == LlmRequestType.LLMREQUEST_TYPE_GENERATION_ONLY


def _salt_id(salt: str | None) -> int:
    """A cache salt's id (TensorRT-LLM hashes the salt string; any stable 64-bit hash models it)."""
    if not salt:
        return 0
    import hashlib

    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def cpp_copy(request: CppLlmRequest) -> CppLlmRequest:
    """What ``get_num_new_matched_tokens`` receives: a new C++-typed copy of ``request``."""
    return CppLlmRequest(request)
