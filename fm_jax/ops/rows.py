"""Moving rows in and out of the relay buffers: what every op is built from.

`OpsConfig` is a map's static configuration, fixed when `ops.future_map` builds its ops.
Writes scatter with mode='drop' and no negative-index wrapping: an out-of-range slot
writes nothing rather than another slot; reads clip. A spec map's fields each live in
their own buffer: XLA moves each with its own scatter or gather (a kernel launch each on a
GPU); `SpecConfig(kernel='pallas')` moves all of a stash's fields in one kernel, and all
of a draft gather's (row_kernel.py), with the same bytes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax.ops import checks, row_kernel
from fm_jax.ops import relay_fields as rf
from fm_jax.ops import shapes as s
from fm_jax.ops.types import DraftPayload, FutureMapState, SpecConfig, draft_payload

POISON = -1
"""Debug-mode content of an `output_tokens` slot with no unread write."""


class OpsConfig(NamedTuple):
    """A map's static configuration, as its ops read it.

    Attributes:
      pool_size: R, slots (slot 0 is padding).
      dtype: the int dtype of tokens, lengths and top-k ids.
      spec: the spec fields' declaration, or None.
      fields: every relayed field, in stash order (the bonus tokens in output_tokens).
      consumed: the consume-tracked fields' names.
      debug: poison and checkify checks.
      protocol: the relay protocol (`protocol.Protocol`).
      one_kernel: spec fields move in one Pallas kernel per op.
    """

    pool_size: int
    dtype: np.dtype
    spec: SpecConfig | None
    fields: tuple[rf.RelayField, ...]
    consumed: tuple[str, ...]
    debug: bool
    protocol: Any
    one_kernel: bool


def scatter(buf: jax.Array, indices: jax.Array, values: jax.Array) -> jax.Array:
    """`buf[indices] := values`; out-of-range slots (negative included) write nothing."""
    return buf.at[indices].set(values.astype(buf.dtype), mode="drop", wrap_negative_indices=False)


def gather(buf: jax.Array, indices: jax.Array) -> jax.Array:
    """`buf[indices]`; out-of-range slots clip to [0, R) (a negative slot reads slot 0).

    No negative-index wrapping: that would cost a few flops per row for nothing.
    """
    return buf.at[indices].get(mode="clip", wrap_negative_indices=False)


def scatter_rows(
    cfg: OpsConfig, bufs: list[jax.Array], idx: Any, values: list[Any]
) -> list[jax.Array]:
    """`scatter` of each value into its buffer at `idx`: one kernel for them all with
    `spec.kernel='pallas'` (row_kernel), else one scatter per buffer."""
    values = [jnp.asarray(v).astype(b.dtype) for b, v in zip(bufs, values, strict=True)]
    if cfg.one_kernel:
        return row_kernel.scatter(bufs, jnp.asarray(idx, cfg.dtype), values)
    return [scatter(b, idx, v) for b, v in zip(bufs, values, strict=True)]


def gather_rows(cfg: OpsConfig, bufs: list[jax.Array], idx: jax.Array) -> list[jax.Array]:
    """`gather` of each buffer at `idx`: one kernel for them all with
    `spec.kernel='pallas'` (row_kernel), else one gather per buffer."""
    if cfg.one_kernel and idx.shape[0] > 0:
        return row_kernel.gather(bufs, jnp.asarray(idx, cfg.dtype))
    return [gather(b, idx) for b in bufs]


def gather_draft(
    cfg: OpsConfig, state: FutureMapState, didx: jax.Array, *also: jax.Array
) -> tuple[DraftPayload, list[jax.Array]]:
    """The draft stashed at `didx` (every declared field, as its values), and the rows at
    `didx` of the buffers `also`, read in the same gather."""
    fields = cfg.fields
    got = gather_rows(cfg, [*(rf.get(state, f.name) for f in fields), *also], didx)
    draft = draft_payload(
        {f.name: rf.from_buffer(f, v, cfg.dtype) for f, v in zip(fields, got, strict=False)}
    )
    return draft, got[len(fields) :]


def row_min(x: jax.Array) -> jax.Array:
    """One value per row: a row's smallest (a row with a negative entry reads as one)."""
    return x if x.ndim == 1 else x.reshape(x.shape[0], -1).min(axis=1)


def consumed_reads(
    cfg: OpsConfig, draft: DraftPayload, didx: jax.Array
) -> list[tuple[jax.Array, jax.Array]]:
    """(one value per row, slots read) of each consume-tracked field a draft gather read."""
    return [(row_min(jnp.asarray(rf.get(draft, name))), didx) for name in cfg.consumed]


def poison_after(seen: jax.Array, rows: int, dtype: Any) -> jax.Array:
    """`rows` POISON values that data-depend on `seen`, a scalar reduced from every value
    just gathered from the buffer (the consume check's result).

    Writing -1 into a buffer that the same computation has just gathered from is a
    read-then-in-place-write. Without a data dependence from the read to the write, XLA's
    default (CPU) copy insertion cannot prove the order and copies the whole buffer: O(R)
    per resolve. `max(min(x, POISON), POISON)` is POISON for every x, yet the simplifier
    keeps it, so the write is ordered after the read and stays in place; a scalar keeps it
    two flops, not two per row.
    """
    dep = jnp.maximum(jnp.minimum(seen.astype(dtype), POISON), POISON)
    return jnp.broadcast_to(dep, (rows,))


def poison(
    state: FutureMapState,
    slots: jax.Array,
    maxima: jax.Array | None,
    k: int | None,
    field: str = "bonus_tokens",
) -> FutureMapState:
    """POISON written to a consume-tracked field's buffer (default `output_tokens`) at
    `slots` (whole rows), ordered after the reads that `maxima[k]` (the consume check's
    witness among the op's check maxima) was reduced from."""
    if maxima is None or k is None or slots.shape[0] == 0:
        return state
    buf = rf.get(state, field)
    values = poison_after(maxima[k], slots.shape[0], buf.dtype)
    values = jnp.broadcast_to(
        values.reshape(-1, *(1,) * (buf.ndim - 1)), (slots.shape[0], *buf.shape[1:])
    )
    return rf.put(state, field, scatter(buf, slots, values))


def poison_lengths(
    state: FutureMapState, slots: jax.Array, maxima: jax.Array | None, k: int | None
) -> FutureMapState:
    """Spec, debug: POISON written to `new_seq_lens` at `slots` (slot R: dropped), the
    lengths a resolve consumed, ordered after the read that `maxima[k]` (the positive
    lengths check's witness) was reduced from."""
    if maxima is None or k is None or slots.shape[0] == 0:
        return state
    lens = state.new_seq_lens
    values = poison_after(maxima[k], slots.shape[0], lens.dtype)
    return state._replace(new_seq_lens=scatter(lens, slots, values))


def check_indices(
    cfg: OpsConfig, name: str, indices: Any, into: checks.OpChecks | None = None
) -> None:
    """Shape checks; in debug mode the slot checks too, queued `into` the op's checks (or,
    without them, emitted at once)."""
    s.check_1d_int(name, indices, cfg.dtype)
    if cfg.debug:
        own = into or checks.OpChecks()
        checks.valid_slots(name, indices, cfg.pool_size, cfg.dtype, own)
        if into is None:
            own.run()
