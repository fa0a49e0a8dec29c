"""The jitted forward step, in two flavours over the same model.

- sync step: the host passes real token ids and real lengths; no FutureMap.
- overlap step: fm_jax's `resolve` builds the decode rows' ids at the head of the step from
  the relay, `publish` and `stash` write the relay at its tail, and the FutureMapState is
  threaded through and donated together with the KV cache, so every write is in place. In
  the sentinel protocol decode rows carry `-slot` ids (and, in a DECODE batch, lengths) that
  resolve fills; in the gather protocol they carry no id (0) and the host's lengths, and
  resolve gathers a DECODE batch's ids at its slots and a MIXED batch's running rows' ids at
  their `relay_slots` (docs/CONTRACT.md, 'Two protocols'). With debug, the step is
  checkified and returns fm_jax's error value alongside.

Token positions are computed on device from the resolved lengths, because in the sentinel
protocol a DECODE row's length is itself a sentinel until resolve: position = seq_len -
extend_len + offset.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import checkify

import fm_jax
from bench.serve import model as mdl
from bench.serve.config import ModelConfig

Ints = Any
"""A host int array (np.ndarray) when built, a traced jax.Array inside the jitted step."""


class StepInputs(NamedTuple):
    """One scheduled batch as host arrays, padded to a batch bucket B and a token bucket T.

    Padding rows and padding tokens carry slot 0 (and id 0, length 0).
    """

    forward_mode: Ints  # int32 scalar, a fm_jax.ForwardMode
    req_pool_indices: Ints  # [B] slot of each row
    input_ids: Ints  # [T] flat ids; overlap decode rows: -slot
    seq_lens: Ints  # [B] length incl. this step's tokens; overlap DECODE: -slot
    extend_lens: Ints  # [B] tokens each row contributes (prefill chunk, or 1)
    token_rows: Ints  # [T] row of each token (padding tokens: 0)
    token_slots: Ints  # [T] slot of each token (padding tokens: 0)
    token_offsets: Ints  # [T] offset of each token within its row's tokens
    last_token: Ints  # [B] index of each row's last token (padding rows: 0)
    relay_slots: Ints  # [T] gather-protocol MIXED: a running row's slot at its token, else 0


def _positions(inp: Any, seq_lens: jax.Array) -> jax.Array:
    """Each token's position in its slot's sequence; padding tokens sit at position 0."""
    start = seq_lens - inp.extend_lens  # [B]: first position this step writes per row
    pos = start[inp.token_rows] + inp.token_offsets
    return jnp.where(inp.token_slots > 0, pos, 0)


def _run_model(
    params: mdl.Params,
    cfg: ModelConfig,
    cache: mdl.KVCache,
    inp: Any,
    input_ids: jax.Array,
    seq_lens: jax.Array,
) -> tuple[jax.Array, mdl.KVCache]:
    """Forward plus greedy sampling: (tokens [B] int32, updated cache)."""
    positions = jnp.clip(_positions(inp, seq_lens), 0, cfg.max_seq_len - 1)
    logits, cache = mdl.forward(
        params, cfg, cache, input_ids, inp.token_slots, positions, inp.last_token
    )
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


@functools.cache
def make_sync_step(cfg: ModelConfig) -> Callable[..., tuple[mdl.KVCache, jax.Array]]:
    """The jitted synchronous step: (params, cache, inputs) -> (cache, tokens); cache donated.

    Assumes the host filled in real token ids and lengths (no sentinels). Cached per config,
    so engines with the same model share compiled executables.
    """

    def step(params: mdl.Params, cache: mdl.KVCache, inp: StepInputs) -> Any:
        tokens, cache = _run_model(params, cfg, cache, inp, inp.input_ids, inp.seq_lens)
        return cache, tokens

    return jax.jit(step, donate_argnums=(1,))


@functools.cache
def make_overlap_step(
    cfg: ModelConfig, pool_size: int, debug: bool, protocol: str = "sentinel"
) -> tuple[fm_jax.FutureMapOps, Callable[..., Any]]:
    """fm_jax's ops for the pool, and the jitted overlap step with them inlined.

    The step: (params, cache, fm_state, inputs) -> (cache, fm_state, tokens), cache and state
    donated. Cached per (config, pool_size, debug, protocol). With debug the step is
    checkified: it returns (err, (cache, fm_state, tokens)) and the caller keeps `err` to
    raise with `fm_jax.raise_if_violated` at a sync point.

    Order inside the step (SPEC 'One overlap step'): resolve, forward, publish(seq_lens + 1),
    stash(tokens). Sentinel protocol: invalidation is the scheduler's, which writes the next
    batch's decode rows as sentinels. Gather protocol: there is none; the forward mode is
    traced, so every batch passes its `relay_slots` (all 0 but in a MIXED batch).
    """

    ops = fm_jax.future_map(pool_size, dtype=jnp.int32, debug=debug, protocol=protocol)
    gather = ops.protocol == "gather"

    def step(
        params: mdl.Params, cache: mdl.KVCache, fm_state: fm_jax.FutureMapState, inp: StepInputs
    ) -> Any:
        batch = fm_jax.Batch(
            inp.forward_mode,
            inp.req_pool_indices,
            inp.input_ids,
            inp.seq_lens,
            token_slots=inp.relay_slots if gather else None,
        )
        fm_state, res = ops.resolve(fm_state, batch)
        tokens, cache = _run_model(params, cfg, cache, inp, res.input_ids, res.seq_lens)
        fm_state = ops.publish(fm_state, inp.req_pool_indices, res.seq_lens + 1)
        fm_state = ops.stash(fm_state, inp.req_pool_indices, tokens)
        return cache, fm_state, tokens

    if debug:
        checked = checkify.checkify(step, errors=checkify.user_checks)
        return ops, jax.jit(checked, donate_argnums=(1, 2))
    return ops, jax.jit(step, donate_argnums=(1, 2))
