"""Gemma 3 270M in JAX, served on fm_jax's engine step.

Modules, one job each:
  files      the cache directory, the packaged GGUF, the unpacked model's place;
  config     the architecture from the GGUF's metadata;
  params     the weights' pytree and the GGUF tensor names;
  unpack     GGUF -> cache (dequantized weights, config, tokenizer tables) and back;
  tokenizer  encode and decode, as transformers reads the GGUF's vocabulary;
  model      the forward over a flat token batch with a slot-indexed KV cache;
  load       the model, weights and tokenizer from the cache (unpacking on first use).
"""
