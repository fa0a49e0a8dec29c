"""Gemma 3's text architecture as a GGUF file states it (`gemma3.*` metadata)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np


class GemmaConfig(NamedTuple):
    """The shapes and constants of a Gemma 3 text model (static under jit).

    Attributes:
      vocab: V, the tokenizer's pieces (the tied embedding's rows).
      d_model: residual width.
      n_layers: transformer blocks.
      n_heads, n_kv_heads: query heads and key/value heads (grouped-query attention).
      head_dim: width of one head (queries, keys and values alike).
      d_ff: the gated MLP's hidden width.
      sliding_window: a local layer's token at position p sees positions (p - window, p].
      rope_global_base, rope_local_base: RoPE bases of the global and the local layers.
      global_every: every n-th layer (1-based) is global, the others local.
      norm_eps: the RMS norms' epsilon.
      query_scale: the attention scores' factor (query_pre_attn_scalar ** -0.5).
    """

    vocab: int = 262144
    d_model: int = 640
    n_layers: int = 18
    n_heads: int = 4
    n_kv_heads: int = 1
    head_dim: int = 256
    d_ff: int = 2048
    sliding_window: int = 512
    rope_global_base: float = 1e6
    rope_local_base: float = 1e4
    global_every: int = 6
    norm_eps: float = 1e-6
    query_scale: float = 256**-0.5

    def is_global(self, layer: int) -> bool:
        """Whether block `layer` (0-based) attends globally (else within the sliding window)."""
        return (layer + 1) % self.global_every == 0

    def rope_inv_freq(self, layer: int) -> np.ndarray:
        """[head_dim / 2] float32 inverse frequencies of block `layer`'s RoPE."""
        base = self.rope_global_base if self.is_global(layer) else self.rope_local_base
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float32) / np.float32(self.head_dim)
        return (np.float32(1.0) / np.power(np.float32(base), exponents)).astype(np.float32)


# Gemma 3 facts the GGUF leaves out; llama.cpp and transformers both fix them so: local
# layers' RoPE base 10000, every sixth layer global, scores scaled by head_dim ** -0.5
# (query_pre_attn_scalar = 256 = head_dim for the 270M model).
_ARCH = "gemma3"


def config_from_metadata(meta: Mapping[str, Any], vocab: int) -> GemmaConfig:
    """The config from a GGUF's key-value metadata (`general.architecture` must be gemma3)."""
    arch = meta.get("general.architecture")
    if arch != _ARCH:
        raise ValueError(f"expected a {_ARCH} GGUF, got architecture {arch!r}")

    def get(key: str) -> Any:
        return meta[f"{_ARCH}.{key}"]

    head_dim = int(get("attention.key_length"))
    if int(get("attention.value_length")) != head_dim:
        raise ValueError("key and value head widths differ; this model assumes they match")
    return GemmaConfig(
        vocab=vocab,
        d_model=int(get("embedding_length")),
        n_layers=int(get("block_count")),
        n_heads=int(get("attention.head_count")),
        n_kv_heads=int(get("attention.head_count_kv")),
        head_dim=head_dim,
        d_ff=int(get("feed_forward_length")),
        sliding_window=int(get("attention.sliding_window")),
        rope_global_base=float(get("rope.freq_base")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        query_scale=float(head_dim) ** -0.5,
    )
