"""Each engine's request shapes, and the calls that send them.

SGLang (0.5.23's ``/generate``): the prefill and the decode half get the same body with
``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` naming the prefill's bootstrap
server and the room; an aggregated server gets it without them. Streams are SSE events
``data: {"output_ids": [...], "meta_info": {...}}`` (cumulative ids by default,
deltas with ``--incremental-streaming-output``; both are read), then ``data: [DONE]``;
an abort is a ``finish_reason`` of type ``abort``.

TensorRT-LLM (``trtllm-serve``'s ``/v1/completions`` with the kvbridge connector, see
adapters/trtllm/README.md): the router announces each half's handle to that server's
bus under the prompt's token ids (``kvbridge.adapters.trtllm.announce``), then sends an
ordinary completion with the ids as the prompt: ``max_tokens: 1`` to a prefill, the real
request to a decode. ``detokenize: false`` makes trtllm-serve answer ``token_ids``
(``CompletionResponseChoice.token_ids`` / ``CompletionResponseStreamChoice.token_ids`` in
``tensorrt_llm/serve/postprocess_handlers.py``); a finish reason other than ``length``
or ``stop`` (``cancelled``: the connector's ``fail`` policy) is a failure. A TensorRT-LLM
decode given an unannounced prompt computes it itself.

vLLM (its OpenAI server's ``/v1/completions`` with the kvbridge connector, see
adapters/vllm/handle.py): each half carries its handle in ``kv_transfer_params``: a
prefill ``{"kvbridge": {"op": "send", "room": R}}`` with ``max_tokens: 1`` (its answer's
``kv_transfer_params`` is the decode half's handle, naming its bootstrap server), a
decode ``{"kvbridge": {"op": "recv", "room": R, "bootstrap": "host:port"}}`` naming the
prefill's SGLang(-compatible) bootstrap server (a vLLM or SGLang prefill, or TensorRT-LLM's
``sglang_bootstrap_port``), or ``"endpoints"`` (a TensorRT-LLM prefill known only by its
bus). ``return_token_ids: true`` makes vLLM answer ``token_ids`` per choice (deltas when
streamed: ``CompletionResponseStreamChoice.token_ids`` in
``vllm/entrypoints/openai/completion/protocol.py``). vLLM checks the ``model`` field
against its served names (``ServerSpec.model``). A vLLM decode given no handle computes
the prompt itself; a closed connection aborts its request.

Every call raises ``EngineError`` (the server, a short ``code`` and what happened).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp

from .config import ServerSpec
from .pool import Server

__all__ = ["EngineError", "Handoff", "Piece", "Sampling", "sglang_generate_body", "trtllm_completion_body",
           "vllm_completion_body", "vllm_handle_params", "check_vllm_prefill_answer", "decode_handle", "announce_halves", "run_prefill", "stream_decode", "stream_compute", "abort_request",
           "sse_json", "sglang_delta", "completion_delta", "trtllm_delta"]

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """One server's half of a request failed. ``code``: ``connect`` (nothing reached the
    server), ``http`` (an error status), ``abort`` (the engine aborted or cancelled it),
    ``disconnect`` (the connection broke mid-answer), ``timeout``, ``announce``, ``bad_answer``."""

    def __init__(self, server: Server | ServerSpec, code: str, message: str):
        self.server = server
        self.code = code
        name = server.name
        super().__init__(f"{name}: {message}")


@dataclass(frozen=True)
class Sampling:
    """What the client asked for, engine-neutral."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Handoff:
    """One try at moving a request's KV: its room, the prefill it comes from, and that
    prefill's kvbridge rank endpoints (TP order) when a TensorRT-LLM decode pulls it, or
    a vLLM decode a prefill that has no bootstrap server."""

    room: int
    prefill: ServerSpec
    endpoints: tuple[str, ...] = ()


@dataclass
class Piece:
    """New output tokens from a stream; ``finish`` on the last ("length" | "stop"). The
    dispatcher adds their ``text`` and the stop string that ended the answer (``matched``)."""

    ids: list[int]
    finish: str | None = None
    text: str = ""
    matched: str | None = None


# -- request bodies (pure) ------------------------------------------------------------


def _sglang_sampling(s: Sampling, max_tokens: int | None = None) -> dict:
    sp: dict[str, Any] = {"max_new_tokens": int(max_tokens if max_tokens is not None else s.max_tokens),
                          "temperature": float(s.temperature), "top_p": float(s.top_p), "top_k": int(s.top_k),
                          "ignore_eos": bool(s.ignore_eos)}
    if s.stop:
        sp["stop"] = list(s.stop)
    if s.seed is not None:
        sp["sampling_seed"] = int(s.seed)
    return sp


def sglang_generate_body(ids: list[int], s: Sampling, *, rid: str, stream: bool, handoff: Handoff | None = None) -> dict:
    """SGLang ``/generate``: token ids, sampling, and (disaggregated) the prefill's
    bootstrap address and room."""
    body: dict[str, Any] = {"input_ids": list(ids), "sampling_params": _sglang_sampling(s), "stream": bool(stream),
                            "rid": rid}
    if handoff is not None:
        host, port = handoff.prefill.bootstrap.rsplit(":", 1)
        body.update(bootstrap_host=host, bootstrap_port=int(port), bootstrap_room=int(handoff.room))
    return body


def trtllm_completion_body(model: str, ids: list[int], s: Sampling, *, stream: bool, max_tokens: int | None = None) -> dict:
    """trtllm-serve ``/v1/completions`` with token ids as the prompt, answering token ids."""
    body: dict[str, Any] = {"model": model, "prompt": list(ids),
                            "max_tokens": int(max_tokens if max_tokens is not None else s.max_tokens),
                            "temperature": float(s.temperature), "top_p": float(s.top_p),
                            "top_k": max(0, int(s.top_k)), "ignore_eos": bool(s.ignore_eos), "stream": bool(stream),
                            "detokenize": False}
    if s.stop:
        body["stop"] = list(s.stop)
    if s.seed is not None:
        body["seed"] = int(s.seed)
    return body


def vllm_completion_body(model: str, ids: list[int], s: Sampling, *, stream: bool, max_tokens: int | None = None,
                         params: dict | None = None) -> dict:
    """vLLM ``/v1/completions`` with token ids as the prompt, answering token ids;
    ``params``: the half's ``kv_transfer_params`` (none: vLLM computes the request itself)."""
    body: dict[str, Any] = {"model": model, "prompt": list(ids),
                            "max_tokens": int(max_tokens if max_tokens is not None else s.max_tokens),
                            "temperature": float(s.temperature), "top_p": float(s.top_p),
                            "top_k": max(0, int(s.top_k)), "ignore_eos": bool(s.ignore_eos), "stream": bool(stream),
                            "return_token_ids": True}
    if s.stop:
        body["stop"] = list(s.stop)
    if s.seed is not None:
        body["seed"] = int(s.seed)
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def vllm_handle_params(handoff: Handoff, op: str) -> dict:
    """The ``kv_transfer_params`` of a vLLM half: ``send`` (prefill), or ``recv`` naming the
    prefill's bootstrap server (else its rank endpoints, which the router looked up)."""
    from kvbridge.adapters.vllm.handle import Handle, to_params

    if op == "send":
        return to_params(Handle("send", handoff.room))
    if handoff.prefill.bootstrap:
        return to_params(Handle("recv", handoff.room, bootstrap=handoff.prefill.bootstrap))
    return to_params(Handle("recv", handoff.room, endpoints=tuple(handoff.endpoints)))


def check_vllm_prefill_answer(ev: dict, room: int) -> str | None:
    """Why a vLLM prefill's answer shows that it did not take the handoff, or None: its
    ``kv_transfer_params`` must carry the decode half's handle for ``room`` (a server
    without the kvbridge connector ignores the request's and answers none)."""
    from kvbridge.adapters.vllm.handle import HandleError, handle_of

    params = ev.get("kv_transfer_params")
    try:
        h = handle_of(params)
    except HandleError as e:
        return f"its kv_transfer_params are not a kvbridge handle: {e}"
    if h is None:
        return (f"its answer carries no kvbridge handle (kv_transfer_params {json.dumps(params)[:200]}): "
                "is the kvbridge connector on, with a kv_role that produces?")
    if h.op != "recv" or h.room != room:
        return f"its answer's handle is for {h.op} room {h.room}, not recv room {room}"
    return None


def decode_handle(handoff: Handoff, on_failure: str):
    """The ``recv`` handle a TensorRT-LLM decode is announced: pull from the prefill's
    rank endpoints when the router knows them, else from a TensorRT-LLM prefill found
    through its bus, or an SGLang(-compatible) one through its bootstrap server."""
    from kvbridge.adapters.trtllm import Handle

    p = handoff.prefill
    if handoff.endpoints:
        return Handle("recv", handoff.room, endpoints=tuple(handoff.endpoints), on_failure=on_failure)
    if p.engine == "trtllm":
        return Handle("recv", handoff.room, prefill=p.bus, on_failure=on_failure)
    return Handle("recv", handoff.room, bootstrap=p.bootstrap, on_failure=on_failure)


# -- stream parsing (pure) --------------------------------------------------------------


def sse_json(line: bytes) -> dict | None | bool:
    """One SSE line: its JSON payload, True for ``[DONE]``, None for anything else."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return True
    try:
        out = json.loads(data)
    except ValueError:
        return None
    return out if isinstance(out, dict) else None


def _error_text(ev: dict) -> str:
    err = ev.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)[:2000]
    return str(err)[:2000]


def sglang_delta(ev: dict, emitted: int) -> tuple[list[int], str | None, str | None]:
    """(new ids, finish type, abort message) of one SGLang ``/generate`` answer, given the
    ids already taken: cumulative answers (``len(output_ids) == completion_tokens``) give
    their tail, incremental ones their ids."""
    ids = ev.get("output_ids") or []
    mi = ev.get("meta_info") or {}
    n = mi.get("completion_tokens")
    new = [int(t) for t in (ids[emitted:] if isinstance(n, int) and len(ids) == n and n >= emitted else ids)]
    fr = mi.get("finish_reason")
    if isinstance(fr, dict):
        kind = str(fr.get("type") or "")
        if kind == "abort":
            return new, None, str(fr.get("message") or fr)[:2000]
        return new, kind or "stop", None
    return new, None, None


def completion_delta(ev: dict) -> tuple[list[int], str | None, str | None]:
    """(new ids, finish reason, failure) of one OpenAI completion (chunk) with
    ``token_ids`` per choice: trtllm-serve (``detokenize: false``) or vLLM
    (``return_token_ids``)."""
    choices = ev.get("choices")
    if not isinstance(choices, list):
        return [], None, f"answer without choices: {json.dumps(ev)[:300]}"
    if not choices:  # the usage-only last chunk
        return [], None, None
    c = choices[0]
    ids = c.get("token_ids")
    if ids is None:
        return [], None, "answer without token_ids (is detokenize: false / return_token_ids honoured?)"
    fr = c.get("finish_reason")
    if fr is not None and fr not in ("length", "stop"):
        return [int(t) for t in ids], None, f"finished with {fr!r}"
    return [int(t) for t in ids], fr, None


trtllm_delta = completion_delta


# -- calls ------------------------------------------------------------------------------


def _client_error(server: Server, e: BaseException) -> EngineError:
    if isinstance(e, aiohttp.ClientConnectorError):
        return EngineError(server, "connect", f"cannot connect: {e}")
    if isinstance(e, asyncio.TimeoutError):
        return EngineError(server, "timeout", "no answer in time")
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
        return EngineError(server, "disconnect", f"connection lost: {type(e).__name__}: {e}")
    return EngineError(server, "http", f"{type(e).__name__}: {e}")


async def _status_error(server: Server, r: aiohttp.ClientResponse) -> EngineError:
    try:
        text = (await r.text())[:1000]
    except Exception:  # the body is only for the message
        text = ""
    return EngineError(server, "http", f"HTTP {r.status}: {text}")


async def _announce(server: Server, ids: list[int], handle, ttl_s: float, timeout_s: float, keyring) -> None:
    from kvbridge.adapters.trtllm import AnnounceError, announce

    try:
        await asyncio.to_thread(announce, server.spec.bus, ids, handle, ttl_s=ttl_s,
                                timeout_s=min(5.0, max(0.5, timeout_s)), keyring=keyring)
    except AnnounceError as e:
        raise EngineError(server, "announce", str(e)) from None


async def announce_halves(prefill: Server, decode: Server, ids: list[int], handoff: Handoff, *, on_failure: str,
                          ttl_s: float, timeout_s: float, keyring=None) -> None:
    """Announce the handoff to whichever halves are TensorRT-LLM servers (decode first,
    so that nothing runs on the prefill for a decode that cannot take it); the server
    keeps each handle ``ttl_s`` (the request's time left); ``keyring``: the servers' key."""
    from kvbridge.adapters.trtllm import Handle

    if decode.engine == "trtllm":
        await _announce(decode, ids, decode_handle(handoff, on_failure), ttl_s, timeout_s, keyring)
    if prefill.engine == "trtllm":
        await _announce(prefill, ids, Handle("send", handoff.room), ttl_s, timeout_s, keyring)


async def run_prefill(http: aiohttp.ClientSession, server: Server, model: str, ids: list[int], s: Sampling,
                      handoff: Handoff, rid: str) -> None:
    """The prefill half: returns when the server answered (SGLang: after the KV left;
    TensorRT-LLM, vLLM: after the prompt was computed, the KV then waits for the decode)."""
    if server.engine == "sglang":
        url, body = server.url + "/generate", sglang_generate_body(ids, s, rid=rid, stream=False, handoff=handoff)
    elif server.engine == "vllm":
        url, body = server.url + "/v1/completions", vllm_completion_body(
            model, ids, s, stream=False, max_tokens=1, params=vllm_handle_params(handoff, "send"))
    else:
        url, body = server.url + "/v1/completions", trtllm_completion_body(model, ids, s, stream=False, max_tokens=1)
    try:
        async with http.post(url, json=body) as r:
            if r.status != 200:
                raise await _status_error(server, r)
            ev = await r.json(content_type=None)
    except EngineError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise _client_error(server, e) from None
    if not isinstance(ev, dict):
        raise EngineError(server, "bad_answer", f"answer is not a JSON object: {str(ev)[:300]}")
    if "error" in ev:
        raise EngineError(server, "http", _error_text(ev))
    if server.engine == "sglang":
        _, _, aborted = sglang_delta(ev, 0)
    else:
        _, _, aborted = completion_delta(ev)
    if aborted:
        raise EngineError(server, "abort", aborted)
    if server.engine == "vllm":
        refused = check_vllm_prefill_answer(ev, handoff.room)
        if refused:
            raise EngineError(server, "bad_answer", refused)


async def _stream(http: aiohttp.ClientSession, server: Server, url: str, body: dict) -> AsyncIterator[Piece]:
    sglang = server.engine == "sglang"
    emitted, finished = 0, False
    try:
        async with http.post(url, json=body) as r:
            if r.status != 200:
                raise await _status_error(server, r)
            async for line in r.content:
                ev = sse_json(line)
                if ev is None:
                    continue
                if ev is True:
                    break
                if "error" in ev:
                    raise EngineError(server, "abort", _error_text(ev))
                new, finish, aborted = sglang_delta(ev, emitted) if sglang else completion_delta(ev)
                if aborted:
                    raise EngineError(server, "abort", aborted)
                emitted += len(new)
                if new or finish:
                    yield Piece(new, finish)
                if finish:
                    finished = True
                    if not sglang:  # trtllm-serve, vLLM may still send a usage chunk; SGLang ends with [DONE]
                        break
    except EngineError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise _client_error(server, e) from None
    if not finished:
        raise EngineError(server, "disconnect", f"stream ended after {emitted} token(s) without a finish reason")


def stream_decode(http: aiohttp.ClientSession, server: Server, model: str, ids: list[int], s: Sampling,
                  handoff: Handoff, rid: str) -> AsyncIterator[Piece]:
    """The decode half, streamed (its announcement, for TensorRT-LLM, is made before)."""
    if server.engine == "sglang":
        return _stream(http, server, server.url + "/generate",
                       sglang_generate_body(ids, s, rid=rid, stream=True, handoff=handoff))
    if server.engine == "vllm":
        return _stream(http, server, server.url + "/v1/completions",
                       vllm_completion_body(model, ids, s, stream=True, params=vllm_handle_params(handoff, "recv")))
    return _stream(http, server, server.url + "/v1/completions", trtllm_completion_body(model, ids, s, stream=True))


def stream_compute(http: aiohttp.ClientSession, server: Server, model: str, ids: list[int], s: Sampling,
                   rid: str) -> AsyncIterator[Piece]:
    """The whole request on one server (aggregated, or a TensorRT-LLM or vLLM decode
    given no handle)."""
    if server.engine == "sglang":
        return _stream(http, server, server.url + "/generate", sglang_generate_body(ids, s, rid=rid, stream=True))
    if server.engine == "vllm":
        return _stream(http, server, server.url + "/v1/completions", vllm_completion_body(model, ids, s, stream=True))
    return _stream(http, server, server.url + "/v1/completions", trtllm_completion_body(model, ids, s, stream=True))


async def abort_request(http: aiohttp.ClientSession, server: Server, rid: str) -> None:
    """Ask SGLang to abort ``rid`` (a closed connection does too; this also reaches a
    request still queued). trtllm-serve and vLLM cancel a request whose connection closes."""
    if server.engine != "sglang":
        return
    try:
        async with http.post(server.url + "/abort_request", json={"rid": rid},
                             timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        log.debug("route: abort_request %s on %s: %s", rid, server.name, e)
