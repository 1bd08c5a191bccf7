"""Requests through ``kvbridge route`` with the ``openai`` client, for the router tests,
and the checks every decode engine behind it must pass alike (stop strings, EOS,
refusals before any server is asked, model names, chat content parts, JSON errors).

Expected texts are the tiny word-level tokenizer's words (``w<id>``) as SGLang and vLLM
detokenize an output: each word after a space (the prompt's last ids are decoded before
it), the stop string cut off, nothing of the end-of-sequence token.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

EOS_ID = 2  # kvbridge.demo.models.EOS_ID
EOS_PROMPT = (40, 262)  # random_prompt(40, seed=262): the tiny Llama's greedy answer has EOS as its 2nd token


def complete(client, prompt, *, stream: bool, max_tokens: int, **extra) -> tuple[list[int], dict]:
    """(token ids, the router's ``kvbridge`` object) of one greedy completion of ``prompt``
    (token ids) on the model ``tiny-llama``; streamed: the ids of every chunk, in order."""
    args = dict(model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0, **extra)
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        return [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]], chunks[0].model_extra["kvbridge"]
    r = client.completions.create(**args)
    return r.choices[0].model_extra["token_ids"], r.model_extra["kvbridge"]


def client_of(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="kvbridge", max_retries=0, timeout=120)


def words(ids) -> str:
    """The text SGLang and vLLM answer for output ids ``ids`` of the tiny tokenizer."""
    return "".join(f" w{t}" for t in ids if t > 3)


def stop_at(ref: list[int], start: int = 2) -> int:
    """An index k >= start whose word first occurs at k in the answer's text (so a stop
    string of that word ends the answer at token k)."""
    for k in range(start, len(ref)):
        if ref[k] > 3 and f"w{ref[k]}" not in words(ref[:k]):
            return k
    raise AssertionError(f"no usable stop word in {ref}")


def _streamed(client, create, args) -> tuple[str, list[int], object]:
    chunks = [c for c in create(stream=True, **args) if c.choices]
    if create == client.chat.completions.create:
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        text = "".join(c.choices[0].text for c in chunks)
    return text, [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []], chunks[-1].choices[0]


def check_stop_strings(client, prompt: list[int], ref: list[int], *, model: str = "tiny-llama",
                       chat: bool = True) -> str:
    """Stop strings as the engines answer them, streamed and not: the text up to the
    stop (with it when ``include_stop_str_in_output``), the ids up to the token that
    completed it, ``finish_reason`` stop and the stop in ``stop_reason``; the same for a
    chat (the deployment's template: each message's content and a space). The stop."""
    k = stop_at(ref)
    stop = f"w{ref[k]}"
    for include in (False, True):
        want = words(ref[:k]) + (" " + stop if include else " ")
        args = dict(model=model, prompt=prompt, max_tokens=len(ref), temperature=0, stop=["never said", stop],
                    extra_body={"include_stop_str_in_output": True} if include else None)
        ch = client.completions.create(**args).choices[0]
        got = (ch.text, ch.finish_reason, ch.model_extra.get("stop_reason"), ch.model_extra.get("token_ids"))
        assert got == (want, "stop", stop, ref[:k + 1]), (got, ref, include)
        text, ids, last = _streamed(client, client.completions.create, args)
        assert (text, ids, last.finish_reason, last.model_extra.get("stop_reason")) == (want, ref[:k + 1], "stop", stop), \
            (text, ids, last, ref, include)
    if chat:
        args = dict(model=model, messages=[{"role": "user", "content": " ".join(f"w{t}" for t in prompt)}],
                    max_tokens=len(ref), temperature=0, stop=stop)
        ch = client.chat.completions.create(**args).choices[0]
        assert (ch.message.content, ch.finish_reason, ch.model_extra.get("token_ids")) == (
            words(ref[:k]) + " ", "stop", ref[:k + 1]), (ch, ref)
        text, ids, last = _streamed(client, client.chat.completions.create, args)
        assert (text, ids, last.finish_reason) == (words(ref[:k]) + " ", ref[:k + 1], "stop"), (text, ids, last, ref)
    return stop


def check_eos(client, prompt: list[int], ref: list[int], *, model: str = "tiny-llama") -> None:
    """An answer ends at the end-of-sequence token unless ``ignore_eos``: its ids up to and
    with it, ``finish_reason`` stop, no text for it; streamed and not."""
    k = ref.index(EOS_ID)
    args = dict(model=model, prompt=prompt, max_tokens=len(ref), temperature=0)
    ch = client.completions.create(**args).choices[0]
    assert (ch.text, ch.finish_reason, ch.model_extra.get("token_ids")) == (words(ref[:k]), "stop", ref[:k + 1]), (ch, ref)
    text, ids, last = _streamed(client, client.completions.create, args)
    assert (text, ids, last.finish_reason) == (words(ref[:k]), ref[:k + 1], "stop"), (text, ids, last, ref)
    ch = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0]
    assert ch.model_extra.get("token_ids") == ref and ch.finish_reason == "length", (ch, ref)


def check_refusals(client, context: int, *, model: str = "tiny-llama") -> None:
    """Requests the model cannot serve are 400s naming the numbers: a prompt over the
    context, prompt + ``max_tokens`` over it, an absurd ``max_tokens``; an unknown model
    is a 404."""
    import openai

    cases = [(dict(prompt=[5] * (context + 52), max_tokens=4), (str(context), str(context + 56))),
             (dict(prompt=[5] * (context - 8), max_tokens=16), (str(context), str(context + 8))),
             (dict(prompt=[5, 6, 7], max_tokens=1_000_000), (str(context), "1000003"))]
    for kw, needles in cases:
        try:
            client.completions.create(model=model, temperature=0, **kw)
        except openai.BadRequestError as e:
            msg = e.body.get("message") if isinstance(e.body, dict) else str(e)
            assert all(n in msg for n in needles), (msg, needles)
            assert e.body.get("param") == "max_tokens", e.body
        else:
            raise AssertionError(f"not refused: {len(kw['prompt'])} prompt ids, max_tokens {kw['max_tokens']}")
    try:
        client.completions.create(model="no-such-model", prompt=[5, 6, 7], max_tokens=2, temperature=0)
    except openai.NotFoundError as e:
        assert "no-such-model" in str(e), e
    else:
        raise AssertionError("an unknown model was served")


def check_openai_surface(url: str, prompt: list[int], ref: list[int], *, alias: str) -> None:
    """Chat content as a list of text parts is the same chat as a string; the model's
    alias is served and listed; an unknown path and a wrong method answer JSON errors."""
    client = client_of(url)
    text = " ".join(f"w{t}" for t in prompt)
    parts = [{"type": "text", "text": text}]
    a = client.chat.completions.create(model=alias, messages=[{"role": "user", "content": parts}],
                                       max_tokens=len(ref), temperature=0, extra_body={"ignore_eos": True})
    assert a.choices[0].model_extra["token_ids"] == ref and a.choices[0].message.content == words(ref), a
    assert alias in [m.id for m in client.models.list().data]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for method, path, status in (("GET", "/v1/no-such-path", 404), ("GET", "/v1/completions", 405),
                                 ("POST", "/v1/responses", 404)):
        req = urllib.request.Request(url + path, b"{}" if method == "POST" else None, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            opener.open(req, timeout=30)
            raise AssertionError(f"{method} {path} answered 200")
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
            assert e.code == status and e.headers.get("Content-Type", "").startswith("application/json"), (e.code, body)
            assert body["error"]["message"], body
