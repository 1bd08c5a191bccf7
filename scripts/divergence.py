"""Where an engine's greedy output left transformers' one, and what kind of error that was.

For a failing token comparison (a handoff test's ``got`` against ``generate()``): the first
divergent step and its top-1/top-2 margin; whether transformers, given the engine's tokens
up to and including the divergent one, goes on exactly as the engine did (then the error
was confined to that one step: the KV the engine kept afterwards was right), and which
single context position, masked out at that step alone, makes transformers pick the
engine's token (position 0 is the first prompt token, the first slot of the first block).

Usage: python scripts/divergence.py MODEL_DIR PROMPT_JSON GOT_JSON
  e.g. python scripts/divergence.py /tmp/model "$(python -c 'from kvbridge.demo.models import random_prompt;
  print(random_prompt(33, seed=933))')" "[64, 292, 150, 479, 204, 261, 185, 4, 264, 131, 107, 116]"
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main(model_dir: str, prompt: list[int], got: list[int]) -> dict:
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = m.generate(torch.tensor([prompt]), max_new_tokens=len(got), min_new_tokens=len(got),
                         do_sample=False)[0, len(prompt):].tolist()
        k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if k is None:
            return {"diverges": None}
        ctx = prompt + got[:k]  # the divergent step reads ctx[:-1] from its cache and computes ctx[-1]
        logits = m(torch.tensor([ctx])).logits[0, -1]
        top = logits.topk(2)
        rest = m.generate(torch.tensor([prompt + got[:k + 1]]), max_new_tokens=len(got) - k - 1,
                          min_new_tokens=len(got) - k - 1, do_sample=False)[0, len(prompt) + k + 1:].tolist()
        past = m(torch.tensor([ctx[:-1]]), use_cache=True).past_key_values
        flips = []
        for p in range(len(ctx)):  # one context position masked at the divergent step only
            am = torch.ones(1, len(ctx), dtype=torch.long)
            am[0, p] = 0
            o = m(torch.tensor([ctx[-1:]]), past_key_values=copy.deepcopy(past), attention_mask=am,
                  position_ids=torch.tensor([[len(ctx) - 1]]))
            if int(o.logits[0, -1].argmax()) == got[k]:
                flips.append(p)
    return {"diverges": k, "ref": ref, "margin": round(float(top.values[0] - top.values[1]), 4),
            "engine_then_matches_transformers": rest == got[k + 1:], "masked_positions_giving_engine_token": flips}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]))))
