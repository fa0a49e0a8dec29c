"""The batch and payload records the PyTorch FutureMap reads and rewrites."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.IntEnum):
    """What kind of forward a batch runs (docs/CONTRACT.md, 'Batch kinds')."""

    EXTEND = 0  # prefill or a prefill chunk: real ids and lengths
    DECODE = 1  # sentinel protocol: ids and lengths are sentinels until resolve;
    # gather protocol: no ids until resolve gathers them, lengths real (spec: gathered)
    MIXED = 2  # prefill rows first, then running decode rows; lengths already restored
    IDLE = 3  # data-parallel rank with nothing to run: empty indices


@dataclass
class DraftPayload:
    """Speculative draft state relayed from one step to the next.

    `stash` takes it as written by a forward; `resolve` fills it from the buffers.
    A stash writes the fields given and keeps the others' rows (a partial stash; the
    consume-tracked fields, fixed by the first draft, are in every one). A field's buffer
    is made by the first draft that has it (as SGLang makes its buffers); a resolve gives
    None for a field with no buffer yet: an EAGLE draft brings bonus tokens and top-k, an
    n-gram draft only its `extras` (SGLang's accept tokens and lengths).
    """

    bonus_tokens: torch.Tensor | None = None  # [B] int
    topk_p: torch.Tensor | None = None  # [B, K] float32
    topk_index: torch.Tensor | None = None  # [B, K] int
    hidden_states: torch.Tensor | None = None  # [B, H] bf16 / f16 / f32
    verified_id: torch.Tensor | None = None  # [B] int (EAGLE's verified ids)
    extras: dict[str, torch.Tensor] | None = None  # the engine's own fields, [B, ...] each


@dataclass
class DraftInput:
    """What a spec DECODE batch carries into resolve: the slots to gather from.

    After resolve, `payload` holds the gathered extras.
    """

    indices: torch.Tensor  # [B] slots written by the previous step's stash
    payload: DraftPayload | None = None


@dataclass
class ScheduleBatch:
    """The fields of a scheduled batch that the FutureMap touches.

    `input_ids` is flat: an EXTEND row contributes all its tokens, a decode row one.
    `seq_lens` and `req_pool_indices` have one entry per row.

    Sentinel protocol: `input_ids` is always a tensor (decode rows hold -slot sentinels);
    `mix_running_indices` is not read. Gather protocol: `input_ids` is None for a DECODE
    batch (resolve gathers its ids), a MIXED batch's `input_ids` holds only its prefill ids
    and `mix_running_indices` the slots of its running rows, whose tokens resolve appends.

    The host's own fields (SGLang's `seq_lens_cpu`, `seq_lens_sum`, `prefix_lens`), one
    entry per row where given: a spec MIXED batch's resolve rebinds its running rows'
    (`seq_lens_cpu` the bound length, `prefix_lens` the published one, `seq_lens_sum`
    over the live rows); any other batch's are not read.
    """

    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor  # [B]
    input_ids: torch.Tensor | None  # [T]; None only for a gather-protocol DECODE batch
    seq_lens: torch.Tensor  # [B]
    draft: DraftInput | None = None
    mix_running_indices: torch.Tensor | None = None  # [M] gather protocol, MIXED only
    seq_lens_cpu: torch.Tensor | None = None  # [B] int, on the CPU
    seq_lens_sum: int | None = None
    prefix_lens: list[int] | None = None  # [B]
