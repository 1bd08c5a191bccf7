"""The SGLang adapter: real pools, scheduler ranks and server pairs on CPU."""
