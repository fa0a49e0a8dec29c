"""The pytrees and static configuration of fm_jax's ops, and the trace-time structural
checks of their arguments (no values read)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax.ops import errors
from fm_jax.ops.errors import FutureMapError


class ForwardMode(enum.IntEnum):
    """What kind of forward a batch runs (docs/CONTRACT.md, 'Batch kinds'); an int32 scalar."""

    EXTEND = 0  # prefill or a prefill chunk: real ids and lengths
    DECODE = 1  # ids and lengths are sentinels until resolve
    MIXED = 2  # prefill rows first, then running decode rows; lengths already restored
    IDLE = 3  # data-parallel rank with nothing to run: all rows padding


class FutureMapState(NamedTuple):
    """The relay buffers, leading dimension R (pool size); spec fields None without spec.

    Slot 0 mirrors the request pool's padding row: padded rows write garbage there. A real
    float field's buffer holds its raw bits (`stored_as_bits`: uint32 for topk_p, uint16
    for bf16 hidden states), written in place and bit-exact on every backend.
    """

    output_tokens: jax.Array  # [R] int: last token (non-spec) or bonus token (spec)
    new_seq_lens: jax.Array  # [R] int: length after the slot's last forward
    topk_p: jax.Array | None = None  # [R, K] float32, as its bits (uint32)
    topk_index: jax.Array | None = None  # [R, K] int
    hidden_states: jax.Array | None = None  # [R, H] the declared dtype, as its bits
    verified_id: jax.Array | None = None  # [R] int, when declared
    extras: dict[str, jax.Array] | None = None  # the engine's own fields by name, [R, ...]
    confidence: jax.Array | None = None  # [R, gamma] float32 as its bits (uint32)


Rows = jax.Array | np.ndarray
"""Per-row data: a jax array, or a host array where the FutureMap class takes one."""

RowsInput = jax.Array | np.ndarray | Sequence[Any] | Mapping[int, Any]
"""Per-row data a FutureMap method takes: global rows (a jax array, a host array or a
list), or a mapping DP rank -> host rows."""


Mode = ForwardMode | int | jax.Array | np.ndarray | None
"""A batch's kind: known on the host (a ForwardMode; on a mesh also an int32 numpy array,
one per DP rank), or traced (an int32 jax array). None: fixed inside an executable."""


class Batch(NamedTuple):
    """The fields of a scheduled batch that resolve and invalidate touch (the FutureMap
    class also takes host arrays for each).

    `input_ids` is flat ([T]): an EXTEND row brings all its tokens, a decode row one; in
    the gather protocol only the host's (a MIXED batch's running rows hold 0; a non-spec
    DECODE batch's are not read, None: T = B). `token_slots` ([T], gather protocol, MIXED
    only): where a running row's token goes, the slot to gather it from, else 0; a spec
    MIXED batch lists its running rows last, one per nonzero token slot in order.
    `forward_mode`: a traced int32 scalar serves every kind in one executable (on a mesh:
    a scalar or [DP]), a host ForwardMode fixes it when traced (refused if no ForwardMode
    value: 7, True, 1.0, "1"; a bad traced one runs as not DECODE, debug reports it).
    `draft_indices` ([B]): on a spec DECODE batch, the slots whose draft to gather.
    """

    forward_mode: Mode
    req_pool_indices: Rows  # [B]
    input_ids: Rows | None  # [T]; gather protocol: None for a non-spec DECODE batch
    seq_lens: Rows  # [B]
    draft_indices: Rows | None = None
    token_slots: Rows | None = None


class Resolved(NamedTuple):
    """What resolve hands the forward: ids and lengths with placeholders filled, and the draft."""

    input_ids: jax.Array  # [T]
    seq_lens: jax.Array  # [B]
    draft: Any = None  # a DraftPayload of jax arrays, or None


class MixedTails(NamedTuple):
    """A spec MIXED batch's host lengths with its running rows rebound (the host side of
    the late binding, `FutureMap.resolve_mixed_tails_cpu`); one entry per row."""

    seq_lens_cpu: np.ndarray  # [B] int64: the host's, running rows' published length + 1
    seq_lens_sum: int  # the sum over the live rows (slot > 0)
    prefix_lens: np.ndarray | None  # [B] int64: the host's, running rows' published length


def host_mode(mode: Any, where: str) -> ForwardMode:
    """A forward mode given on the host: an int of a ForwardMode value, never a bool, float
    or string (int() would make DECODE of True, 1.7 and "1")."""
    if isinstance(mode, bool | np.bool_) or not isinstance(mode, int | np.integer):
        raise FutureMapError(f"{where} must be a ForwardMode, got {mode!r}")
    try:
        return ForwardMode(int(mode))
    except ValueError:
        raise FutureMapError(f"{where} must be a ForwardMode, got {mode!r}") from None


def int_dtype(dtype: object) -> np.dtype:
    """A user's int dtype as int32 or int64, refusing int64 without x64 mode."""
    try:
        d = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        raise FutureMapError(f"dtype must be int32 or int64, got {dtype!r}") from None
    if d not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise FutureMapError(f"dtype must be int32 or int64, got {d}")
    if d == np.int64 and not jax.config.read("jax_enable_x64"):
        raise FutureMapError(
            "dtype int64 needs JAX's x64 mode; enable it before building the map "
            "(jax.config.update('jax_enable_x64', True)). fm_jax never flips global config."
        )
    return d


CONFIDENCE_DTYPE = np.dtype(np.float32)  # a confidence row's values (SGLang's: float32)
CONFIDENCE_BITS = np.dtype(np.uint32)  # what its buffer holds: their raw bits


def confidence_width(spec: Any) -> int:
    """gamma, the width of a slot's confidence row; 0 when the map relays none."""
    return 0 if spec is None else spec.confidence


class OpsConfig(NamedTuple):
    """A map's static configuration as its ops read it (`ops.future_map` fixes it)."""

    pool_size: int  # R, slots; slot 0 is padding
    dtype: np.dtype  # of tokens, lengths and top-k ids
    spec: Any  # a relay_fields.SpecConfig, or None
    fields: tuple[Any, ...]  # every relayed field (RelayField), in stash order
    consumed: tuple[str, ...]  # the consume-tracked fields' names
    debug: bool  # poison and checkify checks
    protocol: Any  # a `protocol.Protocol`
    one_kernel: bool  # spec fields move in one Pallas kernel per op


class FutureMapOps(NamedTuple):
    """The pure FutureMap ops for one static configuration.

    Attributes:
      init: () -> FutureMapState, the zeroed (debug: poisoned) buffers.
      publish: (state, indices, new_seq_lens, confidence=None) -> state; `confidence`
        ([B, gamma] float32) only where the spec declares gamma.
      stash: (state, indices, tokens | DraftPayload) -> state; a draft writes the fields
        it gives (every consume-tracked one) and keeps the others' rows.
      resolve: (state, batch) -> (state, Resolved); the state changes only in debug mode.
        A draft gather gives every declared field (a row never stashed reads 0): which
        were ever stashed is known on the host only (the class tracks it).
      invalidate: (batch, indices) -> batch with sentinels `-indices` as ids and lengths
        (sentinel protocol only).
      seq_lens_at: (state, indices) -> `new_seq_lens[indices]`, the device side of
        `resolve_seq_lens_cpu` (debug: slot checks, lengths not poisoned).
      pool_size, dtype, spec, debug, protocol: the static configuration.
      layout: on a mesh (`future_map(..., mesh=)`), its `sharding.MeshLayout`: every array
        is global ([DP*R, ...] buffers, [DP*B, ...] rows), each rank's block run by
        `local`, the one-pool ops; None (and `local` None) for one pool on one device.
    """

    init: Callable[[], FutureMapState]
    publish: Callable[..., FutureMapState]
    stash: Callable[[FutureMapState, Any, Any], FutureMapState]
    resolve: Callable[[FutureMapState, Batch], tuple[FutureMapState, Resolved]]
    invalidate: Callable[[Batch, Any], Batch]
    seq_lens_at: Callable[[FutureMapState, Any], jax.Array]
    pool_size: int
    dtype: np.dtype
    spec: Any  # a relay_fields.SpecConfig, or None
    debug: bool
    protocol: str = "sentinel"
    layout: Any = None
    local: FutureMapOps | None = None

    def map_ranks(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` run on each DP rank's block (`MeshLayout.map`), as a mesh's ops run theirs:
        under the Pallas kernel without shard_map's varying-axes check, which Pallas's CPU
        interpreter cannot trace under (jax 0.10.2); the ops hold no collective for it."""
        if self.layout is None:
            raise FutureMapError("map_ranks needs the ops of a mesh (future_map(..., mesh=))")
        vma = self.spec is None or self.spec.kernel != "pallas"
        return self.layout.map(fn, check_vma=vma)


# ------------------------------------------------------------------ trace-time checks
def _dtype(x: Any) -> np.dtype:
    return np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)


def check_1d_int(name: str, x: Any, into: np.dtype | None = None) -> None:
    """FutureMapError unless `x` is a 1-D integer array (whose values all fit `into`)."""
    shape = jnp.shape(x)
    if len(shape) != 1:
        raise FutureMapError(f"{name} must be 1-D, got shape {shape}")
    check_ints(name, x, into)


def check_ints(name: str, x: Any, into: np.dtype | None = None) -> None:
    """FutureMapError unless `x` has an int dtype whose every value (as JAX holds it) fits
    `into` without a cast that could change it (int64 rows for int32 buffers are refused)."""
    if not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must have an integer dtype, got {_dtype(x)}")
    held = jax.dtypes.canonicalize_dtype(_dtype(x))
    if into is not None and not np.can_cast(held, into, "safe"):
        raise FutureMapError(
            f"{name} has dtype {held}, which the {np.dtype(into)} buffers cannot hold without "
            "a value check: cast it first"
        )


def check_rows(name: str, x: Any, rows: int) -> None:
    """FutureMapError unless `x` has `rows` leading entries (one per batch row)."""
    if jnp.shape(x)[0] != rows:
        raise FutureMapError(f"{name} has {jnp.shape(x)[0]} rows, indices have {rows}")


def check_array(name: str, x: Any, shape: tuple[int, ...], dtype: np.dtype | None = None) -> None:
    """FutureMapError unless `x` is given with exactly `shape` (and, given, `dtype`: the
    declared dtype of a field that is not an int)."""
    if x is None:
        raise FutureMapError(f"{name} is missing")
    if tuple(jnp.shape(x)) != shape:
        raise FutureMapError(f"{name} must have shape {shape}, got {tuple(jnp.shape(x))}")
    if dtype is not None and _dtype(x) != dtype:
        raise errors.not_the_declared_dtype(name, _dtype(x), dtype)


def check_int_array(name: str, x: Any) -> None:
    """FutureMapError unless `x` is an integer array or scalar (of any shape)."""
    if x is None or isinstance(x, str) or not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must be an int array, got {x!r}")


def check_scalar_int(name: str, x: Any) -> None:
    """FutureMapError unless `x` is a 0-d integer (the forward mode)."""
    shape = np.shape(x)  # no jnp.shape: it refuses None and strings
    if shape != () or not np.issubdtype(_dtype(x), np.integer):
        raise FutureMapError(f"{name} must be an int scalar, got shape {shape} {_dtype(x)}")
