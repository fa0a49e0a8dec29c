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
from fm_bench.timing import wait_torch
from fm_bench.workload import Config, HostData
from fm_torch.batch import DraftInput, DraftPayload, ForwardMode, ScheduleBatch

_DTYPES = {"int32": torch.int32, "int64": torch.int64}
_HIDDEN = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """The twin's ops of `cfg` on `device()`; the resolve ops return the resolved batch."""
    dev = device()
    dt = _DTYPES[cfg.dtype]

    def t(a: object, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.as_tensor(a).to(device=dev, dtype=dtype).contiguous()

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
        t(data.hidden, _HIDDEN[cfg.hidden_dtype]),
    )
    payload: torch.Tensor | DraftPayload = draft if cfg.spec else tokens
    fm.publish(idx, lens)
    fm.stash(idx, payload)
    wait_torch(dev)

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

    box = {"batch": decode_batch()}

    def restash() -> None:
        # Every resolving op reads slots written since their last read (debug: WRWR), even
        # when other ops on this map ran in between.
        fm.stash(idx, payload)
        wait_torch(dev)

    def fresh_decode() -> None:
        box["batch"] = decode_batch()
        fm.stash(idx, payload)  # a debug resolve must read written slots
        wait_torch(dev)

    def fresh_mixed() -> None:
        box["batch"] = mixed_batch()
        fm.stash(idx, payload)
        wait_torch(dev)

    def publish() -> None:
        fm.publish(idx, lens)
        wait_torch(dev)

    def stash() -> None:
        fm.stash(idx, payload)
        wait_torch(dev)

    def resolve() -> ScheduleBatch:
        fm.resolve(box["batch"])
        wait_torch(dev)
        return box["batch"]

    def invalidate() -> None:
        fm.invalidate(box["batch"], idx)
        wait_torch(dev)

    step_box = {"batch": decode_batch()}

    def step() -> None:
        b = step_box["batch"]
        fm.resolve(b)
        fm.publish(idx, lens)
        fm.stash(idx, payload)
        if cfg.gather:
            # No sentinels: the host leaves the next batch's ids empty, its lengths its own.
            b.input_ids, b.seq_lens = None, lens
        else:
            fm.invalidate(b, idx)
        if b.draft is not None:
            b.draft.payload = None
        wait_torch(dev)

    table = {"publish": Op(publish), "step": Op(step, restash)}
    if not cfg.gather:
        table["invalidate"] = Op(invalidate)
    if cfg.spec:
        table["stash_spec"] = Op(stash)
        table["resolve_spec"] = Op(resolve, fresh_decode)
    else:
        table["stash"] = Op(stash)
        table["resolve_decode"] = Op(resolve, fresh_decode)
        table["resolve_mixed"] = Op(resolve, fresh_mixed)
    return {k: v for k, v in table.items() if k in ops}
