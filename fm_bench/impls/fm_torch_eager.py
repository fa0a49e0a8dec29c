"""fm_torch, eager: the PyTorch twin called op by op, as SGLang's scheduler calls its FutureMap.

Either protocol, as the configuration names it. Sentinel: decode rows carry `-slot` ids and
lengths and a step ends with invalidate. Gather: a DECODE batch comes without ids, a MIXED
batch with its prefill ids and `mix_running_indices`, a spec batch's lengths are gathered at
its draft indices, and a step is resolve, publish, stash.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import fm_torch as ft
from fm_bench.impls import Op
from fm_bench.impls.torch_common import HIDDEN, device, relay_ops, tensors
from fm_bench.workload import Config, HostData
from fm_torch.batch import DraftInput, DraftPayload, ForwardMode, ScheduleBatch

_DTYPES = {"int32": torch.int32, "int64": torch.int64}


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """The twin's ops of `cfg` on `device()`; the resolve ops return the resolved batch."""
    dev = device()
    dt = _DTYPES[cfg.dtype]
    t = tensors(dev)
    fm = ft.FutureMap(
        cfg.pool, device=dev, dtype=dt, spec=cfg.spec, debug=debug, protocol=cfg.protocol
    )
    idx, tokens, lens = t(data.idx, dt), t(data.tokens, dt), t(data.lens, dt)
    mixed_ids, mixed_lens = t(data.mixed_ids, dt), t(data.mixed_lens, dt)
    prefill, running = t(data.mixed_prefill, dt), t(data.mixed_running, dt)
    draft = DraftPayload(
        tokens,
        t(data.topk_p, torch.float32),
        t(data.topk_index, dt),
        t(data.hidden, HIDDEN[cfg.hidden_dtype]),
    )
    payload: torch.Tensor | DraftPayload = draft if cfg.spec else tokens

    def decode_batch() -> ScheduleBatch:
        draft = DraftInput(idx) if cfg.spec else None
        if cfg.gather:  # no ids (resolve gathers them); the host's lengths (spec: gathered)
            return ScheduleBatch(ForwardMode.DECODE, idx, None, lens, draft)
        return ScheduleBatch(ForwardMode.DECODE, idx, -idx, -idx, draft)

    def mixed_batch() -> ScheduleBatch:
        if cfg.gather:
            return ScheduleBatch(
                ForwardMode.MIXED, idx, prefill, mixed_lens, mix_running_indices=running
            )
        return ScheduleBatch(ForwardMode.MIXED, idx, mixed_ids, mixed_lens)

    def end_step(b: ScheduleBatch) -> None:
        if cfg.gather:
            # No sentinels: the host leaves the next batch's ids empty, its lengths its own.
            b.input_ids, b.seq_lens = None, lens
        else:
            fm.invalidate(b, idx)
        if b.draft is not None:
            b.draft.payload = None

    invalidate = None if cfg.gather else fm.invalidate
    batches = (decode_batch, mixed_batch)
    # Debug, spec: a resolve consumes the lengths it reads, so each setup publishes again.
    republish = debug and cfg.spec
    return relay_ops(
        fm,
        dev,
        idx,
        lens,
        payload,
        batches,
        end_step,
        invalidate,
        spec=cfg.spec,
        ops=ops,
        republish=republish,
    )
