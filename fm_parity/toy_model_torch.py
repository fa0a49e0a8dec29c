"""The toy model in PyTorch: the shared arithmetic of toy_model on torch tensors."""

from __future__ import annotations

from typing import Any

import torch

from fm_parity import toy_model as tm


class TorchBackend:
    """toy_model.Backend on torch tensors (bitcasts through Tensor.view(dtype))."""

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            a = torch.full_like(b, a)
        return torch.where(cond, a, b)

    def stack(self, xs: list[Any]) -> Any:
        return torch.stack(xs, dim=-1)

    def column(self, x: Any, k: int) -> Any:
        return x[:, k].contiguous()

    def take(self, x: Any, idx: Any) -> Any:
        return x[idx]

    def to_int(self, x: Any, like: Any) -> Any:
        return x.to(like.dtype)

    def f32_from_bits(self, bits: Any) -> Any:
        return bits.to(torch.int32).view(torch.float32)

    def bf16_from_bits(self, bits: Any) -> Any:
        return bits.to(torch.int16).view(torch.bfloat16)

    def bits_of_f32(self, x: Any, like: Any) -> Any:
        return x.contiguous().view(torch.int32).to(like.dtype)

    def bits_of_bf16(self, x: Any, like: Any) -> Any:
        return x.contiguous().view(torch.int16).to(like.dtype)


TORCH = TorchBackend()


def forward_tokens(ids: Any, seq_lens: Any, slots: Any, last_index: Any, offset: int) -> Any:
    """Non-spec forward: (tokens, seq_lens + 1); see toy_model.forward_tokens."""
    return tm.forward_tokens(ids, seq_lens, slots.to(seq_lens.dtype), last_index, TORCH, offset)


def forward_spec_extend(
    ids: Any,
    seq_lens: Any,
    slots: Any,
    last_index: Any,
    spec: tm.Layout,
    offset: int,
    verified: bool = False,
) -> Any:
    """Spec prefill: (accept, new lengths, draft)."""
    sl = slots.to(seq_lens.dtype)
    return tm.forward_spec_extend(ids, seq_lens, sl, last_index, TORCH, spec, offset, verified)


def forward_spec_decode(
    draft: tm.Draft,
    seq_lens: Any,
    slots: Any,
    spec: tm.Layout,
    offset: int,
    verified: bool = False,
) -> Any:
    """Spec verify: (accept, new lengths, next draft)."""
    sl = slots.to(seq_lens.dtype)
    return tm.forward_spec_decode(draft, seq_lens, sl, TORCH, spec, offset, verified)
