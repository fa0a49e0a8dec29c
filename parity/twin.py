"""The interface the overlap driver sees: one FutureMap twin plus its toy model.

`JaxTwin` (twin_jax.py) and `TorchTwin` (twin_torch.py) implement it; mutations.py wraps
either to make a deliberately broken FutureMap variant.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from parity.host_batch import HostBatch


class ResolvedOut(NamedTuple):
    """What resolve hands the forward (framework arrays, padded to buckets)."""

    input_ids: Any  # [T]
    seq_lens: Any  # [B]
    draft: Any  # the twin's DraftPayload gathered for a spec DECODE batch, else None
    batch: Any  # the twin's batch object (torch: resolved in place)


class ForwardOut(NamedTuple):
    """What the toy model produced for one batch (framework arrays, padded rows)."""

    new_lens: Any  # [B] what publish writes
    payload: Any  # what stash writes: tokens [B] or the twin's DraftPayload
    token: Any  # [B] sampled token (non-spec) or bonus token (spec)
    accept: Any  # [B] spec accept lengths, else None
    draft: Any  # the twin's DraftPayload (spec), else None


class Twin(Protocol):
    """One framework's FutureMap and model; every op takes host numpy slots."""

    name: str
    errors: tuple[type[BaseException], ...]

    def error_kind(self, exc: BaseException) -> str: ...
    def snap(self, x: Any, n: int | None = None) -> Any: ...
    def host(self, x: Any) -> np.ndarray: ...
    def buffers(self, extras: bool) -> dict[str, Any]: ...
    def check(self) -> None: ...
    def resolve_seq_lens_cpu(self, slots: np.ndarray) -> np.ndarray: ...
    def resolve(self, hb: HostBatch) -> ResolvedOut: ...
    def forward(self, res: ResolvedOut, hb: HostBatch, offset: int) -> ForwardOut: ...
    def publish(self, slots: np.ndarray, lens: Any) -> None: ...
    def stash(self, slots: np.ndarray, payload: Any) -> None: ...
    def draft_payload(self, bonus: np.ndarray, draft: Any) -> Any: ...
    def invalidate(self, hb: HostBatch, res: ResolvedOut | None) -> tuple[Any, Any]: ...


def run_forward(
    model: Any,
    payload_type: Any,
    res: ResolvedOut,
    hb: HostBatch,
    slots: Any,
    last: Any,
    spec: Any,
    offset: int,
) -> ForwardOut:
    """The toy model's forward for one batch, shared by both twins.

    Args:
      model: the framework's toy model module (toy_model_jax or toy_model_torch).
      payload_type: the twin's DraftPayload class (spec payloads are built as it).
      res: what resolve handed the forward; hb: the host batch.
      slots, last: hb's slots and last-token indices as framework arrays.
      spec: the scenario's spec settings, or None; offset: the scenario's token offset.
    """
    if spec is None:
        tokens, new_lens = model.forward_tokens(res.input_ids, res.seq_lens, slots, last, offset)
        return ForwardOut(new_lens, tokens, tokens, None, None)
    if hb.spec_decode:
        d = res.draft
        draft = model.tm.Draft(d.bonus_tokens, d.topk_p, d.topk_index, d.hidden_states)
        accept, new_lens, nd = model.forward_spec_decode(draft, res.seq_lens, slots, spec, offset)
    else:
        accept, new_lens, nd = model.forward_spec_extend(
            res.input_ids, res.seq_lens, slots, last, spec, offset
        )
    payload = payload_type(nd.bonus, nd.topk_p, nd.topk_index, nd.hidden)
    return ForwardOut(new_lens, payload, nd.bonus, accept, payload)
