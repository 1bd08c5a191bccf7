"""Text <-> token ids for the router: every server gets token ids, so both halves of a
handoff see the same prompt (what a TensorRT-LLM announcement is keyed by), and the cost
gate knows the prompt length before anything is sent.

The tokenizer is the model's (``model.tokenizer``, a Hugging Face folder); chat requests
are rendered with its chat template, or with ``model.chat_template`` from the
configuration. Output text is decoded incrementally (``Detokenizer``).
"""

from __future__ import annotations

from typing import Any, Sequence

from .errors import RouteError

__all__ = ["TextCodec", "Detokenizer"]


class TextCodec:
    """The served model's tokenizer."""

    def __init__(self, tokenizer_dir: str, chat_template: str = ""):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.chat_template = chat_template or None
        self.vocab_size = len(self.tok)

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids (with the tokenizer's special tokens, as engines add them)."""
        return list(self.tok(text)["input_ids"])

    def chat(self, messages: Any) -> list[int]:
        """A chat's prompt ids: its messages rendered by the chat template, with the
        assistant's turn opened."""
        if not isinstance(messages, list) or not messages:
            raise RouteError(400, "bad_request", "'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RouteError(400, "bad_request", f"messages[{i}] needs a string 'role' and a string 'content'")
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


class Detokenizer:
    """Text of a growing id list, delta by delta: each call decodes a short window, and
    holds text back while it ends in an incomplete character."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

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
