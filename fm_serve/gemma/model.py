"""Gemma 3's forward in JAX over a flat token batch, with a KV cache indexed by request slot.

Token t belongs to slot `token_slots[t]` at position `positions[t]` of that slot's sequence.
Each block writes the batch's keys and values into the cache at (slot, position) first, then
every token attends to its own slot's cache: positions up to its own in a global block, the
last `sliding_window` of them in a local block. Slot 0 is the padding slot: padding tokens
write there and nothing live reads it.

The block, as the GGUF and transformers define it: RMS norm, grouped-query attention with
RMS-normed queries and keys and RoPE (the local or global base), RMS norm of its output,
residual; RMS norm, gated GELU (tanh) MLP, RMS norm of its output, residual. The embedding
is scaled by sqrt(d_model) and tied to the LM head. Every matmul and row norm runs on fixed
row tiles (`tiles.by_tiles`), so a row's logits do not depend on the rest of the batch.

The forward computes in the weights' dtype (float32, or bfloat16: `fm-serve-bench --dtype
bfloat16`): activations, matmuls and the KV cache (`GemmaModel.dtype`, which must be the
params' dtype). RMS norms, RoPE, the attention scores and softmax run in float32 and cast
back (transformers runs its norms and softmax in float32 too); the logits come back as
float32 for sampling. In float32 every cast is the identity: the float32 forward is the
plain float32 one, bit for bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_serve.gemma.config import GemmaConfig
from fm_serve.gemma.params import Blocks, GemmaParams
from fm_serve.tiles import by_tiles, dense


class KVCache(NamedTuple):
    """Keys and values of every slot: [n_layers, R, S, n_kv_heads, head_dim]; row 0 pads."""

    k: jax.Array
    v: jax.Array


class GemmaModel(NamedTuple):
    """A Gemma 3 model as the serving loop runs it (hashable: a static jit argument).

    Attributes:
      cfg: the architecture.
      max_seq_len: S, KV cache positions per slot (prompt + output must fit).
      row_tile: rows per matmul tile; every batch and token bucket is a multiple of it.
      stop_ids: tokens that end a request (end of sequence, end of turn); may be empty.
      dtype: the compute and KV cache dtype, "float32" or "bfloat16": the params' dtype.
    """

    cfg: GemmaConfig
    max_seq_len: int = 512
    row_tile: int = 8
    stop_ids: tuple[int, ...] = (1,)
    dtype: str = "float32"

    @property
    def vocab(self) -> int:
        """Token ids are in [0, vocab)."""
        return self.cfg.vocab

    def init_cache(self, pool_size: int) -> KVCache:
        """A zeroed KV cache with one row per request-pool slot."""
        c = self.cfg
        shape = (c.n_layers, pool_size, self.max_seq_len, c.n_kv_heads, c.head_dim)
        dt = jnp.dtype(self.dtype)
        return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))

    def forward(
        self,
        params: GemmaParams,
        cache: KVCache,
        input_ids: jax.Array,
        token_slots: jax.Array,
        positions: jax.Array,
        last_token: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        """The logits [B, V] float32 of each row's last token, and the updated cache.

        Args:
          params: the weights (`load.load_model`).
          cache: the slot-indexed KV cache (written in place when the caller donates it).
          input_ids: [T] token ids in [0, V).
          token_slots: [T] each token's slot; 0 for padding tokens.
          positions: [T] each token's position in its slot's sequence, in [0, S).
          last_token: [B] index into the T tokens of each row's last token.
        """
        return _forward(self, params, cache, input_ids, token_slots, positions, last_token)


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, times `scale` (the GGUF's multiplier); computed in
    float32, returned in x's dtype."""
    xf, f32 = x.astype(jnp.float32), jnp.float32
    out = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * scale.astype(f32)
    return out.astype(x.dtype)


def _rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding of x [T, heads, D] by halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s);
    computed in float32, returned in x's dtype."""
    dtype, x = x.dtype, x.astype(jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(dtype)


def _layer_tables(cfg: GemmaConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per block: RoPE inverse frequencies [L, D/2] and the attention window [L] (global:
    a window past any position)."""
    inv_freq = np.stack([cfg.rope_inv_freq(i) for i in range(cfg.n_layers)])
    window = np.array(
        [2**30 if cfg.is_global(i) else cfg.sliding_window for i in range(cfg.n_layers)],
        np.int32,
    )
    return inv_freq, window


def _forward(
    m: GemmaModel,
    params: GemmaParams,
    cache: KVCache,
    input_ids: jax.Array,
    token_slots: jax.Array,
    positions: jax.Array,
    last_token: jax.Array,
) -> tuple[jax.Array, KVCache]:
    c, tile = m.cfg, m.row_tile
    t = input_ids.shape[0]
    h, kvh, hd = c.n_heads, c.n_kv_heads, c.head_dim
    groups = h // kvh
    eps = c.norm_eps
    dt = params.embed.dtype
    if cache.k.dtype != dt:
        raise ValueError(f"the KV cache is {cache.k.dtype}, the params {dt}: set GemmaModel.dtype")

    def norm(x: jax.Array, scale: jax.Array) -> jax.Array:
        return by_tiles(lambda a: _rms_norm(a, scale, eps), x, tile)

    x = params.embed[input_ids] * jnp.asarray(np.sqrt(c.d_model), dt)
    span = jnp.arange(m.max_seq_len)[None, :]  # [1, S]
    causal = span <= positions[:, None]  # [T, S]: within the token's own slot
    inv_freq, window = _layer_tables(c)

    Carry = tuple[jax.Array, jax.Array, jax.Array]  # residual, keys, values

    def block(carry: Carry, layer: tuple[Any, Blocks, Any, Any]) -> tuple[Carry, None]:
        x, k_all, v_all = carry
        i, w, freq, win = layer
        a = norm(x, w.attn_norm)
        q = norm(dense(a, w.wq, tile).reshape(t, h, hd), w.q_norm)
        k = norm(dense(a, w.wk, tile).reshape(t, kvh, hd), w.k_norm)
        v = dense(a, w.wv, tile).reshape(t, kvh, hd)
        q, k = _rope(q, positions, freq), _rope(k, positions, freq)
        k_all = k_all.at[i, token_slots, positions].set(k)
        v_all = v_all.at[i, token_slots, positions].set(v)
        keys = k_all[i, token_slots]  # [T, S, kvh, D]: each token's own slot
        values = v_all[i, token_slots]
        qg = q.reshape(t, kvh, groups, hd)
        scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys, preferred_element_type=jnp.float32)
        scores = scores * jnp.float32(c.query_scale)
        visible = causal & (span > positions[:, None] - win)  # [T, S]
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        attn = jnp.einsum("tkgs,tskd->tkgd", probs, values)
        x = x + norm(dense(attn.reshape(t, h * hd), w.wo, tile), w.post_attn_norm)
        f = norm(x, w.ffn_norm)
        gated = jax.nn.gelu(dense(f, w.w_gate, tile), approximate=True) * dense(f, w.w_up, tile)
        x = x + norm(dense(gated, w.w_down, tile), w.post_ffn_norm)
        return (x, k_all, v_all), None

    layers = (jnp.arange(c.n_layers), params.blocks, jnp.asarray(inv_freq), jnp.asarray(window))
    (x, k_all, v_all), _ = jax.lax.scan(block, (x, cache.k, cache.v), layers)
    last = norm(x[last_token], params.final_norm)
    head = lambda a: jnp.matmul(a, params.embed.T, preferred_element_type=jnp.float32)  # noqa: E731
    logits = by_tiles(head, last, tile)
    return logits, KVCache(k_all, v_all)
