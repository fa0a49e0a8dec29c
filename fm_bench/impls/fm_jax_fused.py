"""fm_jax's pure ops inlined in one jitted engine step around a trivial model.

The engine step is resolve at the head, a trivial model, publish and stash at the tail, and
(sentinel protocol) invalidate, with the state donated. In the gather protocol the batch
carries no placeholders: resolve gathers the decode ids (spec: the lengths at the draft
indices), nothing is invalidated, and the next step takes the batch as it was.

The same step without the FutureMap ops (the model on the batch as it is, the state passed
through) is its paired baseline: the difference per repetition is what the FutureMap adds
to an engine's step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify

import fm_jax as fj
from fm_bench.impls import Op
from fm_bench.impls.jax_common import device_data, int_dtype
from fm_bench.timing import wait_jax
from fm_bench.workload import VOCAB, Config, HostData


def _model(res: fj.Resolved) -> tuple[Any, jax.Array]:
    """A trivial forward: next token and length from the resolved inputs (spec: next draft)."""
    lens = res.seq_lens + 1
    if res.draft is None:
        return (res.input_ids * 31 + 7) % VOCAB, lens
    d = res.draft
    # The bench's spec declares these (bench.workload): present whenever a draft is.
    assert d.bonus_tokens is not None and d.topk_p is not None and d.topk_index is not None
    nxt = fj.DraftPayload(
        bonus_tokens=(d.bonus_tokens * 31 + 7) % VOCAB,
        topk_p=d.topk_p * 0.5,
        topk_index=(d.topk_index + 1) % VOCAB,
        hidden_states=None if d.hidden_states is None else d.hidden_states * 2,
    )
    return nxt, lens


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """The fused engine step ('step' only), paired with the same step without the ops."""
    if "step" not in ops:
        return {}
    dd = device_data(cfg, data)
    spec = (
        fj.SpecConfig(cfg.topk, cfg.hidden, dd.hidden.dtype, kernel=cfg.spec_kernel)
        if cfg.spec
        else None
    )
    fmo = fj.future_map(
        cfg.pool, dtype=int_dtype(cfg), spec=spec, debug=debug, protocol=cfg.protocol
    )
    idx = dd.idx
    draft_in = fj.DraftPayload(dd.tokens, dd.topk_p, dd.topk_index, dd.hidden)

    def with_ops(state: fj.FutureMapState, batch: fj.Batch) -> Any:
        state, res = fmo.resolve(state, batch)
        out, lens = _model(res)
        state = fmo.publish(state, batch.req_pool_indices, lens)
        state = fmo.stash(state, batch.req_pool_indices, out)
        if cfg.gather:  # no sentinels: the host's next batch is this one
            return state, batch, out
        return state, fmo.invalidate(batch, batch.req_pool_indices), out

    def without_ops(state: fj.FutureMapState, batch: fj.Batch) -> Any:
        # The same model on the batch as it comes (no resolve), nothing stored.
        ids, seq_lens = jnp.asarray(batch.input_ids), jnp.asarray(batch.seq_lens)  # traced
        res = fj.Resolved(ids, seq_lens, draft_in if cfg.spec else None)
        out, lens = _model(res)
        return state, batch._replace(seq_lens=lens), out

    fn = checkify.checkify(with_ops, errors=checkify.user_checks) if debug else with_ops
    # Compiled as fm_jax advises an engine to (on CPU: FutureMap ops on the calling thread).
    options = fj.compiler_options(jax.devices()[0].platform)
    engine = jax.jit(fn, donate_argnums=(0,), compiler_options=options)
    model_only = jax.jit(without_ops, donate_argnums=(0,), compiler_options=options)

    box: dict[str, Any] = {}
    state0 = fmo.publish(fmo.init(), idx, dd.lens)
    box["state"] = fmo.stash(state0, idx, draft_in if cfg.spec else dd.tokens)
    draft_idx = idx if cfg.spec else None
    if cfg.gather:
        # Any [B] ids (a DECODE gather does not read them; spec: the host's ids, as given)
        # and the host's lengths (spec: gathered at the draft indices).
        box["batch"] = fj.Batch(dd.decode_mode, idx, dd.tokens, dd.lens, draft_idx)
    else:
        box["batch"] = fj.Batch(dd.decode_mode, idx, -idx, -idx, draft_idx)
    box["state2"] = fmo.init()
    box["batch2"] = box["batch"]
    box["errors"] = []

    def run() -> None:
        out = engine(box["state"], box["batch"])
        if debug:
            err, out = out
            box["errors"].append(err)
        box["state"], box["batch"], _ = out
        wait_jax(out)

    def base() -> None:
        out = model_only(box["state2"], box["batch2"])
        box["state2"] = out[0]
        wait_jax(out)

    def setup() -> None:
        for err in box["errors"]:  # an engine checks where it syncs anyway
            fj.raise_if_violated(err)
        box["errors"].clear()

    return {"step": Op(run, setup, baseline=base)}
