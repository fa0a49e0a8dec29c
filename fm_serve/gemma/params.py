"""The Gemma 3 weights as the JAX model takes them: a pytree of stacked per-block arrays."""

from __future__ import annotations

from typing import Any, NamedTuple


class Blocks(NamedTuple):
    """Every block's weights stacked on a leading [n_layers] axis; matrices are [in, out].

    Norm scales are the GGUF's: the multiplier itself (Gemma's `1 + w` already added in).
    """

    attn_norm: Any  # [L, d]
    wq: Any  # [L, d, n_heads * head_dim]
    wk: Any  # [L, d, n_kv_heads * head_dim]
    wv: Any  # [L, d, n_kv_heads * head_dim]
    q_norm: Any  # [L, head_dim]
    k_norm: Any  # [L, head_dim]
    wo: Any  # [L, n_heads * head_dim, d]
    post_attn_norm: Any  # [L, d]
    ffn_norm: Any  # [L, d]
    w_gate: Any  # [L, d, d_ff]
    w_up: Any  # [L, d, d_ff]
    w_down: Any  # [L, d_ff, d]
    post_ffn_norm: Any  # [L, d]


class GemmaParams(NamedTuple):
    """All weights: the tied embedding (also the LM head), the blocks and the final norm."""

    embed: Any  # [V, d]
    blocks: Blocks
    final_norm: Any  # [d]


# GGUF tensor name (per block: `blk.{i}.` + name) of each field; matrices are stored
# [out, in] in numpy order and transposed once, when the GGUF is unpacked.
GGUF_BLOCK_NAMES = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
    "wo": "attn_output",
    "post_attn_norm": "post_attention_norm",
    "ffn_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
    "post_ffn_norm": "post_ffw_norm",
}
MATRICES = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})
