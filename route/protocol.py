"""The router's public request and response shapes: OpenAI ``/v1/completions`` and
``/v1/chat/completions``, and SGLang's ``/generate``. Pure functions, no I/O.

Requests are checked here and turned into token ids plus ``Sampling``; a parameter the
router cannot pass on to every engine is refused with 400 naming it (never silently
dropped). Responses carry, besides the OpenAI fields, ``token_ids`` in each choice (as
trtllm-serve and vLLM do), the stop string that ended the answer as vLLM reports it
(``stop_reason`` in the choice; SGLang's ``finish_reason.matched`` for ``/generate``) and
a ``kvbridge`` object saying how the request was served.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .engines import Sampling
from .errors import RouteError
from .text import TextCodec

__all__ = ["Parsed", "parse_completion", "parse_chat", "parse_generate", "Formatter"]

# OpenAI fields accepted and not acted on (they change nothing in the output; the app checks ``model``)
_IGNORED = {"model", "user", "stream_options", "service_tier", "metadata", "store"}
_OPENAI_SAMPLING = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop", "seed", "ignore_eos",
                    "stream", "n", "echo", "logprobs", "presence_penalty", "frequency_penalty", "best_of", "suffix",
                    "include_stop_str_in_output"}


@dataclass
class Parsed:
    """A request's prompt ids, sampling and answer options. ``max_given``: whether the
    client set the token limit (else the default, which the router lowers to what the
    context leaves); ``include_stop``: keep the matched stop string in the text."""

    ids: list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool = False
    include_stop: bool = False
    max_given: bool = True


def _bad(msg: str) -> RouteError:
    return RouteError(400, "bad_request", msg)


def _num(body: dict, key: str, default, kind=float, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise _bad(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(f"'{key}' = {v} is out of range [{lo}, {hi}]")
    return kind(v)


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v) and len(v) <= 16:
        return tuple(v)
    raise _bad("'stop' must be a string or a list of up to 16 strings")


def _openai_sampling(body: dict, default_max: int) -> Sampling:
    extra = sorted(set(body) - _OPENAI_SAMPLING - _IGNORED - {"prompt", "messages"})
    if extra:
        raise _bad(f"unsupported parameter(s) {extra}: the router passes on only {sorted(_OPENAI_SAMPLING)}")
    if _num(body, "n", 1, int, 1, 1) != 1 or body.get("best_of") not in (None, 1):
        raise _bad("'n' and 'best_of' must be 1: one choice per request")
    if body.get("echo") or body.get("logprobs") or body.get("suffix"):
        raise _bad("'echo', 'logprobs' and 'suffix' are not supported by the router")
    for k in ("presence_penalty", "frequency_penalty"):
        if _num(body, k, 0.0) != 0.0:
            raise _bad(f"'{k}' is not supported by the router")
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = default_max if mt is None else _num({"max_tokens": mt}, "max_tokens", default_max, int, 1, 1 << 20)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("'seed' must be an integer")
    return Sampling(max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0, float, 0.0, 2.0),
                    top_p=_num(body, "top_p", 1.0, float, 0.0, 1.0), top_k=_num(body, "top_k", -1, int, -1, None),
                    ignore_eos=bool(body.get("ignore_eos", False)), stop=_stop(body.get("stop")), seed=seed)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be true or false")
    return v


def _max_given(body: dict) -> bool:
    return body.get("max_completion_tokens", body.get("max_tokens")) is not None


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise _bad("'stream_options' must be an object")
    return stream, bool(so.get("include_usage")) and stream


def parse_completion(body: Any, codec: TextCodec) -> Parsed:
    """``/v1/completions``: one prompt, a string or token ids."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = codec.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = codec.check_ids(prompt)
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return parse_completion({**body, "prompt": prompt[0]}, codec)
    else:
        raise _bad("'prompt' must be one string or one list of token ids (one prompt per request)")
    if not ids:
        raise _bad("the prompt is empty")
    stream, usage = _stream_flags(body)
    return Parsed(ids, _openai_sampling(body, 16), stream, usage, _flag(body, "include_stop_str_in_output"),
                  _max_given(body))


def parse_chat(body: Any, codec: TextCodec) -> Parsed:
    """``/v1/chat/completions``: messages rendered with the chat template."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    ids = codec.chat(body.get("messages"))
    stream, usage = _stream_flags(body)
    return Parsed(ids, _openai_sampling(body, 256), stream, usage, _flag(body, "include_stop_str_in_output"),
                  _max_given(body))


_SGLANG_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos", "stop", "sampling_seed",
                    "no_stop_trim"}


def parse_generate(body: Any, codec: TextCodec) -> Parsed:
    """SGLang's ``/generate``: ``text`` or ``input_ids`` (one), ``sampling_params``, ``stream``."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    extra = sorted(set(body) - {"text", "input_ids", "sampling_params", "stream", "rid"})
    if extra:
        raise _bad(f"unsupported /generate field(s) {extra}")
    if isinstance(body.get("text"), str) and "input_ids" not in body:
        ids = codec.encode(body["text"])
    elif isinstance(body.get("input_ids"), list) and "text" not in body:
        ids = codec.check_ids(body["input_ids"], "input_ids")
    else:
        raise _bad("give one of 'text' (a string) or 'input_ids' (a list of token ids): one prompt per request")
    if not ids:
        raise _bad("the prompt is empty")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise _bad("'sampling_params' must be an object")
    extra = sorted(set(sp) - _SGLANG_SAMPLING)
    if extra:
        raise _bad(f"unsupported sampling_params {extra}: the router passes on only {sorted(_SGLANG_SAMPLING)}")
    seed = sp.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("'sampling_seed' must be an integer")
    s = Sampling(max_tokens=_num(sp, "max_new_tokens", 128, int, 1, 1 << 20),
                 temperature=_num(sp, "temperature", 1.0, float, 0.0, 2.0), top_p=_num(sp, "top_p", 1.0, float, 0.0, 1.0),
                 top_k=_num(sp, "top_k", -1, int, -1, None), ignore_eos=bool(sp.get("ignore_eos", False)),
                 stop=_stop(sp.get("stop")), seed=seed)
    return Parsed(ids, s, _flag(body, "stream"), include_stop=_flag(sp, "no_stop_trim"),
                  max_given=sp.get("max_new_tokens") is not None)


class Formatter:
    """Response bodies of one request, for one of the three APIs (``kind``:
    ``completion`` | ``chat`` | ``generate``)."""

    def __init__(self, kind: str, rid: str, model: str, prompt_len: int):
        self.kind, self.rid, self.model, self.prompt_len = kind, rid, model, prompt_len
        self.created = int(time.time())
        self._ids: list[int] = []
        self._text = ""

    def _usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_len, "completion_tokens": n, "total_tokens": self.prompt_len + n}

    @staticmethod
    def _finish(finish: str | None, matched: str | None) -> dict | None:
        if not finish:
            return None
        return {"type": finish, "matched": matched} if matched is not None else {"type": finish}

    def chunk(self, ids: list[int], text: str, finish: str | None, info: dict | None = None, first: bool = False,
              matched: str | None = None) -> dict:
        """One streamed event (``matched``: the stop string that ended the answer)."""
        self._ids += ids
        self._text += text
        if self.kind == "generate":
            meta = {"id": self.rid, "prompt_tokens": self.prompt_len, "completion_tokens": len(self._ids),
                    "finish_reason": self._finish(finish, matched)}
            if info is not None:
                meta["kvbridge"] = info
            return {"text": self._text, "output_ids": list(self._ids), "meta_info": meta}
        stop_reason = {"stop_reason": matched} if finish else {}
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            out = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "delta": delta, "token_ids": ids, "logprobs": None, "finish_reason": finish,
                                **stop_reason}]}
        else:
            out = {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": finish,
                                **stop_reason}]}
        if info is not None:
            out["kvbridge"] = info
        return out

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": self._usage(len(self._ids))}

    def whole(self, ids: list[int], text: str, finish: str, info: dict, matched: str | None = None) -> dict:
        """The non-streamed answer."""
        if self.kind == "generate":
            return {"text": text, "output_ids": ids,
                    "meta_info": {"id": self.rid, "prompt_tokens": self.prompt_len, "completion_tokens": len(ids),
                                  "finish_reason": self._finish(finish, matched), "kvbridge": info}}
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "token_ids": ids, "logprobs": None,
                      "finish_reason": finish, "stop_reason": matched}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": finish,
                      "stop_reason": matched}
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": [choice],
                "usage": self._usage(len(ids)), "kvbridge": info}
