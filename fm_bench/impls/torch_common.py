"""Helpers shared by the PyTorch implementations: the device, host data as device tensors,
and the table of timed ops around a relay's publish, stash, resolve and invalidate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from fm_bench.impls import Op
from fm_bench.timing import wait_torch

HIDDEN = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The torch dtype of each configured hidden dtype."""

_B = TypeVar("_B")
_P = TypeVar("_P")
_B_contra = TypeVar("_B_contra", contravariant=True)
_P_contra = TypeVar("_P_contra", contravariant=True)


def device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tensors(dev: torch.device) -> Callable[..., torch.Tensor]:
    """`t(a, dtype=None)`: host array `a` as a contiguous tensor on `dev` (in `dtype`)."""

    def t(a: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.as_tensor(a).to(device=dev, dtype=dtype).contiguous()

    return t


class Relay(Protocol[_B_contra, _P_contra]):
    """The ops of a torch FutureMap that the timed ops call, on batches `_B_contra`."""

    def publish(self, indices: torch.Tensor, new_seq_lens: torch.Tensor, /) -> None: ...

    def stash(self, indices: torch.Tensor, payload: _P_contra, /) -> None: ...

    def resolve(self, batch: _B_contra, /) -> None: ...


def relay_ops(
    fm: Relay[_B, _P],
    dev: torch.device,
    idx: torch.Tensor,
    lens: torch.Tensor,
    payload: _P,
    batches: tuple[Callable[[], _B], Callable[[], _B]],
    end_step: Callable[[_B], object],
    invalidate: Callable[[_B, torch.Tensor], None] | None,
    *,
    spec: bool,
    ops: Sequence[str],
    republish: bool = False,
) -> dict[str, Op]:
    """Publish and stash `lens` and `payload` at slots `idx` once, then the ops of `ops` that
    the relay has, each waited through `wait_torch(dev)`.

    `batches` makes a fresh DECODE and a fresh MIXED batch; the resolve ops resolve one (the
    DECODE one for 'resolve_spec') and return it. 'step' is resolve, publish, stash, then
    `end_step` (given the step's batch: it readies the batch for the next step and returns
    what the step returns). 'invalidate' is there only when `invalidate` is given; a spec
    map has 'stash_spec' and 'resolve_spec', a plain one 'stash', 'resolve_decode' and
    'resolve_mixed'. `republish`: each setup publishes `lens` before it stashes, for a
    relay whose resolve consumes a publish (SGLang's current class).
    """
    decode_batch, mixed_batch = batches
    fm.publish(idx, lens)
    fm.stash(idx, payload)
    wait_torch(dev)
    box = {"op": decode_batch(), "step": decode_batch()}

    def restash() -> None:
        # Every resolving op reads slots written since their last read (debug: WRWR), even
        # when other ops on this map ran in between.
        if republish:
            fm.publish(idx, lens)
        fm.stash(idx, payload)
        wait_torch(dev)

    def fresh(batch: Callable[[], _B]) -> Callable[[], None]:
        def setup() -> None:
            box["op"] = batch()  # resolve rewrites the batch in place
            restash()

        return setup

    def publish() -> None:
        fm.publish(idx, lens)
        wait_torch(dev)

    def stash() -> None:
        fm.stash(idx, payload)
        wait_torch(dev)

    def resolve() -> _B:
        fm.resolve(box["op"])
        wait_torch(dev)
        return box["op"]

    def step() -> object:
        b = box["step"]
        fm.resolve(b)
        fm.publish(idx, lens)
        fm.stash(idx, payload)
        out = end_step(b)
        wait_torch(dev)
        return out

    table = {"publish": Op(publish)}
    if invalidate is not None:
        invalidate_batch = invalidate

        def invalidate_op() -> None:
            invalidate_batch(box["op"], idx)
            wait_torch(dev)

        table["invalidate"] = Op(invalidate_op)
    table["step"] = Op(step, restash)
    if spec:
        table["stash_spec"] = Op(stash)
        table["resolve_spec"] = Op(resolve, fresh(decode_batch))
    else:
        table["stash"] = Op(stash)
        table["resolve_decode"] = Op(resolve, fresh(decode_batch))
        table["resolve_mixed"] = Op(resolve, fresh(mixed_batch))
    return {k: v for k, v in table.items() if k in ops}
