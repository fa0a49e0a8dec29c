"""A small decoder-only transformer with a KV cache indexed by request-pool slot.

The forward takes a flat token layout: token t belongs to slot `token_slots[t]` and sits at
position `positions[t]` of that slot's sequence. Each layer first writes the batch's K/V into
the cache at (slot, position), then every token attends to its own slot's cache up to its
position, so a prefill chunk sees its earlier chunks and itself. Slot 0 is the padding slot:
padding tokens write there and nothing live reads it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_serve.config import ModelConfig
from fm_serve.tiles import by_tiles, dense


class Layer(NamedTuple):
    """Weights of one pre-norm transformer block."""

    attn_norm: jax.Array  # [d]
    wqkv: jax.Array  # [d, 3d]
    wo: jax.Array  # [d, d]
    mlp_norm: jax.Array  # [d]
    w_in: jax.Array  # [d, ff]
    w_out: jax.Array  # [ff, d]


class Params(NamedTuple):
    """All weights: embeddings, blocks, final norm and LM head."""

    embed: jax.Array  # [V, d]
    pos_embed: jax.Array  # [S, d]
    layers: tuple[Layer, ...]
    final_norm: jax.Array  # [d]
    lm_head: jax.Array  # [d, V]


class KVCache(NamedTuple):
    """Keys and values of every slot: [n_layers, R, S, n_heads, head_dim]; row 0 pads."""

    k: jax.Array
    v: jax.Array


class ToyModel(NamedTuple):
    """The toy transformer as the serving loop runs it (`served.ServedModel`)."""

    cfg: ModelConfig

    @property
    def vocab(self) -> int:
        """Token ids are in [0, vocab)."""
        return self.cfg.vocab

    @property
    def max_seq_len(self) -> int:
        """KV cache positions per slot."""
        return self.cfg.max_seq_len

    @property
    def row_tile(self) -> int:
        """Rows per matmul tile."""
        return self.cfg.row_tile

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The end-of-sequence token."""
        return (self.cfg.eos_id,)

    def init_cache(self, pool_size: int) -> KVCache:
        """A zeroed KV cache with one row per request-pool slot."""
        return init_cache(self.cfg, pool_size)

    def forward(
        self,
        params: Params,
        cache: KVCache,
        input_ids: jax.Array,
        token_slots: jax.Array,
        positions: jax.Array,
        last_token: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        """Logits [B, V] of each row's last token and the updated cache (see `forward`)."""
        return forward(params, self.cfg, cache, input_ids, token_slots, positions, last_token)


def toy(cfg: ModelConfig) -> tuple[ToyModel, Params]:
    """The toy model of `cfg` and its random weights, as `Engine(model, params, ...)` takes them."""
    return ToyModel(cfg), init_params(cfg)


def init_params(cfg: ModelConfig) -> Params:
    """Random weights from `cfg.seed` (scaled normal, unit norms): deterministic per config.

    Drawn with numpy on the host (no PRNG kernels to compile), then put on the device.
    """
    d, ff = cfg.d_model, cfg.d_ff
    rng = np.random.default_rng(cfg.seed)

    def normal(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        w = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))
        return jnp.asarray(w)

    layers = tuple(
        Layer(
            attn_norm=jnp.ones((d,), jnp.float32),
            wqkv=normal((d, 3 * d), d),
            wo=normal((d, d), d),
            mlp_norm=jnp.ones((d,), jnp.float32),
            w_in=normal((d, ff), d),
            w_out=normal((ff, d), ff),
        )
        for _ in range(cfg.n_layers)
    )
    return Params(
        embed=normal((cfg.vocab, d), 1),
        pos_embed=normal((cfg.max_seq_len, d), 4),
        layers=layers,
        final_norm=jnp.ones((d,), jnp.float32),
        lm_head=normal((d, cfg.vocab), d),
    )


def init_cache(cfg: ModelConfig, pool_size: int) -> KVCache:
    """A zeroed KV cache with one row per request-pool slot."""
    shape = (cfg.n_layers, pool_size, cfg.max_seq_len, cfg.n_heads, cfg.head_dim)
    return KVCache(*(jnp.zeros(shape, jnp.float32) for _ in range(2)))


def rms_norm(x: jax.Array, scale: jax.Array, row_tile: int) -> jax.Array:
    """RMS normalisation of each row of x, batch-invariant (see `tiles.by_tiles`)."""

    def norm(a: jax.Array) -> jax.Array:
        return a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + 1e-6) * scale

    return by_tiles(norm, x, row_tile)


def forward(
    params: Params,
    cfg: ModelConfig,
    cache: KVCache,
    input_ids: jax.Array,
    token_slots: jax.Array,
    positions: jax.Array,
    last_token: jax.Array,
) -> tuple[jax.Array, KVCache]:
    """Run the flat batch through the model and return the logits of each row's last token.

    Args:
      params, cfg: the model.
      cache: the slot-indexed KV cache (written in place when the caller donates it).
      input_ids: [T] token ids, all >= 0 (placeholders already resolved).
      token_slots: [T] the slot of each token; 0 for padding tokens.
      positions: [T] each token's position in its slot's sequence, in [0, S).
      last_token: [B] index into the T tokens of each row's last token (sampling point).

    Returns:
      (logits [B, V] float32 with the EOS bias applied, updated cache).
    """
    t = input_ids.shape[0]
    h, hd, s, tile = cfg.n_heads, cfg.head_dim, cfg.max_seq_len, cfg.row_tile
    x = params.embed[input_ids] + params.pos_embed[positions]
    visible = jnp.arange(s)[None, :] <= positions[:, None]  # [T, S]: causal within the slot
    k_all, v_all = cache.k, cache.v
    for i, layer in enumerate(params.layers):
        qkv = dense(rms_norm(x, layer.attn_norm, tile), layer.wqkv, tile)
        q, k, v = (a.reshape(t, h, hd) for a in jnp.split(qkv, 3, axis=-1))
        k_all = k_all.at[i, token_slots, positions].set(k)
        v_all = v_all.at[i, token_slots, positions].set(v)
        keys = k_all[i, token_slots]  # [T, S, H, D]: each token's own slot
        values = v_all[i, token_slots]
        scores = jnp.einsum("thd,tshd->ths", q, keys) / jnp.sqrt(float(hd))
        scores = jnp.where(visible[:, None, :], scores, -jnp.inf)
        attn = jnp.einsum("ths,tshd->thd", jax.nn.softmax(scores, axis=-1), values)
        x = x + dense(attn.reshape(t, h * hd), layer.wo, tile)
        hidden = jax.nn.gelu(dense(rms_norm(x, layer.mlp_norm, tile), layer.w_in, tile))
        x = x + dense(hidden, layer.w_out, tile)
    last = rms_norm(x[last_token], params.final_norm, tile)
    logits = dense(last, params.lm_head, tile)
    logits = logits.at[:, cfg.eos_id].add(cfg.eos_bias)
    return logits, KVCache(k_all, v_all)
