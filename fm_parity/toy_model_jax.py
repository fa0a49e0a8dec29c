"""The toy model in JAX: the shared arithmetic of toy_model on jax arrays, jitted."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from fm_parity import toy_model as tm


class JaxBackend:
    """toy_model.Backend on jax arrays (bitcasts through lax.bitcast_convert_type)."""

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return jnp.where(cond, a, b)

    def stack(self, xs: list[Any]) -> Any:
        return jnp.stack(xs, axis=-1)

    def column(self, x: Any, k: int) -> Any:
        return x[:, k]

    def take(self, x: Any, idx: Any) -> Any:
        return x[idx]

    def to_int(self, x: Any, like: Any) -> Any:
        return x.astype(like.dtype)

    def f32_from_bits(self, bits: Any) -> Any:
        return jax.lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)

    def bf16_from_bits(self, bits: Any) -> Any:
        return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.bfloat16)

    def bits_of_f32(self, x: Any, like: Any) -> Any:
        return jax.lax.bitcast_convert_type(x, jnp.int32).astype(like.dtype)

    def bits_of_bf16(self, x: Any, like: Any) -> Any:
        return jax.lax.bitcast_convert_type(x, jnp.int16).astype(like.dtype)


JAX = JaxBackend()


@partial(jax.jit, static_argnames=("offset",))
def forward_tokens(ids: Any, seq_lens: Any, slots: Any, last_index: Any, offset: int) -> Any:
    """Non-spec forward on device: (tokens, seq_lens + 1); see toy_model.forward_tokens."""
    return tm.forward_tokens(ids, seq_lens, slots.astype(seq_lens.dtype), last_index, JAX, offset)


@partial(jax.jit, static_argnames=("spec", "offset", "verified"))
def forward_spec_extend(
    ids: Any,
    seq_lens: Any,
    slots: Any,
    last_index: Any,
    spec: tm.Layout,
    offset: int,
    verified: bool = False,
) -> Any:
    """Spec prefill on device: (accept, new lengths, draft)."""
    sl = slots.astype(seq_lens.dtype)
    return tm.forward_spec_extend(ids, seq_lens, sl, last_index, JAX, spec, offset, verified)


@partial(jax.jit, static_argnames=("spec", "offset", "verified"))
def forward_spec_decode(
    draft: tm.Draft,
    seq_lens: Any,
    slots: Any,
    spec: tm.Layout,
    offset: int,
    verified: bool = False,
) -> Any:
    """Spec verify on device: (accept, new lengths, next draft)."""
    sl = slots.astype(seq_lens.dtype)
    return tm.forward_spec_decode(draft, seq_lens, sl, JAX, spec, offset, verified)
