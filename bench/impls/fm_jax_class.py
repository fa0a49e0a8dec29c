"""fm_jax through its `FutureMap` class: one jitted, donated call per op, or per phase.

The whole step is two calls, one per phase: `resolve` (the head) and `finish` (the tail:
publish, stash and invalidate in one donated call). Each single-op row is one call.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

import fm_jax as fj
from bench.impls import Op
from bench.impls.jax_common import device_data, int_dtype
from bench.workload import Config, HostData


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """The class ops of `cfg` (spec ops on a spec map, the others on a plain one)."""
    dd = device_data(cfg, data)
    spec = fj.SpecConfig(cfg.topk, cfg.hidden, dd.hidden.dtype) if cfg.spec else None
    fm = fj.FutureMap(cfg.pool, dtype=int_dtype(cfg), spec=spec, debug=debug)
    idx = dd.idx
    draft = fj.DraftPayload(dd.tokens, dd.topk_p, dd.topk_index, dd.hidden)
    payload = draft if cfg.spec else dd.tokens
    # The host knows each batch's kind: the class then runs an executable with it fixed.
    decode = fj.Batch(fj.ForwardMode.DECODE, idx, -idx, -idx, idx if cfg.spec else None)
    mixed = fj.Batch(fj.ForwardMode.MIXED, idx, dd.mixed_ids, dd.mixed_lens)
    fm.publish(idx, dd.lens)
    fm.stash(idx, payload)
    jax.block_until_ready(fm.state)
    state = {"batch": decode}

    def sync(*xs: object) -> None:
        jax.block_until_ready((fm.state, xs))

    def restash() -> None:
        # Every resolving op reads slots written since their last read (debug: WRWR), even
        # when other ops on this map ran in between.
        if debug:
            fm.check()  # the sync point an engine has anyway: surface errors, keep the list short
        fm.stash(idx, payload)
        jax.block_until_ready(fm.state)

    def publish() -> None:
        fm.publish(idx, dd.lens)
        sync()

    def stash() -> None:
        fm.stash(idx, payload)
        sync()

    def resolve(batch: fj.Batch) -> None:
        sync(fm.resolve(batch))

    def invalidate() -> None:
        sync(fm.invalidate(decode, idx))

    def step() -> None:
        # SPEC order: resolve, (forward), publish, stash, invalidate. The tail phase is one
        # call; the invalidated batch carries the sentinels the next step resolves.
        r = fm.resolve(state["batch"])
        state["batch"] = fm.finish(state["batch"], idx, dd.lens, payload)
        sync(r, state["batch"].input_ids)  # the outputs: resolved, state, sentinels

    table = {
        "publish": Op(publish),
        "step": Op(step, restash),
        "invalidate": Op(invalidate),
    }
    if cfg.spec:
        table["stash_spec"] = Op(stash)
        table["resolve_spec"] = Op(lambda: resolve(decode), restash)
    else:
        table["stash"] = Op(stash)
        table["resolve_decode"] = Op(lambda: resolve(decode), restash)
        table["resolve_mixed"] = Op(lambda: resolve(mixed), restash)
    return {k: v for k, v in table.items() if k in ops}
