"""Relay buffers an engine owns: the lengths and tokens buffers a captured verify graph
scatters into itself, handed to the FutureMap when it is built (SGLang's
`FutureRelayBuffers`, adopted by its FutureMap). docs/CONTRACT.md, 'Engine-owned relay
buffers'."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RelayBuffers:
    """`new_seq_lens` and `output_tokens`, one row per slot, owned by the engine.

    A map built with `FutureMap(..., relay=buffers)` adopts them as its own buffers (their
    contents reset to the map's initial ones). An engine whose forward already wrote a
    step's rows into them sets `published_seq_lens` (`published_bonus`) to the very tensor
    of rows it wrote; the map's next `publish` (`stash`) handed that same tensor skips its
    own write and clears the mark. Any other tensor is written as usual.
    """

    new_seq_lens: torch.Tensor  # [R], the map's int dtype and device
    output_tokens: torch.Tensor  # [R]
    published_seq_lens: torch.Tensor | None = None
    published_bonus: torch.Tensor | None = None
    adopted: bool = False
