"""The tiny models moved into the library (``kvbridge.demo.models``); the tests import
them from here as before."""

from kvbridge.demo.models import (  # noqa: F401
    BOS_ID,
    EOS_ID,
    FIRST_WORD_ID,
    LLAMA_DEFAULTS,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    Reference,
    build_tiny_llama,
    build_tiny_mla,
    load_model,
    random_prompt,
    reference_generate,
)

_load = load_model
