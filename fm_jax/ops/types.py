"""Pytrees and static configuration shared by fm_jax's ops and its FutureMap class."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax.ops import errors, row_kernel
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.relay_fields import STANDARD, RelayField, standard_fields


class ForwardMode(enum.IntEnum):
    """What kind of forward a batch runs (docs/CONTRACT.md, 'Batch kinds'); an int32 scalar."""

    EXTEND = 0  # prefill or a prefill chunk: real ids and lengths
    DECODE = 1  # ids and lengths are sentinels until resolve
    MIXED = 2  # prefill rows first, then running decode rows; lengths already restored
    IDLE = 3  # data-parallel rank with nothing to run: all rows padding


class SpecConfig(NamedTuple):
    """The fields a spec map relays, declared at init (`fields()`): as declared, bonus
    tokens, verified ids, top-k probabilities and ids, hidden states and the engine's own
    (docs/guide.md, 'Relay fields', declares SGLang's EAGLE and n-gram payloads).

    Attributes:
      topk: K, draft top-k width of `topk_p` / `topk_index`; 0 relays no top-k fields.
      hidden: H, width of `hidden_states`; 0 when the draft model relays none.
      hidden_dtype: bfloat16, float16 or float32.
      verified_id: relay each row's verified id (SGLang's EAGLE `verified_id`), consume-
        tracked like the bonus tokens.
      extra: the engine's own fields (`RelayField`s), relayed in `DraftPayload.extras`.
      bonus_tokens: relay each row's bonus token in `output_tokens`, consume-tracked; off
        for a draft that brings none (SGLang's n-gram payload).
      kernel: how stash and resolve move the fields: 'xla' (default), one scatter or
        gather per buffer; 'pallas', one kernel for every field (and, in the gather
        protocol, the lengths read at the draft slots), as SGLang's Triton kernels move
        its spec extras: Triton on a GPU, Pallas's interpreter on CPU (for tests), no TPU.
        Every field's dtype a real number or an int (no bool, no complex).
      confidence: gamma, the width of each slot's confidence row (DSpark): `publish` then
        takes `confidence=` rows [B, gamma] float32 with the lengths and starts their host
        copy into a ring the host reads without waiting (`FutureMap.resolve_confidence_cpu`);
        0 (default): no confidence relay.
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
        """Every relayed field, in stash order (`relay_fields.standard_fields`, then extra)."""
        std = standard_fields(
            self.topk, self.hidden, self.hidden_dtype, self.verified_id, self.bonus_tokens
        )
        return std + tuple(self.extra)


def check_spec(spec: Any) -> SpecConfig:
    """A SpecConfig normalised (numpy dtypes, a tuple of fields), or FutureMapError naming
    what no map could serve: topk and hidden ints >= 0, a bf16/f16/f32 hidden dtype,
    verified_id and bonus_tokens bools, extra a sequence of RelayFields (`check_extra`), a
    known kernel (one that moves every field's dtype), and at least one field declared."""
    if not isinstance(spec, SpecConfig):
        raise FutureMapError(f"spec must be a SpecConfig or None, got {spec!r}")
    if not rf.count_at_least(spec.topk, 0) or not rf.count_at_least(spec.hidden, 0):
        raise FutureMapError(f"spec needs topk >= 0 and hidden >= 0 (ints), got {spec}")
    if not rf.count_at_least(spec.confidence, 0):
        raise FutureMapError(f"spec.confidence must be an int >= 0, got {spec.confidence!r}")
    try:
        hidden_dtype = np.dtype(spec.hidden_dtype)
    except TypeError:
        hidden_dtype = None
    if hidden_dtype not in rf.HIDDEN_DTYPES:
        raise FutureMapError(f"spec.hidden_dtype must be bf16, f16 or f32, got {spec.hidden_dtype}")
    # A bool, or an int 0 / 1 written for one (normalised to the bool).
    for flag in ("verified_id", "bonus_tokens"):
        value = getattr(spec, flag)
        if not isinstance(value, bool | np.bool_) and value not in (0, 1):
            raise FutureMapError(f"spec.{flag} must be a bool, got {value!r}")
    if isinstance(spec.extra, str | bytes | rf.RelayField) or not isinstance(
        spec.extra, tuple | list
    ):
        raise FutureMapError(f"spec.extra must be a tuple of RelayFields, got {spec.extra!r}")
    out = spec._replace(
        topk=int(spec.topk),
        hidden=int(spec.hidden),
        hidden_dtype=hidden_dtype,
        verified_id=bool(spec.verified_id),
        bonus_tokens=bool(spec.bonus_tokens),
        extra=rf.check_extra(tuple(spec.extra)),
        kernel=row_kernel.check_kernel(spec.kernel),
        confidence=int(spec.confidence),
    )
    if not out.fields():
        raise FutureMapError(f"spec declares no field to relay: {spec}")
    if out.kernel == "pallas":
        for f in out.fields():
            if f.dtype is not None and not row_kernel.movable(np.dtype(f.dtype)):
                raise FutureMapError(
                    f"spec.kernel='pallas' moves real numbers and ints; field {f.name} is "
                    f"{f.dtype} (use kernel='xla')"
                )
    return out


class FutureMapState(NamedTuple):
    """The relay buffers, leading dimension R (pool size). Spec fields are None without spec.

    Slot 0 mirrors the request pool's padding row: padded rows write garbage there. A
    real-float field's buffer holds its raw bits, the unsigned int of its width (uint32 for
    topk_p, uint16 for bf16 hidden states): unsigned-int writes are in place and bit-exact
    on every backend; `jax.lax.bitcast_convert_type` views them as the declared dtype.
    """

    output_tokens: jax.Array  # [R] int: last token (non-spec) or bonus token (spec)
    new_seq_lens: jax.Array  # [R] int: length after the slot's last forward
    topk_p: jax.Array | None = None  # [R, K] float32, as its bits (uint32)
    topk_index: jax.Array | None = None  # [R, K] int
    hidden_states: jax.Array | None = None  # [R, H] the declared dtype, as its bits
    verified_id: jax.Array | None = None  # [R] int, when declared
    extras: dict[str, jax.Array] | None = None  # the engine's own fields by name, [R, ...]
    confidence: jax.Array | None = None  # [R, gamma] float32 as its bits, `SpecConfig.confidence`


Rows = jax.Array | np.ndarray
"""Per-row data: a jax array, or a host array where the FutureMap class takes one."""

RowsInput = jax.Array | np.ndarray | Sequence[Any] | Mapping[int, Any]
"""What a FutureMap method takes for per-row data: global rows (a jax array, a host array or
a list), or a mapping DP rank -> host rows."""


class DraftPayload(NamedTuple):
    """Speculative draft state: what `stash` writes and what `resolve` gathers. A field the
    spec does not declare is None. A stash writes the fields given and keeps the others'
    rows (a partial stash: every consume-tracked field given); the class's resolve gives
    None for a field no stash has written (`FutureMap.relayed_fields`)."""

    bonus_tokens: Rows | None = None  # [B] int
    topk_p: Rows | None = None  # [B, K] float32
    topk_index: Rows | None = None  # [B, K] int
    hidden_states: Rows | None = None  # [B, H], None when H == 0
    verified_id: Rows | None = None  # [B] int, when the spec declares it
    extras: Mapping[str, Rows] | None = None  # the engine's own fields by name, [B, ...]


def draft_payload(values: Mapping[str, Any]) -> DraftPayload:
    """A DraftPayload of fields by name: the standard ones as attributes (None when absent),
    the engine's own in `extras`."""
    extras = {k: v for k, v in values.items() if k not in STANDARD}
    return DraftPayload(
        bonus_tokens=values.get("bonus_tokens"),
        topk_p=values.get("topk_p"),
        topk_index=values.get("topk_index"),
        hidden_states=values.get("hidden_states"),
        verified_id=values.get("verified_id"),
        extras=extras or None,
    )


Mode = ForwardMode | int | jax.Array | np.ndarray | None
"""A batch's kind: known on the host (a ForwardMode; on a mesh also one per DP rank, an
int32 numpy array), or traced (an int32 jax array). None stands for a mode fixed inside
an executable."""


class Batch(NamedTuple):
    """The fields of a scheduled batch that resolve and invalidate touch.

    `input_ids` is flat ([T]): an EXTEND row contributes all its tokens, a decode row one.
    In the gather protocol it holds only the host's ids: a MIXED batch's prefill ids then
    a 0 at each running row's position, and a non-spec DECODE batch's are not read (None
    is taken: T = B). `token_slots` ([T], gather protocol, MIXED only) names, at each
    position a running row's token goes to, the slot to gather it from; 0 elsewhere. A spec
    map's MIXED batch lists its running rows last (before padding rows), one per nonzero
    token slot in order: resolve binds their lengths (published + 1).
    `forward_mode` is an int32 jax scalar (a ForwardMode value), traced, so one compiled
    step serves every batch kind (on a mesh: a scalar, or [DP], one mode per rank); a host
    ForwardMode fixes the mode when the op is traced instead (no branch in the executable;
    one executable per mode). A host mode that is not a ForwardMode value (7, True, 1.0,
    "1") is refused; a traced one runs as a batch that is not DECODE, and debug mode
    reports it ('forward mode'). `draft_indices` ([B]) is set on a spec DECODE batch: the slots
    whose draft to gather; None on batches without a draft input. The FutureMap class also
    takes host arrays for every field.
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
    draft: DraftPayload | None = None  # its fields are jax arrays


class MixedTails(NamedTuple):
    """A spec MIXED batch's host lengths with its running rows rebound (the host side of
    the late binding, `FutureMap.resolve_mixed_tails_cpu`); one entry per row."""

    seq_lens_cpu: np.ndarray  # [B] int64: the host's, running rows' published length + 1
    seq_lens_sum: int  # the sum over the live rows (slot > 0)
    prefix_lens: np.ndarray | None  # [B] int64: the host's, running rows' published length


def host_mode(mode: Any, where: str) -> ForwardMode:
    """A forward mode given on the host, as a ForwardMode: an int of a ForwardMode value,
    never a bool, float or string (int() would make DECODE of True, 1.7 and "1")."""
    if isinstance(mode, bool | np.bool_) or not isinstance(mode, int | np.integer):
        raise FutureMapError(f"{where} must be a ForwardMode, got {mode!r}")
    try:
        return ForwardMode(int(mode))
    except ValueError:
        raise FutureMapError(f"{where} must be a ForwardMode, got {mode!r}") from None


def int_dtype(dtype: object) -> np.dtype:
    """Normalise a user's int dtype to int32 or int64, refusing int64 without x64 mode."""
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


CONFIDENCE_DTYPE = np.dtype(np.float32)
"""The dtype of a confidence row (SGLang's confidence buffer: float32)."""

CONFIDENCE_BITS = np.dtype(np.uint32)
"""What the confidence buffer holds: each float32's raw bits (written bit for bit)."""


def confidence_width(spec: SpecConfig | None) -> int:
    """gamma, the width of a slot's confidence row; 0 when the map relays none."""
    return 0 if spec is None else spec.confidence


def payload_rows(spec: SpecConfig | None, payload: Any) -> list[tuple[str, Any]]:
    """Stash's payload as its per-row values by field name, once its kind is checked:
    tokens (`tokens`) on a map without spec; on a spec map a DraftPayload giving no field
    the spec leaves undeclared (`relay_fields.check_declared`), each declared field as
    `draft.<name>` (None where not given). What every entry point of stash checks first."""
    if spec is None:
        if isinstance(payload, DraftPayload):
            raise errors.draft_on_plain_map()
        if payload is None:
            raise FutureMapError("tokens is missing: stash on a map without spec takes [B] ints")
        return [("tokens", payload)]
    if not isinstance(payload, DraftPayload):
        raise errors.tokens_on_spec_map()
    fields = spec.fields()
    rf.check_declared(fields, payload)
    return [(f"draft.{f.name}", rf.get(payload, f.name)) for f in fields]


class FutureMapOps(NamedTuple):
    """The pure FutureMap ops for one static configuration.

    Attributes:
      init: () -> FutureMapState, the zeroed (debug: poisoned) buffers.
      publish: (state, indices, new_seq_lens, confidence=None) -> state; `confidence`
        ([B, gamma] float32) only on a map whose spec declares `confidence` (gamma).
      stash: (state, indices, tokens | DraftPayload) -> state; a draft writes the fields it
        gives (every consume-tracked one) and keeps the others' rows.
      resolve: (state, batch) -> (state, Resolved). The state changes only in debug mode.
        A draft gather gives every declared field (a row never stashed reads 0): which
        fields were ever stashed is known on the host only (the class tracks it).
      invalidate: (batch, indices) -> batch with sentinels `-indices` as ids and lengths
        (the sentinel protocol only).
      seq_lens_at: (state, indices) -> `new_seq_lens[indices]`, the device side of
        `resolve_seq_lens_cpu` (debug: slot checks, and lengths not poisoned).
      pool_size, dtype, spec, debug, protocol: the static configuration.
      layout: the mesh the ops run on (`future_map(..., mesh=)`): every array is global,
        [DP*R, ...] buffers and [DP*B, ...] rows, each DP rank's block run by `local`;
        None for the ops of one pool on one device.
      local: on a mesh, the one-pool ops each DP rank runs on its block; else None.
    """

    init: Callable[[], FutureMapState]
    publish: Callable[..., FutureMapState]
    stash: Callable[[FutureMapState, Any, Any], FutureMapState]
    resolve: Callable[[FutureMapState, Batch], tuple[FutureMapState, Resolved]]
    invalidate: Callable[[Batch, Any], Batch]
    seq_lens_at: Callable[[FutureMapState, Any], jax.Array]
    pool_size: int
    dtype: np.dtype
    spec: SpecConfig | None
    debug: bool
    protocol: str = "sentinel"
    layout: Any = None  # a sharding.MeshLayout (sharding.py builds on this module)
    local: FutureMapOps | None = None

    def map_ranks(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` run on each DP rank's block (`MeshLayout.map`), as a mesh's ops run theirs:
        without shard_map's varying-axes check under the Pallas spec kernel, which Pallas's
        interpreter (CPU) cannot trace under it (jax 0.10.2: 'dynamic_slice requires
        varying manual axes to match'); the ops hold no collective for it to find."""
        if self.layout is None:
            raise FutureMapError("map_ranks needs the ops of a mesh (future_map(..., mesh=))")
        vma = self.spec is None or self.spec.kernel != "pallas"
        return self.layout.map(fn, check_vma=vma)
