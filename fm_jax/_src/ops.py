"""The FutureMap as pure functions over a state pytree (optax style).

`future_map(...)` fixes the static configuration and returns `FutureMapOps`, a NamedTuple
of pure functions. Each takes and returns arrays only, so an engine can inline them in
its own jitted step: resolve at the head, publish and stash at the tail, state threaded
through (and donated by the engine's jit, so every write is in place).

Writes scatter with mode='drop' and no negative-index wrapping: an out-of-range slot
writes nothing rather than another slot. Debug mode adds checkify checks (see checks.py).

A spec map's fields each live in their own buffer. XLA moves each with its own scatter or
gather (a kernel launch each on a GPU); `SpecConfig(kernel='pallas')` moves all of a stash's
fields in one kernel, and all of a draft gather's (row_kernel.py), with the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax._src import checks, refusals, row_kernel
from fm_jax._src import relay_fields as rf
from fm_jax._src import shapes as s
from fm_jax._src.errors import FutureMapError
from fm_jax._src.protocol import parse_protocol
from fm_jax._src.types import (
    Batch,
    DraftPayload,
    ForwardMode,
    FutureMapState,
    Resolved,
    SpecConfig,
    draft_payload,
    host_mode,
    int_dtype,
)

POISON = -1
"""Debug-mode content of an `output_tokens` slot with no unread write."""

HIDDEN_DTYPES = rf.HIDDEN_DTYPES


class FutureMapOps(NamedTuple):
    """The pure FutureMap ops for one static configuration.

    Attributes:
      init: () -> FutureMapState, the zeroed (debug: poisoned) buffers.
      publish: (state, indices, new_seq_lens) -> state.
      stash: (state, indices, tokens | DraftPayload) -> state.
      resolve: (state, batch) -> (state, Resolved). The state changes only in debug mode.
      invalidate: (batch, indices) -> batch with sentinels `-indices` as ids and lengths
        (the sentinel protocol only).
      seq_lens_at: (state, indices) -> `new_seq_lens[indices]`, the device side of
        `resolve_seq_lens_cpu` (debug: slot checks).
      pool_size, dtype, spec, debug, protocol: the static configuration.
    """

    init: Callable[[], FutureMapState]
    publish: Callable[[FutureMapState, Any, Any], FutureMapState]
    stash: Callable[[FutureMapState, Any, Any], FutureMapState]
    resolve: Callable[[FutureMapState, Batch], tuple[FutureMapState, Resolved]]
    invalidate: Callable[[Batch, Any], Batch]
    seq_lens_at: Callable[[FutureMapState, Any], jax.Array]
    pool_size: int
    dtype: np.dtype
    spec: SpecConfig | None
    debug: bool
    protocol: str = "sentinel"


def _scatter(buf: jax.Array, indices: jax.Array, values: jax.Array) -> jax.Array:
    """`buf[indices] := values`; out-of-range slots (negative included) write nothing."""
    return buf.at[indices].set(values.astype(buf.dtype), mode="drop", wrap_negative_indices=False)


def _poison_after(seen: jax.Array, rows: int, dtype: Any) -> jax.Array:
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


def _poison(
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
    poison = _poison_after(maxima[k], slots.shape[0], buf.dtype)
    poison = jnp.broadcast_to(
        poison.reshape(-1, *(1,) * (buf.ndim - 1)), (slots.shape[0], *buf.shape[1:])
    )
    return rf.put(state, field, _scatter(buf, slots, poison))


def _row_min(x: jax.Array) -> jax.Array:
    """One value per row: a row's smallest (a row with a negative entry reads as one)."""
    return x if x.ndim == 1 else x.reshape(x.shape[0], -1).min(axis=1)


def _gather(buf: jax.Array, indices: jax.Array) -> jax.Array:
    """`buf[indices]`; out-of-range slots clip to [0, R) (a negative slot reads slot 0).

    No negative-index wrapping: that would cost a few flops per row for nothing.
    """
    return buf.at[indices].get(mode="clip", wrap_negative_indices=False)


def future_map(
    pool_size: int,
    *,
    dtype: Any = jnp.int32,
    spec: SpecConfig | None = None,
    debug: bool = False,
    protocol: str = "sentinel",
) -> FutureMapOps:
    """Build the pure FutureMap ops for a pool of `pool_size` slots.

    Args:
      pool_size: R, rows of the request pool (max running requests + 1); slot 0 is padding.
      dtype: int32 (default) or int64 (needs JAX's x64 mode) for tokens, lengths, top-k ids.
      spec: the spec extras' static shapes, or None for non-spec decoding.
      debug: poison `output_tokens` with -1 and add the checkify invariant checks.
      protocol: 'sentinel' (the host leaves -slot placeholders that resolve fills) or
        'gather' (resolve gathers decode ids and spec lengths at forward entry; no
        invalidate). docs/CONTRACT.md, 'Two protocols'.

    Returns:
      FutureMapOps. Inputs are checked for rank, shape and dtype when traced.
    """
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 2:
        raise FutureMapError(f"pool_size must be an int >= 2 (slot 0 is padding), got {pool_size}")
    if not isinstance(debug, bool):
        raise FutureMapError(f"debug must be a bool, got {debug!r}")
    dt = int_dtype(dtype)
    gather = not parse_protocol(protocol).invalidates  # resolve gathers at named slots
    if spec is not None:
        spec = rf.check_spec(spec)
    # What a spec map relays, in stash order; the bonus tokens live in output_tokens.
    fields = spec.fields() if spec is not None else ()
    consumed = [f.name for f in fields if f.consumed]
    r = pool_size
    one_kernel = spec is not None and spec.kernel == "pallas"
    for f in fields if one_kernel else ():
        row_kernel.check_fits(f.name, r, math.prod(f.shape), dt)

    def scatter_rows(bufs: list[jax.Array], idx: Any, values: list[Any]) -> list[jax.Array]:
        """`_scatter` of each value into its buffer at `idx`: one kernel for them all with
        `spec.kernel='pallas'` (row_kernel), else one scatter per buffer."""
        values = [jnp.asarray(v).astype(b.dtype) for b, v in zip(bufs, values, strict=True)]
        if one_kernel:
            return row_kernel.scatter(bufs, jnp.asarray(idx, dt), values)
        return [_scatter(b, idx, v) for b, v in zip(bufs, values, strict=True)]

    def gather_rows(bufs: list[jax.Array], idx: jax.Array) -> list[jax.Array]:
        """`_gather` of each buffer at `idx`: one kernel for them all with
        `spec.kernel='pallas'` (row_kernel), else one gather per buffer."""
        if one_kernel and idx.shape[0] > 0:
            return row_kernel.gather(bufs, jnp.asarray(idx, dt))
        return [_gather(b, idx) for b in bufs]

    def init() -> FutureMapState:
        tokens = jnp.full((r,), POISON if debug else 0, dtype=dt)
        state = FutureMapState(tokens, jnp.zeros((r,), dtype=dt))
        for f in fields:
            if f.name != "bonus_tokens":
                fill = POISON if debug and f.consumed else 0
                buf = jnp.full((r, *f.shape), fill, dtype=rf.buffer_dtype(f, dt))
                state = rf.put(state, f.name, buf)
        return state

    def check_indices(name: str, indices: Any, into: checks.OpChecks | None = None) -> None:
        """Shape checks; in debug mode the slot checks too, queued `into` the op's checks
        (or, without them, emitted at once)."""
        s.check_1d_int(name, indices, dt)
        if debug:
            own = into or checks.OpChecks()
            checks.valid_slots(name, indices, r, dt, own)
            if into is None:
                own.run()

    def publish(state: FutureMapState, indices: Any, new_seq_lens: Any) -> FutureMapState:
        """`new_seq_lens[indices] := new_seq_lens`; empty indices is a no-op."""
        chk = checks.OpChecks() if debug else None
        check_indices("indices", indices, chk)
        s.check_1d_int("new_seq_lens", new_seq_lens, dt)
        s.check_rows("new_seq_lens", new_seq_lens, jnp.shape(indices)[0])
        if chk is not None:
            checks.relayed_values(
                "new_seq_lens",
                checks.PUBLISHED_LENGTHS,
                jnp.asarray(new_seq_lens),
                jnp.asarray(indices),
                dt,
                chk,
            )
            chk.run()
        if jnp.shape(indices)[0] == 0:
            return state  # DP idle: nothing ran, nothing to relay
        return state._replace(new_seq_lens=_scatter(state.new_seq_lens, indices, new_seq_lens))

    def check_draft(draft: DraftPayload, rows: int) -> None:
        """Every declared field present, [rows, *shape] of its dtype; none undeclared."""
        assert spec is not None
        for f in fields:
            name, v = f"draft.{f.name}", rf.get(draft, f.name)
            if f.dtype is None and not f.shape:  # one int per row
                if v is None:
                    raise FutureMapError(f"{name} is missing")
                s.check_1d_int(name, v, dt)
                s.check_rows(name, v, rows)
            elif f.dtype is None:
                s.check_array(name, v, (rows, *f.shape), (np.dtype(np.int32), np.dtype(np.int64)))
                s.check_fits(name, v, dt)
            else:
                s.check_array(name, v, (rows, *f.shape), (f.dtype,))
        rf.check_declared(fields, draft)

    def stash(state: FutureMapState, indices: Any, payload: Any) -> FutureMapState:
        """Write tokens (non-spec) or a DraftPayload (spec) at `indices`; empty is a no-op."""
        chk = checks.OpChecks() if debug else None
        check_indices("indices", indices, chk)
        rows = jnp.shape(indices)[0]
        if spec is None:
            if isinstance(payload, DraftPayload):
                raise refusals.draft_on_plain_map()
            s.check_1d_int("tokens", payload, dt)
            s.check_rows("tokens", payload, rows)
        else:
            if not isinstance(payload, DraftPayload):
                raise refusals.tokens_on_spec_map()
            check_draft(payload, rows)
        if chk is not None:
            # Consumed fields must not be stashed negative: a -1 would read as the poison.
            relayed = (
                [("tokens", payload)]
                if spec is None
                else [(f"draft.{f.name}", rf.get(payload, f.name)) for f in fields if f.consumed]
            )
            for name, values in relayed:
                checks.relayed_values(
                    name,
                    checks.STASHED_TOKENS,
                    _row_min(jnp.asarray(values)),
                    jnp.asarray(indices),
                    dt,
                    chk,
                )
            chk.run()
        if rows == 0:
            return state  # DP idle: nothing ran, nothing to relay
        if spec is None:
            return state._replace(output_tokens=_scatter(state.output_tokens, indices, payload))
        bufs = [rf.get(state, f.name) for f in fields]
        values = [rf.to_buffer(f, jnp.asarray(rf.get(payload, f.name))) for f in fields]
        for f, buf in zip(fields, scatter_rows(bufs, indices, values), strict=True):
            state = rf.put(state, f.name, buf)
        return state

    def resolve(state: FutureMapState, batch: Batch) -> tuple[FutureMapState, Resolved]:
        """Fill the batch's placeholders from the buffers, at forward entry.

        1. DECODE: `seq_lens := new_seq_lens[req_pool_indices]` (debug: live rows > 0).
        2. Non-spec: `input_ids := where(ids < 0, output_tokens[max(-ids, 0)], ids)`.
           Spec: with `batch.draft_indices`, gather the draft extras and bonus tokens.
        3. Debug: consume check on what was gathered, then -1 written back to the batch's
           slots (spec: the draft's) and, non-spec, to the slots its sentinels read.
        """
        idx: jax.Array = batch.req_pool_indices  # type: ignore[assignment]  # traced here
        chk = checks.OpChecks() if debug else None
        if spec is None and batch.draft_indices is not None:
            raise refusals.draft_indices_on_plain_map()
        if batch.token_slots is not None and not gather:
            raise refusals.token_slots_in_sentinel_protocol()
        check_indices("req_pool_indices", idx, chk)
        mode = batch.forward_mode
        if isinstance(mode, int | np.integer):  # a host int branches when traced
            mode = host_mode(mode, "forward_mode")
        else:
            s.check_scalar_int("forward_mode", mode)
            if chk is not None:
                checks.known_mode(mode, dt, chk)  # type: ignore[arg-type]  # traced here
        if batch.input_ids is None:
            if not gather:
                raise FutureMapError("batch.input_ids is None: a sentinel-protocol batch has ids")
            if not isinstance(mode, int | np.integer):
                raise FutureMapError(
                    "batch.input_ids is None with a traced forward_mode: a batch whose kind is "
                    "known only on the device brings its ids (any id >= 0 at DECODE rows)"
                )
            if mode != ForwardMode.DECODE:
                raise FutureMapError(
                    f"batch.input_ids is None with forward_mode {ForwardMode(mode).name}: only "
                    "a DECODE batch comes without ids in the gather protocol"
                )
            batch = batch._replace(input_ids=jnp.zeros(jnp.shape(idx)[0], dt))
        s.check_1d_int("input_ids", batch.input_ids, dt)
        s.check_1d_int("seq_lens", batch.seq_lens, dt)
        s.check_rows("seq_lens", batch.seq_lens, jnp.shape(idx)[0])
        if gather:
            return resolve_gather(state, batch, idx, mode, chk)
        if spec is not None and isinstance(mode, int | np.integer) and mode == ForwardMode.MIXED:
            raise refusals.spec_mixed_in_sentinel_protocol()
        if spec is not None and chk is not None and not isinstance(mode, int | np.integer):
            checks.no_spec_mixed(mode, dt, chk)  # type: ignore[arg-type]  # traced here

        if isinstance(mode, int | np.integer):
            # The mode is known when traced: only a DECODE executable gathers lengths.
            decode = int(mode) == ForwardMode.DECODE
            is_decode: jax.Array = jnp.asarray(decode)
            seq_lens = (
                _gather(state.new_seq_lens, idx) if decode else jnp.asarray(batch.seq_lens, dt)
            )
        else:
            is_decode = jnp.asarray(mode == ForwardMode.DECODE)
            # A branch, not a per-row select: only DECODE gathers, and the op stays a few
            # flops per row (XLA:CPU runs computations under ~1000 flops inline).
            seq_lens = jax.lax.cond(
                is_decode,
                lambda: _gather(state.new_seq_lens, idx),
                lambda: jnp.asarray(batch.seq_lens, dt),
            )
        if chk is not None:
            checks.positive_lengths(is_decode, seq_lens, idx, chk)

        if spec is None:
            ids = jnp.asarray(batch.input_ids, dt)
            if chk is not None:
                checks.sentinels_in_range(ids, r, chk)
            is_ref = ids < 0
            # Rows with ids >= 0 gather at -ids <= 0, clipped to slot 0, and keep their ids.
            input_ids = jnp.where(is_ref, _gather(state.output_tokens, -ids), ids)
            if chk is not None:
                # A row with ids >= 0 keeps ids >= 0, so it is never flagged; a reference
                # row's source slot is -ids (>= 1 once sentinels are in range).
                k = checks.consumed_values_valid(input_ids, -ids, chk)
                # Poisoned: the batch's slots and the slots its sentinels read (on a valid
                # batch, among them; rows that read nothing aim at slot R, dropped).
                read = jnp.where(is_ref, -ids, r)
                slots = jnp.concatenate([jnp.asarray(idx, dt), read])
                state = _poison(state, slots, chk.run(), k)
            return state, Resolved(input_ids, seq_lens)

        if chk is not None:
            checks.sentinels_in_range(jnp.asarray(batch.input_ids, dt), r, chk)
        if batch.draft_indices is None:
            if chk is not None:
                chk.run()
            # A prefill batch: no draft input.
            return state, Resolved(jnp.asarray(batch.input_ids), jnp.asarray(seq_lens))
        didx: jax.Array = batch.draft_indices  # type: ignore[assignment]  # traced here
        check_indices("draft_indices", didx, chk)
        s.check_rows("draft_indices", didx, jnp.shape(idx)[0])  # one draft slot per row
        draft, _ = gather_draft(state, didx)
        if chk is not None:
            reads = consumed_reads(draft, didx)
            k = None
            if reads:  # a spec may track no field (an n-gram draft's)
                values = jnp.concatenate([v for v, _ in reads])
                slots = jnp.concatenate([sl for _, sl in reads])
                k = checks.consumed_values_valid(values, slots, chk)
            maxima = chk.run()
            for f in consumed:
                state = _poison(state, didx, maxima, k, f)
        return state, Resolved(jnp.asarray(batch.input_ids), jnp.asarray(seq_lens), draft)

    def gather_draft(
        state: FutureMapState, didx: jax.Array, *also: jax.Array
    ) -> tuple[DraftPayload, list[jax.Array]]:
        """The draft stashed at `didx` (every declared field, as its values), and the rows
        at `didx` of the buffers `also`, read in the same gather."""
        got = gather_rows([*(rf.get(state, f.name) for f in fields), *also], didx)
        draft = draft_payload(
            {f.name: rf.from_buffer(f, v, dt) for f, v in zip(fields, got, strict=False)}
        )
        return draft, got[len(fields) :]

    def consumed_reads(draft: DraftPayload, didx: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """(one value per row, slots read) of each consume-tracked field a draft gather read."""
        return [(_row_min(jnp.asarray(rf.get(draft, name))), didx) for name in consumed]

    def resolve_gather(
        state: FutureMapState,
        batch: Batch,
        idx: jax.Array,
        mode: Any,
        chk: checks.OpChecks | None,
    ) -> tuple[FutureMapState, Resolved]:
        """The gather protocol's resolve: build the forward's inputs at its entry.

        Ids: EXTEND and IDLE as given; non-spec DECODE `output_tokens[req_pool_indices]`
        (padding rows 0, padded with 0 to T); MIXED the given ids where `token_slots` is
        0, else `output_tokens[token_slots]`. Token slots apply to any batch that is not DECODE
        (an executable that fixes 'not DECODE' serves EXTEND, MIXED and IDLE alike); only
        a MIXED batch has a nonzero one. Lengths: as given, except a spec DECODE batch's
        (it has a draft input): `new_seq_lens[draft_indices]`, the verified lengths last
        published; and a spec MIXED batch's running rows (the last live rows, one per
        nonzero token slot): `new_seq_lens[req_pool_indices] + 1`.
        Debug: every gather from `output_tokens` is consume-checked, and -1 written back at
        exactly the live slots it read; a slot the token slots and the draft both read is
        read twice (the draft's read finds the poison). A traced mode gathers for DECODE
        and MIXED both and selects per row: O(B + T) either way.
        """
        ids = jnp.asarray(batch.input_ids, dt)
        t, b = ids.shape[0], idx.shape[0]
        ts_in = batch.token_slots
        known = isinstance(mode, int | np.integer)
        is_decode: Any = mode == ForwardMode.DECODE
        # Gathers at its token slots. A mode fixed when traced is 'DECODE or not' (one
        # executable serves EXTEND, MIXED and IDLE; the host refuses token slots on a batch
        # that is not MIXED); a traced mode gathers only when MIXED (debug reports token
        # slots on another kind).
        takes_slots: Any = (not is_decode) if known else mode == ForwardMode.MIXED
        if known:
            if mode == ForwardMode.MIXED and ts_in is None:
                raise refusals.mixed_without_token_slots()
            if ts_in is not None and is_decode:
                raise refusals.token_slots_for_decode()
        if chk is not None:
            checks.ids_not_negative(ids, chk)
        # Each gather from output_tokens: (values, slots read, whether this batch does it).
        reads: list[tuple[jax.Array, jax.Array, Any]] = []
        out = ids
        ts_read: jax.Array | None = None  # the token slots, where this executable reads them
        if ts_in is not None and (not known or takes_slots):
            s.check_1d_int("token_slots", ts_in, dt)
            s.check_rows("token_slots", ts_in, t)
            ts = jnp.asarray(ts_in, dt)
            if chk is not None:
                checks.valid_slots("token_slots", ts, r, dt, chk)
                if not known:
                    checks.token_slots_only_mixed(mode, ts, dt, chk)
            got = _gather(state.output_tokens, ts)
            # A token slot of 0 keeps the host's id: slot 0 (padding) is never gathered, and
            # the consume check skips its reads.
            reads.append((got, ts, takes_slots))
            ts_read = ts
            out = jnp.where(takes_slots & (ts > 0), got, out)
        elif chk is not None and not known:
            checks.token_slots_only_mixed(mode, None, dt, chk)
        if spec is None and (not known or is_decode):
            if t < b:
                raise FutureMapError(
                    f"input_ids has {t} entries, fewer than the {b} rows a DECODE batch gathers"
                )
            got = _gather(state.output_tokens, idx)
            reads.append((got, idx, is_decode))
            # Padding rows (slot 0) get id 0, as in the sentinel protocol, not slot 0's garbage.
            got = jnp.where(idx > 0, got, 0)
            out = jnp.where(is_decode, jnp.pad(got, (0, t - b)), out)

        seq_lens = jnp.asarray(batch.seq_lens, dt)
        if spec is not None and ts_read is not None:
            # Spec MIXED: the host planned this batch before the last verify's accept lengths
            # landed, so its running rows' lengths are bound here: the published length plus
            # the token this forward feeds. SGLang's layout: prefill rows, then one running
            # row per nonzero token slot in order; padding rows (slot 0) are not counted.
            live = idx > 0
            order = jnp.cumsum(live, dtype=dt) - 1  # a live row's place among the live rows
            first = jnp.sum(live, dtype=dt) - jnp.sum(ts_read > 0, dtype=dt)
            running = takes_slots & live & (order >= first)
            fresh = _gather(state.new_seq_lens, idx)
            seq_lens = jnp.where(running, fresh + 1, seq_lens)
            if chk is not None:
                checks.running_rows_match(running, idx, ts_read, order - first, chk)
                checks.positive_lengths(jnp.asarray(True), jnp.where(running, fresh, 1), idx, chk)
        draft = None
        if batch.draft_indices is not None:
            didx: jax.Array = batch.draft_indices  # type: ignore[assignment]  # traced here
            check_indices("draft_indices", didx, chk)
            s.check_rows("draft_indices", didx, b)
            # A spec DECODE batch's lengths are the verified ones last published; any other
            # kind keeps the host's (a rank prefilling beside a spec decoding one).
            draft, (got,) = gather_draft(state, didx, state.new_seq_lens)
            seq_lens = got if known and is_decode else jnp.where(is_decode, got, seq_lens)
            if chk is not None:
                checks.positive_lengths(jnp.asarray(is_decode), got, didx, chk)
        if chk is not None:
            # (field, values, slots read, whether this batch does the read), every read of a
            # consume-tracked buffer.
            tracked = [("bonus_tokens", v, sl, a) for v, sl, a in reads]
            if draft is not None:
                drafted = consumed_reads(draft, didx)
                if ts_read is not None and "bonus_tokens" in consumed:
                    # A slot the token slots read too: in order, the draft's read finds the
                    # poison the first read left (one compare per row and token: debug only).
                    twice = takes_slots & (didx[:, None] == ts_read[None, :]).any(axis=1)
                    k_bonus = consumed.index("bonus_tokens")
                    v, sl = drafted[k_bonus]
                    drafted[k_bonus] = (jnp.where(twice, POISON, v), sl)
                tracked += [
                    (name, v, sl, True) for name, (v, sl) in zip(consumed, drafted, strict=True)
                ]
            k = None
            if tracked:
                # A read this batch does not do (a traced mode's other kind) names slot 0.
                values = jnp.concatenate([v for _, v, _, _ in tracked])
                sources = jnp.concatenate([jnp.where(a, sl, 0) for _, _, sl, a in tracked])
                k = checks.consumed_values_valid(values, sources, chk)
            maxima = chk.run()
            # -1 at the live slots read; a read not done aims at slot R (dropped).
            for name in dict.fromkeys(f for f, _, _, _ in tracked):
                hit = [jnp.where(a & (sl > 0), sl, r) for f, _, sl, a in tracked if f == name]
                state = _poison(state, jnp.concatenate(hit), maxima, k, name)
        return state, Resolved(out, seq_lens, draft)

    def invalidate(batch: Batch, indices: Any) -> Batch:
        """Leave sentinels for the next step: ids and lengths := -indices (padding: 0)."""
        if gather:
            raise FutureMapError(
                "invalidate: the gather protocol leaves no sentinels (resolve gathers the "
                "decode ids at forward entry)"
            )
        s.check_1d_int("indices", indices, dt)
        sentinel = -jnp.asarray(indices).astype(dt)
        return batch._replace(input_ids=sentinel, seq_lens=sentinel)

    def seq_lens_at(state: FutureMapState, indices: Any) -> jax.Array:
        """`new_seq_lens[indices]`; an out-of-range slot clips (never wraps to another)."""
        check_indices("indices", indices)
        return _gather(state.new_seq_lens, indices)

    return FutureMapOps(
        init, publish, stash, resolve, invalidate, seq_lens_at, r, dt, spec, debug, protocol
    )
