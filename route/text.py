"""Text <-> token ids for the router: every server gets token ids, so both halves of a
handoff see the same prompt (what a TensorRT-LLM announcement is keyed by), and the cost
gate knows the prompt length before anything is sent.

The tokenizer is the model's (``model.tokenizer``, a Hugging Face folder); chat requests
are rendered with its chat template, or with ``model.chat_template`` from the
configuration. Output text is decoded incrementally (``Detokenizer``) after the prompt's
last ids, as SGLang and vLLM decode it (a word's leading space included); ``Answer`` ends
it where the engines do: at the first stop string (trimmed unless the client asks for
it) and, for a server that does not stop there itself, at the end-of-sequence token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from .errors import RouteError

__all__ = ["TextCodec", "Detokenizer", "Answer", "PROMPT_CONTEXT"]

# prompt ids decoded before the output, as SGLang (INIT_INCREMENTAL_DETOKENIZATION_OFFSET) and vLLM do
PROMPT_CONTEXT = 5


class TextCodec:
    """The served model's tokenizer."""

    def __init__(self, tokenizer_dir: str, chat_template: str = ""):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.chat_template = chat_template or None
        self.vocab_size = len(self.tok)
        self.eos_ids = _eos_ids(self.tok, tokenizer_dir)

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids (with the tokenizer's special tokens, as engines add them)."""
        return list(self.tok(text)["input_ids"])

    def chat(self, messages: Any) -> list[int]:
        """A chat's prompt ids: its messages rendered by the chat template, with the
        assistant's turn opened."""
        if not isinstance(messages, list) or not messages:
            raise RouteError(400, "bad_request", "'messages' must be a non-empty list")
        messages = [_message(i, m) for i, m in enumerate(messages)]
        if self.chat_template is None and not getattr(self.tok, "chat_template", None):
            raise RouteError(400, "bad_request", "the model's tokenizer has no chat template and the route configuration "
                                                 "sets none (model.chat_template)")
        try:
            text = self.tok.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                add_generation_prompt=True)
        except Exception as e:  # a template error names the cause
            raise RouteError(400, "bad_request", f"chat template: {type(e).__name__}: {e}") from None
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def check_ids(self, ids: Sequence[Any], what: str = "prompt") -> list[int]:
        """Token ids as given by a client: ints inside the vocabulary."""
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise RouteError(400, "bad_request", f"{what}[{i}] = {t!r} is not a token id of this model "
                                                     f"(0..{self.vocab_size - 1})")
            out.append(int(t))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def _eos_ids(tok, folder: str) -> frozenset[int]:
    """The model's end-of-sequence ids: the tokenizer's and ``generation_config.json``'s."""
    out = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    try:
        gen = json.loads((Path(folder) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        gen = None
    out.update(gen if isinstance(gen, list) else [gen] if isinstance(gen, int) else [])
    return frozenset(int(t) for t in out)


def _message(i: int, m: Any) -> dict:
    """One chat message with its content as one string: a string, or a list of
    ``{"type": "text", "text": ...}`` parts joined with newlines (as vLLM renders them
    for a template that takes strings)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RouteError(400, "bad_request", f"messages[{i}] needs a string 'role'")
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RouteError(400, "bad_request", f"messages[{i}].content[{j}]: only text parts "
                                                     f"({{\"type\": \"text\", \"text\": ...}}) are served, not {kind!r}")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise RouteError(400, "bad_request", f"messages[{i}] needs a 'content': a string or a list of text parts")
    return {**m, "content": content}


class Detokenizer:
    """Text of a growing id list, delta by delta: each call decodes a short window, and
    holds text back while it ends in an incomplete character. ``context``: prompt ids
    decoded before it (their text is not part of the output)."""

    def __init__(self, codec: TextCodec, context: Sequence[int] = ()):
        self.codec = codec
        self.ids: list[int] = list(context)
        self._prefix = 0
        self._read = len(self.ids)

    def add(self, new: Sequence[int]) -> str:
        """The text the ids ``new`` add."""
        self.ids.extend(new)
        before = self.codec.decode(self.ids[self._prefix:self._read])
        after = self.codec.decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is held back, at the end."""
        before = self.codec.decode(self.ids[self._prefix:self._read])
        after = self.codec.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):]


class Answer:
    """One answer's ids and text, piece by piece, ended as the engines end it: at the first
    stop string (the text cut before it, or after it with ``include_stop``; the ids kept up
    to the token that completed it, as SGLang and vLLM keep them) and, when ``eos_ids`` is
    set (a server that does not stop there itself), after the first end-of-sequence id.
    While stop strings are set, the text that could start one is held back."""

    def __init__(self, codec: TextCodec, prompt: Sequence[int], stops: Sequence[str] = (), include_stop: bool = False):
        self.codec = codec
        self.detok = Detokenizer(codec, list(prompt)[-PROMPT_CONTEXT:])
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self.eos_ids: frozenset[int] = frozenset()
        self.text = ""  # every character decoded so far
        self.sent = 0  # of which the caller has had this many
        self.matched: str | None = None
        self.done = False
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def end_at_eos(self, on: bool) -> None:
        """End the answer after the model's first end-of-sequence id (or not)."""
        self.eos_ids = self.codec.eos_ids if on else frozenset()

    def _stopped(self, start: int) -> bool:
        """Whether a stop string (the first in the client's order) occurs in the text from
        ``start`` on; if so the text is cut there and the answer is done."""
        for stop in self.stops:
            i = self.text.find(stop, max(0, start - len(stop) + 1))
            if i >= 0:
                self.matched, self.done = stop, True
                self.text = self.text[:i + len(stop)] if self.include_stop else self.text[:i]
                return True
        return False

    def add(self, ids: Sequence[int], finish: str | None) -> tuple[list[int], str, str | None]:
        """(the ids kept, the text to send now, the finish reason) of one piece."""
        kept: list[int] = []
        for t in ids:
            if self.done:
                break
            kept.append(int(t))
            before = len(self.text)
            self.text += self.detok.add([t])
            if self._stopped(before) or int(t) in self.eos_ids:
                self.done, finish = True, "stop"
        if finish is not None and self.matched is None:  # the end: what the detokenizer held back
            self.done = True
            before = len(self.text)
            self.text += self.detok.flush()
            if self._stopped(before):
                finish = "stop"
        end = len(self.text) if self.done else max(self.sent, len(self.text) - self._hold)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return kept, out, finish
