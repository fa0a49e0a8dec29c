"""What the ops take, store and return: the pytrees and the declaration of the relayed
fields. Declarations only: nothing here checks or raises (`relay_fields` and `checks` do)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class ForwardMode(enum.IntEnum):
    """What kind of forward a batch runs (docs/CONTRACT.md, 'Batch kinds'); an int32 scalar."""

    EXTEND = 0  # prefill or a prefill chunk: real ids and lengths
    DECODE = 1  # ids and lengths are sentinels until resolve
    MIXED = 2  # prefill rows first, then running decode rows; lengths already restored
    IDLE = 3  # data-parallel rank with nothing to run: all rows padding


class FutureMapState(NamedTuple):
    """The relay buffers, leading dimension R (pool size); spec fields None without spec.
    Slot 0 mirrors the request pool's padding row (padded rows write garbage there); a real
    float field's buffer holds its raw bits, bit-exact on every backend."""

    output_tokens: jax.Array  # [R] int: last token (non-spec) or bonus token (spec)
    new_seq_lens: jax.Array  # [R] int: length after the slot's last forward
    topk_p: jax.Array | None = None  # [R, K] float32, as its bits (uint32)
    topk_index: jax.Array | None = None  # [R, K] int
    hidden_states: jax.Array | None = None  # [R, H] the declared dtype, as its bits
    verified_id: jax.Array | None = None  # [R] int, when declared
    extras: dict[str, jax.Array] | None = None  # the engine's own fields by name, [R, ...]
    confidence: jax.Array | None = None  # [R, gamma] float32 as its bits (uint32)


# Per-row data: a jax array, or a host array where the FutureMap class takes one.
Rows = jax.Array | np.ndarray
# What a FutureMap method takes: global rows (a jax array, a host array or a list), or a
# mapping DP rank -> host rows.
RowsInput = jax.Array | np.ndarray | Sequence[Any] | Mapping[int, Any]
# A batch's kind: known on the host (a ForwardMode; on a mesh also an int32 numpy array,
# one per DP rank), or traced (an int32 jax array). None: fixed inside an executable.
Mode = ForwardMode | int | jax.Array | np.ndarray | None


class Batch(NamedTuple):
    """The fields of a scheduled batch that resolve and invalidate touch (docs/CONTRACT.md,
    'Batch kinds'). `forward_mode`: a traced int32 scalar serves every kind in one
    executable (on a mesh: a scalar or [DP]), a host ForwardMode fixes it when traced."""

    forward_mode: Mode
    req_pool_indices: Rows  # [B]
    # [T], flat: an EXTEND row brings all its tokens, a decode row one (gather protocol: a
    # non-spec DECODE batch's None, T = B)
    input_ids: Rows | None
    seq_lens: Rows  # [B]
    draft_indices: Rows | None = None  # [B], spec DECODE: the slots whose draft to gather
    # [T], gather protocol, MIXED only: the slot a running row's token is gathered from, else 0
    token_slots: Rows | None = None


class DraftPayload(NamedTuple):
    """Speculative draft state: what `stash` writes and `resolve` gathers; a field the spec
    does not declare is None, as is (the class's resolve) one no stash has written yet."""

    bonus_tokens: jax.Array | np.ndarray | None = None  # [B] int
    topk_p: jax.Array | np.ndarray | None = None  # [B, K] float32
    topk_index: jax.Array | np.ndarray | None = None  # [B, K] int
    hidden_states: jax.Array | np.ndarray | None = None  # [B, H], None when H == 0
    verified_id: jax.Array | np.ndarray | None = None  # [B] int, when the spec declares it
    extras: Mapping[str, Any] | None = None  # the engine's own fields by name, [B, ...]


class Resolved(NamedTuple):
    """What resolve hands the forward: ids and lengths with placeholders filled, and the draft."""

    input_ids: jax.Array  # [T]
    seq_lens: jax.Array  # [B]
    draft: DraftPayload | None = None  # of jax arrays; None without draft_indices


class MixedTails(NamedTuple):
    """A spec MIXED batch's host lengths with its running rows rebound (the host side of
    the late binding, `FutureMap.resolve_mixed_tails_cpu`); one entry per row."""

    seq_lens_cpu: np.ndarray  # [B] int64: the host's, running rows' published length + 1
    seq_lens_sum: int  # the sum over the live rows (slot > 0)
    prefix_lens: np.ndarray | None  # [B] int64: the host's, running rows' published length


# The standard fields' names, in the order a map declares them.
STANDARD = ("bonus_tokens", "verified_id", "topk_p", "topk_index", "hidden_states")
HIDDEN_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
KERNELS = ("xla", "pallas")  # one scatter / gather per buffer, or one kernel for all
CONFIDENCE_DTYPE = np.dtype(np.float32)  # a confidence row's values (SGLang's: float32)
CONFIDENCE_BITS = np.dtype(np.uint32)  # what its buffer holds: their raw bits


class RelayField(NamedTuple):
    """One per-row value a spec map relays from a step's stash to the next step's resolve,
    in one buffer of the state, [R, *shape] (an engine's own in `extras` by name).

    Attributes:
      name: the field's name (an entry of `DraftPayload.extras` for an engine's own field).
      shape: the per-row shape; () for one value per row.
      dtype: the element dtype, one a buffer stores (`relay_fields.storable`; 64-bit ones
        need x64); None for the map's int dtype.
      consumed: debug consume tracking (an int field; docs/CONTRACT.md, 'Debug mode').
      bits: deprecated, changes nothing (every real float is stored as its raw bits).
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: Any = None
    consumed: bool = False
    bits: bool = False


class SpecConfig(NamedTuple):
    """The fields a spec map relays, declared at init (`fields()`): stash, resolve and debug
    consume tracking follow this list (docs/CONTRACT.md, 'Relay fields').

    Attributes:
      topk: K, width of `topk_p` / `topk_index`; 0 relays no top-k fields.
      hidden: H, width of `hidden_states`; 0 relays none.
      hidden_dtype: bfloat16, float16 or float32.
      verified_id: relay each row's verified id (EAGLE's), consume-tracked.
      extra: the engine's own fields, relayed in `DraftPayload.extras`.
      bonus_tokens: relay each row's bonus token in `output_tokens`, consume-tracked; off
        for a draft that brings none (an n-gram one).
      kernel: 'xla' (default), one scatter or gather per buffer; 'pallas', one kernel for
        every field: Triton on a GPU, Pallas's interpreter on CPU, no TPU.
      confidence: gamma, the width of each slot's confidence row: `publish` then takes
        `confidence=` rows [B, gamma] float32 and starts their host copy into a ring
        (`FutureMap.resolve_confidence_cpu`); 0 (default): no confidence relay.
    """

    topk: int
    hidden: int = 0
    hidden_dtype: jnp.dtype = jnp.dtype(jnp.bfloat16)
    verified_id: bool = False
    extra: tuple[RelayField, ...] = ()
    bonus_tokens: bool = True
    kernel: str = "xla"
    confidence: int = 0

    def fields(self) -> tuple[RelayField, ...]:
        """Every relayed field, in stash order: bonus tokens (unless off) and verified ids
        (if declared), both consume-tracked; top-k probabilities and ids if K > 0; hidden
        states if H > 0; then `extra`."""
        out = [RelayField("bonus_tokens", consumed=True)] if self.bonus_tokens else []
        if self.verified_id:
            out.append(RelayField("verified_id", consumed=True))
        if self.topk:
            k = (self.topk,)
            out += [RelayField("topk_p", k, np.dtype(np.float32)), RelayField("topk_index", k)]
        if self.hidden:
            out.append(RelayField("hidden_states", (self.hidden,), np.dtype(self.hidden_dtype)))
        return (*out, *self.extra)


def confidence_width(spec: SpecConfig | None) -> int:
    """gamma, the width of a slot's confidence row; 0 when the map relays none."""
    return 0 if spec is None else spec.confidence
