"""Resolve, what fills a batch's inputs at forward entry: the batch checked, then its
protocol's body; in debug mode the consume poison written back where it read."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax.ops import checks, errors
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.checks import check_1d_int, check_scalar_int, host_mode
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import Protocol
from fm_jax.ops.relay_fields import draft_payload
from fm_jax.ops.rows import gather, gather_rows, scatter
from fm_jax.ops.types import (
    Batch,
    DraftPayload,
    ForwardMode,
    FutureMapState,
    RelayField,
    Resolved,
    SpecConfig,
)


class OpsConfig(NamedTuple):
    """A map's static configuration as its ops read it (`ops.future_map` fixes it)."""

    pool_size: int  # R, slots; slot 0 is padding
    dtype: np.dtype  # of tokens, lengths and top-k ids
    spec: SpecConfig | None
    fields: tuple[RelayField, ...]  # every relayed field, in stash order
    consumed: tuple[str, ...]  # the consume-tracked fields' names
    debug: bool  # poison and checkify checks
    protocol: Protocol
    one_kernel: bool  # spec fields move in one Pallas kernel per op


POISON = -1
"""Debug-mode content of a consume-tracked slot with no unread write."""

# Every read of a consume-tracked buffer: (field, values, slots read, slots poisoned); a
# read this batch does not do (a traced mode's other kind) reads slot 0 and poisons slot R.
Reads = list[tuple[str, jax.Array, jax.Array, jax.Array]]


def check_indices(
    cfg: OpsConfig, name: str, indices: Any, chk: checks.OpChecks | None, rows: int | None = None
) -> None:
    """Shape checks (`rows` entries, where given); in debug mode the slot checks too."""
    check_1d_int(name, indices, cfg.dtype, rows)
    if chk is not None:
        checks.valid_slots(name, indices, cfg.pool_size, cfg.dtype, chk)


def resolve(cfg: OpsConfig, state: FutureMapState, batch: Batch) -> tuple[FutureMapState, Resolved]:
    """Fill the batch's placeholders from the buffers: its fields checked, then the
    protocol's body (`resolve_sentinel` or `resolve_gather`)."""
    dt, protocol = cfg.dtype, cfg.protocol
    idx: jax.Array = batch.req_pool_indices  # type: ignore[assignment]  # traced here
    chk = checks.OpChecks() if cfg.debug else None
    if cfg.spec is None and batch.draft_indices is not None:
        raise errors.draft_indices_on_plain_map()
    if batch.token_slots is not None and not protocol.takes_token_slots:
        raise errors.token_slots_in_sentinel_protocol()
    check_indices(cfg, "req_pool_indices", idx, chk)
    mode = batch.forward_mode
    if isinstance(mode, int | np.integer):  # a host int branches when traced
        mode = host_mode(mode, "forward_mode")
    else:
        check_scalar_int("forward_mode", mode)
        if chk is not None:
            top = max(int(m) for m in ForwardMode)
            msg = (
                f"[{checks.FORWARD_MODE}] forward_mode {{value}} is not a ForwardMode "
                f"(0..{top}); the batch ran as one that is not DECODE"
            )
            traced: Any = mode
            chk.add(None, lambda _: checks.check((traced >= 0) & (traced <= top), msg, dt, traced))
    if batch.input_ids is None:
        if not protocol.gathers_decode_ids:
            raise FutureMapError("batch.input_ids is None: a sentinel-protocol batch has ids")
        if not isinstance(mode, int | np.integer):
            raise errors.no_ids_with_traced_mode("batch.")
        if mode != ForwardMode.DECODE:
            raise errors.no_ids_for_kind(ForwardMode(mode).name, "batch.")
        batch = batch._replace(input_ids=jnp.zeros(jnp.shape(idx)[0], dt))
    check_1d_int("input_ids", batch.input_ids, dt)
    check_1d_int("seq_lens", batch.seq_lens, dt, jnp.shape(idx)[0])
    fill = resolve_sentinel if protocol.invalidates else resolve_gather
    return fill(cfg, state, batch, idx, mode, chk)


def row_min(x: jax.Array) -> jax.Array:
    """A row's smallest value (a row with a negative entry reads as one)."""
    return x if x.ndim == 1 else x.reshape(x.shape[0], -1).min(axis=1)


def gather_draft(
    cfg: OpsConfig, state: FutureMapState, didx: jax.Array, *also: jax.Array
) -> tuple[DraftPayload, list[jax.Array]]:
    """The draft stashed at `didx` (every declared field, as its values), and the rows at
    `didx` of the buffers `also`, read in the same gather."""
    fields = cfg.fields
    bufs = [*(rf.get(state, f.name) for f in fields), *also]
    got = gather_rows(bufs, didx, cfg.one_kernel, cfg.dtype)
    draft = draft_payload(
        {f.name: rf.from_buffer(f, v, cfg.dtype) for f, v in zip(fields, got, strict=False)}
    )
    return draft, got[len(fields) :]


def consumed_rows(cfg: OpsConfig, draft: DraftPayload) -> list[tuple[str, jax.Array]]:
    """(name, one value per row) of each consume-tracked field of a gathered draft."""
    return [(name, row_min(jnp.asarray(rf.get(draft, name)))) for name in cfg.consumed]


def consume(
    state: FutureMapState,
    reads: Reads,
    chk: checks.OpChecks,
    lengths: jax.Array | None = None,
    k_len: int | None = None,
) -> FutureMapState:
    """Debug: the consume check over every read, the op's checks run, then POISON written
    at each read's poisoned slots and, given, at `lengths`, the slots whose lengths were
    restored (their check `k_len`); slot R is dropped. Each write is ordered after the
    reads its check's maximum was reduced from: without that data dependence XLA's copy
    insertion cannot prove the order and copies the whole buffer, O(R) per resolve
    (`max(min(x, POISON), POISON)` is POISON for every x yet survives the simplifier)."""
    k = None
    if reads:
        values = jnp.concatenate([v for _, v, _, _ in reads])
        k = checks.consumed_values_valid(values, jnp.concatenate([s for _, _, s, _ in reads]), chk)
    maxima = chk.run()
    names = dict.fromkeys(f for f, _, _, _ in reads)
    writes = [(f, jnp.concatenate([p for g, _, _, p in reads if g == f]), k) for f in names]
    if lengths is not None:
        writes.append(("new_seq_lens", lengths, k_len))
    for field, slots, at in writes:
        if maxima is None or at is None or slots.shape[0] == 0:
            continue
        lens = field == "new_seq_lens"
        buf = state.new_seq_lens if lens else rf.get(state, field)
        dep = jnp.maximum(jnp.minimum(maxima[at].astype(buf.dtype), POISON), POISON)
        buf = scatter(buf, slots, jnp.broadcast_to(dep, (slots.shape[0], *buf.shape[1:])))
        state = state._replace(new_seq_lens=buf) if lens else rf.put(state, field, buf)
    return state


def resolve_sentinel(
    cfg: OpsConfig, state: FutureMapState, batch: Batch, idx: jax.Array, mode: Any, chk: Any
) -> tuple[FutureMapState, Resolved]:
    """The sentinel protocol's resolve: DECODE `seq_lens := new_seq_lens[idx]`; non-spec
    `input_ids := where(ids < 0, output_tokens[max(-ids, 0)], ids)`; spec, with
    `draft_indices`, the draft gathered. Debug: the consume check, then -1 written back at
    the slots read."""
    dt, r, spec = cfg.dtype, cfg.pool_size, cfg.spec
    known = isinstance(mode, int | np.integer)
    if spec is not None and known and mode == ForwardMode.MIXED:
        raise errors.spec_mixed_in_sentinel_protocol()
    if spec is not None and chk is not None and not known:
        # A spec MIXED batch's running rows' sentinels would reach the forward unfilled.
        msg = (
            f"[{checks.BATCH_FIELDS}] a spec MIXED batch (forward_mode {{value}}) in the "
            "sentinel protocol: its running rows' ids and lengths were not filled"
        )
        chk.add(None, lambda _: checks.check(mode != ForwardMode.MIXED, msg, dt, mode))
    if known:  # only a DECODE executable gathers lengths
        decode = int(mode) == ForwardMode.DECODE
        is_decode: jax.Array = jnp.asarray(decode)
        seq_lens = gather(state.new_seq_lens, idx) if decode else jnp.asarray(batch.seq_lens, dt)
    else:
        decode = True  # may be: the branch below decides on the device
        is_decode = jnp.asarray(mode == ForwardMode.DECODE)
        # A branch, not a per-row select: XLA:CPU runs computations under ~1000 flops inline.
        seq_lens = jax.lax.cond(
            is_decode,
            lambda: gather(state.new_seq_lens, idx),
            lambda: jnp.asarray(batch.seq_lens, dt),
        )
    ids, k_len = jnp.asarray(batch.input_ids, dt), None
    if chk is not None:
        k_len = checks.positive_lengths(is_decode, seq_lens, idx, chk)
        checks.sentinels_in_range(ids, r, chk)
    if spec is None:
        is_ref = ids < 0
        # Rows with ids >= 0 gather at -ids <= 0, clipped to slot 0, and keep their ids.
        input_ids = jnp.where(is_ref, gather(state.output_tokens, -ids), ids)
        if chk is not None:  # ids >= 0 read slot 0, never flagged; poisoned: the batch's
            # slots and the slots its sentinels read (else slot R, dropped)
            hit = jnp.concatenate([jnp.asarray(idx, dt), jnp.where(is_ref, -ids, r)])
            state = consume(state, [("bonus_tokens", input_ids, -ids, hit)], chk)
        return state, Resolved(input_ids, seq_lens)
    reads: Reads = []
    draft = None
    if batch.draft_indices is not None:
        didx: jax.Array = batch.draft_indices  # type: ignore[assignment]  # traced here
        check_indices(cfg, "draft_indices", didx, chk, jnp.shape(idx)[0])  # a draft slot per row
        draft, _ = gather_draft(cfg, state, didx)
        if chk is not None:
            reads = [(name, v, didx, didx) for name, v in consumed_rows(cfg, draft)]
    if chk is not None:
        # A DECODE consumes the lengths it restored (-1 written back at its live slots;
        # another kind's rows aim at slot R, dropped).
        restored = jnp.where(is_decode & (idx > 0), idx, r) if decode else None
        state = consume(state, reads, chk, restored, k_len)
    return state, Resolved(jnp.asarray(batch.input_ids), jnp.asarray(seq_lens), draft)


def resolve_gather(
    cfg: OpsConfig, state: FutureMapState, batch: Batch, idx: jax.Array, mode: Any, chk: Any
) -> tuple[FutureMapState, Resolved]:
    """The gather protocol's resolve: the forward's inputs built at its entry.

    Ids: EXTEND and IDLE as given; non-spec DECODE `output_tokens[req_pool_indices]`;
    MIXED `output_tokens[token_slots]` where a token slot is nonzero. Lengths: as given,
    except a spec DECODE batch's (`new_seq_lens[draft_indices]`) and a spec MIXED batch's
    running rows' (`_bind_running_lengths`). A traced mode gathers for DECODE and MIXED
    both and selects per row: O(B + T) either way.
    """
    dt, r, spec = cfg.dtype, cfg.pool_size, cfg.spec
    ids = jnp.asarray(batch.input_ids, dt)
    t, b = ids.shape[0], idx.shape[0]
    known = isinstance(mode, int | np.integer)
    is_decode: Any = mode == ForwardMode.DECODE
    # Gathers at its token slots: a fixed mode when not DECODE (the host refuses token
    # slots on a batch not MIXED); a traced mode only when MIXED.
    takes_slots: Any = (not is_decode) if known else mode == ForwardMode.MIXED
    if known and mode == ForwardMode.MIXED and batch.token_slots is None:
        raise errors.mixed_without_token_slots()
    if known and batch.token_slots is not None and is_decode:
        raise errors.token_slots_for_decode()
    if chk is not None:
        checks.ids_not_negative(ids, chk)
    # (field, values, slots read, whether this batch does the read)
    reads: list[tuple[str, jax.Array, jax.Array, Any]] = []
    out, ts = ids, None
    if batch.token_slots is not None:  # a fixed mode here is not DECODE: it takes them
        check_1d_int("token_slots", batch.token_slots, dt, t)
        ts = jnp.asarray(batch.token_slots, dt)
        if chk is not None:
            checks.valid_slots("token_slots", ts, r, dt, chk)
            if not known:  # only a MIXED batch's token slots gather
                msg = (
                    f"[{checks.BATCH_FIELDS}] token_slots name slot {{value}} in a batch that "
                    "is not MIXED (only a MIXED batch's running rows gather; the slot was not "
                    "read)"
                )
                other = mode != ForwardMode.MIXED
                chk.add(
                    checks.witness(other & (ts > 0), ts),
                    lambda slot: checks.check(slot == 0, msg, dt, slot),
                )
        got = gather(state.output_tokens, ts)
        # A token slot of 0 keeps the host's id (padding: never gathered nor checked).
        reads.append(("bonus_tokens", got, ts, takes_slots))
        out = jnp.where(takes_slots & (ts > 0), got, out)
    elif chk is not None and not known:  # a MIXED batch brings token slots
        msg = (
            f"[{checks.BATCH_FIELDS}] a MIXED batch (forward_mode {{value}}) came without "
            "token_slots: its running rows kept the host's ids"
        )
        chk.add(None, lambda _: checks.check(mode != ForwardMode.MIXED, msg, dt, mode))
    if spec is None and (not known or is_decode):
        if t < b:
            raise FutureMapError(
                f"input_ids has {t} entries, fewer than the {b} rows a DECODE batch gathers"
            )
        got = gather(state.output_tokens, idx)
        reads.append(("bonus_tokens", got, idx, is_decode))
        # Padding rows (slot 0) get id 0, not slot 0's garbage.
        got = jnp.where(idx > 0, got, 0)
        out = jnp.where(is_decode, jnp.pad(got, (0, t - b)), out)
    seq_lens = jnp.asarray(batch.seq_lens, dt)
    if spec is not None and ts is not None:
        seq_lens = _bind_running_lengths(cfg, state, idx, ts, takes_slots, seq_lens, chk)
    draft, restored, k_len = None, None, None  # restored: the spec DECODE lengths read
    if batch.draft_indices is not None:
        didx: jax.Array = batch.draft_indices  # type: ignore[assignment]  # traced here
        check_indices(cfg, "draft_indices", didx, chk, b)
        # A spec DECODE batch's lengths are the verified ones last published.
        draft, (got,) = gather_draft(cfg, state, didx, state.new_seq_lens)
        seq_lens = got if known and is_decode else jnp.where(is_decode, got, seq_lens)
        if chk is not None:
            k_len = checks.positive_lengths(jnp.asarray(is_decode), got, didx, chk)
            for name, v in consumed_rows(cfg, draft):
                if name == "bonus_tokens" and ts is not None:
                    # A slot the token slots read too is read twice: in order, the draft's
                    # read finds the poison the first left (one compare per row and token).
                    twice = takes_slots & (didx[:, None] == ts[None, :]).any(axis=1)
                    v = jnp.where(twice, POISON, v)
                reads.append((name, v, didx, True))
            if not known or is_decode:  # the verified lengths it read are consumed
                restored = jnp.where(is_decode & (didx > 0), didx, r)
    if chk is not None:
        done = [(f, v, jnp.where(a, s, 0), jnp.where(a & (s > 0), s, r)) for f, v, s, a in reads]
        state = consume(state, done, chk, restored, k_len)
    return state, Resolved(out, seq_lens, draft)


def _bind_running_lengths(
    cfg: OpsConfig,
    state: FutureMapState,
    idx: jax.Array,
    ts: jax.Array,
    takes: Any,
    lens: Any,
    chk: Any,
) -> jax.Array:
    """Spec MIXED: the host planned this batch before the last verify's accept lengths
    landed, so its running rows' lengths are bound here: the published length plus the
    token this forward feeds. SGLang's layout: prefill rows, then one running row per
    nonzero token slot in order; padding rows (slot 0) are not counted."""
    dt = cfg.dtype
    live = idx > 0
    order = jnp.cumsum(live, dtype=dt) - 1  # a live row's place among the live rows
    first = jnp.sum(live, dtype=dt) - jnp.sum(ts > 0, dtype=dt)
    running = takes & live & (order >= first)
    fresh = gather(state.new_seq_lens, idx)
    if chk is not None:
        checks.running_rows_match(running, idx, ts, order - first, chk)
        checks.positive_lengths(jnp.asarray(True), jnp.where(running, fresh, 1), idx, chk)
    return jnp.where(running, fresh + 1, lens)
