"""A completion through ``kvbridge route`` with the ``openai`` client, for the router tests."""

from __future__ import annotations


def complete(client, prompt, *, stream: bool, max_tokens: int, **extra) -> tuple[list[int], dict]:
    """(token ids, the router's ``kvbridge`` object) of one greedy completion of ``prompt``
    (token ids) on the model ``tiny-llama``; streamed: the ids of every chunk, in order."""
    args = dict(model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0, **extra)
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        return [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]], chunks[0].model_extra["kvbridge"]
    r = client.completions.create(**args)
    return r.choices[0].model_extra["token_ids"], r.model_extra["kvbridge"]
