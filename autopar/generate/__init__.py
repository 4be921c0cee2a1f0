"""Generation for causal LMs: the decode loop and its KV cache (`loop`), a plan per phase (`phases`),
and generation planned without the hardware (`plan`)."""
