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
           "decode_handle", "announce_halves", "run_prefill", "stream_decode", "stream_compute", "abort_request",
           "sse_json", "sglang_delta", "trtllm_delta"]

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
    prefill's kvbridge rank endpoints (TP order) when a TensorRT-LLM decode pulls it."""

    room: int
    prefill: ServerSpec
    endpoints: tuple[str, ...] = ()


@dataclass
class Piece:
    """New output tokens from a stream; ``finish`` on the last ("length" | "stop")."""

    ids: list[int]
    finish: str | None = None


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


def trtllm_delta(ev: dict) -> tuple[list[int], str | None, str | None]:
    """(new ids, finish reason, failure) of one trtllm-serve completion (chunk)."""
    choices = ev.get("choices")
    if not isinstance(choices, list):
        return [], None, f"answer without choices: {json.dumps(ev)[:300]}"
    if not choices:  # the usage-only last chunk
        return [], None, None
    c = choices[0]
    ids = c.get("token_ids")
    if ids is None:
        return [], None, "answer without token_ids (is detokenize honoured?)"
    fr = c.get("finish_reason")
    if fr is not None and fr not in ("length", "stop"):
        return [int(t) for t in ids], None, f"finished with {fr!r}"
    return [int(t) for t in ids], fr, None


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


async def _announce(server: Server, ids: list[int], handle, ttl_s: float, timeout_s: float) -> None:
    from kvbridge.adapters.trtllm import AnnounceError, announce

    try:
        await asyncio.to_thread(announce, server.spec.bus, ids, handle, ttl_s=ttl_s,
                                timeout_s=min(5.0, max(0.5, timeout_s)))
    except AnnounceError as e:
        raise EngineError(server, "announce", str(e)) from None


async def announce_halves(prefill: Server, decode: Server, ids: list[int], handoff: Handoff, *, on_failure: str,
                          ttl_s: float, timeout_s: float) -> None:
    """Announce the handoff to whichever halves are TensorRT-LLM servers (decode first,
    so that nothing runs on the prefill for a decode that cannot take it); the server
    keeps each handle ``ttl_s`` (the request's time left)."""
    from kvbridge.adapters.trtllm import Handle

    if decode.engine == "trtllm":
        await _announce(decode, ids, decode_handle(handoff, on_failure), ttl_s, timeout_s)
    if prefill.engine == "trtllm":
        await _announce(prefill, ids, Handle("send", handoff.room), ttl_s, timeout_s)


async def run_prefill(http: aiohttp.ClientSession, server: Server, model: str, ids: list[int], s: Sampling,
                      handoff: Handoff, rid: str) -> None:
    """The prefill half: returns when the server answered (SGLang: after the KV left;
    TensorRT-LLM: after the prompt was computed, the KV then waits for the decode)."""
    if server.engine == "sglang":
        url, body = server.url + "/generate", sglang_generate_body(ids, s, rid=rid, stream=False, handoff=handoff)
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
        _, _, aborted = trtllm_delta(ev)
    if aborted:
        raise EngineError(server, "abort", aborted)


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
                new, finish, aborted = sglang_delta(ev, emitted) if sglang else trtllm_delta(ev)
                if aborted:
                    raise EngineError(server, "abort", aborted)
                emitted += len(new)
                if new or finish:
                    yield Piece(new, finish)
                if finish:
                    finished = True
                    if not sglang:  # trtllm-serve may still send a usage chunk; SGLang ends with [DONE]
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
    return _stream(http, server, server.url + "/v1/completions", trtllm_completion_body(model, ids, s, stream=True))


def stream_compute(http: aiohttp.ClientSession, server: Server, model: str, ids: list[int], s: Sampling,
                   rid: str) -> AsyncIterator[Piece]:
    """The whole request on one server (aggregated, or a TensorRT-LLM decode, unannounced)."""
    if server.engine == "sglang":
        return _stream(http, server, server.url + "/generate", sglang_generate_body(ids, s, rid=rid, stream=True))
    return _stream(http, server, server.url + "/v1/completions", trtllm_completion_body(model, ids, s, stream=True))


async def abort_request(http: aiohttp.ClientSession, server: Server, rid: str) -> None:
    """Ask SGLang to abort ``rid`` (a closed connection does too; this also reaches a
    request still queued). trtllm-serve cancels a request whose connection closes."""
    if server.engine != "sglang":
        return
    try:
        async with http.post(server.url + "/abort_request", json={"rid": rid},
                             timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        log.debug("route: abort_request %s on %s: %s", rid, server.name, e)
