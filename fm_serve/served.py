"""What the serving loop needs of a model: its limits and a forward over a flat batch."""

from __future__ import annotations

from typing import Any, Protocol

import jax


class ServedModel(Protocol):
    """A model the engine serves; hashable (its steps are compiled once per model).

    `forward(params, cache, input_ids [T], token_slots [T], positions [T], last_token [B])`
    returns the logits [B, V] of each row's last token and the updated cache: token t
    belongs to slot `token_slots[t]` (0: padding) at `positions[t]` of its sequence, and the
    cache is indexed by slot. Every batch and token bucket is a multiple of `row_tile`.
    """

    @property
    def vocab(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def row_tile(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    def __hash__(self) -> int: ...

    def init_cache(self, pool_size: int) -> Any: ...

    def forward(
        self,
        params: Any,
        cache: Any,
        input_ids: jax.Array,
        token_slots: jax.Array,
        positions: jax.Array,
        last_token: jax.Array,
    ) -> tuple[jax.Array, Any]: ...
