"""fm_jax through its `FutureMap` class: one jitted, donated call per op, or per phase.

The whole step is two calls, one per phase: `resolve` (the head) and `finish` (the tail:
publish, stash and, in the sentinel protocol, invalidate in one donated call). Each
single-op row is one call.

Either protocol, as the configuration names it. Sentinel: decode rows carry `-slot` ids and
lengths. Gather: a DECODE batch brings no ids (None: the class gathers them) and the host's
lengths; a MIXED batch brings its prefill ids with 0 at the running rows' positions and the
running rows' token slots; a spec batch's lengths are gathered at its draft indices.

`fm_jax` feeds the class jax arrays already on the device (the batch a step's `finish`
returns is the next step's input); `fm_jax_host` feeds it numpy arrays, as a host
scheduler that builds every batch on the host does, and the class transfers them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

import fm_jax as fj
from fm_bench.impls import Op
from fm_bench.impls.jax_common import device_data, int_dtype
from fm_bench.timing import wait_jax
from fm_bench.workload import Config, HostData


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """The class ops of `cfg` on jax arrays (spec ops on a spec map, the others on a plain one).

    'step' and the resolve ops return their resolve's output.
    """
    return _build(cfg, device_data(cfg, data)._asdict(), debug, ops, host=False)


def build_host(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """The class ops of `cfg` on numpy arrays, every batch built on the host.

    'step' and the resolve ops return their resolve's output.
    """
    dt = int_dtype(cfg)
    arrays: dict[str, Any] = {
        k: getattr(data, k).astype(dt)
        for k in ("idx", "tokens", "lens", "mixed_ids", "mixed_lens", "topk_index")
    }
    ids, slots = data.mixed_token_slots()
    arrays["mixed_gather_ids"], arrays["mixed_token_slots"] = ids.astype(dt), slots.astype(dt)
    arrays["topk_p"] = data.topk_p
    arrays["hidden"] = data.hidden.astype(jnp.dtype(cfg.hidden_dtype))
    return _build(cfg, arrays, debug, ops, host=True)


def _build(
    cfg: Config, a: dict[str, Any], debug: bool, ops: Sequence[str], *, host: bool
) -> dict[str, Op]:
    hidden = a["hidden"]
    spec = (
        fj.SpecConfig(cfg.topk, cfg.hidden, hidden.dtype, kernel=cfg.spec_kernel)
        if cfg.spec
        else None
    )
    # No host copy of the lengths: the peers are modelled with SGLang's `needs_cpu_seq_lens`
    # off (their lengths stay on the device), and so is this map.
    fm = fj.FutureMap(
        cfg.pool,
        dtype=int_dtype(cfg),
        spec=spec,
        debug=debug,
        protocol=cfg.protocol,
        needs_cpu_seq_lens=False,
    )
    idx = a["idx"]
    draft = fj.DraftPayload(a["tokens"], a["topk_p"], a["topk_index"], hidden)
    payload = draft if cfg.spec else a["tokens"]
    lens = a["lens"]
    draft_idx = idx if cfg.spec else None
    # The host knows each batch's kind: the class then runs an executable with it fixed.
    if cfg.gather:
        # No placeholders: a DECODE batch brings no ids and (spec: placeholder) lengths.
        decode = fj.Batch(fj.ForwardMode.DECODE, idx, None, lens, draft_idx)
        mixed = fj.Batch(
            fj.ForwardMode.MIXED,
            idx,
            a["mixed_gather_ids"],
            a["mixed_lens"],
            token_slots=a["mixed_token_slots"],
        )
    else:
        neg = -idx
        decode = fj.Batch(fj.ForwardMode.DECODE, idx, neg, neg, draft_idx)
        mixed = fj.Batch(fj.ForwardMode.MIXED, idx, a["mixed_ids"], a["mixed_lens"])
    fm.publish(idx, lens)
    fm.stash(idx, payload)
    wait_jax(fm.state)
    state = {"batch": decode}

    def sync(*xs: object) -> None:
        wait_jax((fm.state, xs))

    def restash() -> None:
        # Every resolving op reads slots written since their last read (debug: WRWR), even
        # when other ops on this map ran in between.
        if debug:
            fm.check()  # the sync point an engine has anyway: surface errors, keep the list short
            if cfg.spec:  # a debug spec resolve consumes the lengths it read: publish again
                fm.publish(idx, lens)
        fm.stash(idx, payload)
        wait_jax(fm.state)

    def publish() -> None:
        fm.publish(idx, lens)
        sync()

    def stash() -> None:
        fm.stash(idx, payload)
        sync()

    def resolve(batch: fj.Batch) -> fj.Resolved:
        r = fm.resolve(batch)
        sync(r)
        return r

    def invalidate() -> None:
        sync(fm.invalidate(decode, idx))

    def step() -> fj.Resolved:
        # Contract order: resolve, (forward), publish, stash (+ invalidate). The tail phase
        # is one call; a sentinel step's invalidated batch carries the sentinels the next
        # step resolves, a gather step's batch comes back as given.
        r = fm.resolve(state["batch"])
        state["batch"] = fm.finish(state["batch"], idx, lens, payload)
        sync(r, state["batch"].input_ids)  # the outputs: resolved, state, sentinels
        return r

    def step_host() -> fj.Resolved:
        # The host builds each batch itself (its own sentinels, or none); the class's
        # invalidated batch is an output like the others.
        r = fm.resolve(decode)
        sync(r, fm.finish(decode, idx, lens, payload).input_ids)
        return r

    table = {
        "publish": Op(publish),
        "step": Op(step_host if host else step, restash),
    }
    if not cfg.gather:
        table["invalidate"] = Op(invalidate)
    if cfg.spec:
        table["stash_spec"] = Op(stash)
        table["resolve_spec"] = Op(lambda: resolve(decode), restash)
    else:
        table["stash"] = Op(stash)
        table["resolve_decode"] = Op(lambda: resolve(decode), restash)
        table["resolve_mixed"] = Op(lambda: resolve(mixed), restash)
    return {k: v for k, v in table.items() if k in ops}
