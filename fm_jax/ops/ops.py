"""The FutureMap as pure functions over a state pytree (optax style).

`future_map(...)` fixes the static configuration (`rows.OpsConfig`) and returns
`FutureMapOps`, a NamedTuple of pure functions: the module-level ops below with the
configuration bound. Each takes and returns arrays only, so an engine can inline them in
its own jitted step: resolve at the head, publish and stash at the tail, state threaded
through (and donated by the engine's jit, so every write is in place).

How rows move (drop out-of-range writes, clip reads, one kernel for a spec map's fields
with `SpecConfig(kernel='pallas')`): `rows.py`. The two protocols' resolve bodies:
`resolve_ops.py`, picked by the map's `Protocol`. Debug mode adds checkify checks
(checks.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fm_jax.ops import checks, errors, row_kernel
from fm_jax.ops import relay_fields as rf
from fm_jax.ops import shapes as s
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import parse_protocol
from fm_jax.ops.resolve_ops import resolve_gather, resolve_sentinel
from fm_jax.ops.rows import (
    POISON,
    OpsConfig,
    check_indices,
    gather,
    row_min,
    scatter,
    scatter_rows,
)
from fm_jax.ops.sharding import lift, mesh_layout
from fm_jax.ops.types import (
    CONFIDENCE_BITS,
    CONFIDENCE_DTYPE,
    Batch,
    DraftPayload,
    ForwardMode,
    FutureMapOps,
    FutureMapState,
    Resolved,
    SpecConfig,
    check_spec,
    confidence_width,
    host_mode,
    int_dtype,
    payload_rows,
)

__all__ = ["POISON", "FutureMapOps", "future_map"]

HIDDEN_DTYPES = rf.HIDDEN_DTYPES


def future_map(
    pool_size: int,
    *,
    mesh: Mesh | None = None,
    dp_axis: str | None = "dp",
    tp_axis: str | None = None,
    dtype: Any = jnp.int32,
    spec: SpecConfig | None = None,
    debug: bool = False,
    protocol: str = "sentinel",
) -> FutureMapOps:
    """Build the pure FutureMap ops for a pool of `pool_size` slots, on one device or a mesh.

    Args:
      pool_size: R, rows of the request pool (max running requests + 1); slot 0 is padding.
        On a mesh: slots per DP rank. Every slot fits `dtype`: R - 1 <= its largest value.
      mesh: a `jax.sharding.Mesh` to hold one pool per DP rank (sharding.py's layout: the
        state and every row argument are global arrays, rank d's block its own pool, each op
        run per rank with `jax.shard_map` and no collective); None (default): one pool.
        Jit the ops with the state donated for in-place writes; in debug mode wrap them in
        `checkify.checkify` (`fm_jax.raise_if_violated(err, layout=ops.layout)` names the
        DP rank of a failure).
      dp_axis: the mesh's data-parallel axis, or None (one pool replicated on every device).
      tp_axis: the mesh's tensor-parallel axis, or None; buffers are replicated along it.
      dtype: int32 (default) or int64 (needs JAX's x64 mode) for tokens, lengths, top-k ids.
      spec: the spec extras' static shapes, or None for non-spec decoding.
      debug: poison `output_tokens` and `new_seq_lens` with -1 and add the checkify
        invariant checks (a spec resolve consumes the lengths it reads).
      protocol: 'sentinel' (the host leaves -slot placeholders that resolve fills) or
        'gather' (resolve gathers decode ids and spec lengths at forward entry; no
        invalidate). docs/CONTRACT.md, 'Two protocols'.

    Returns:
      FutureMapOps. Inputs are checked for rank, shape and dtype when traced.
    """
    if mesh is not None:
        local = future_map(pool_size, dtype=dtype, spec=spec, debug=debug, protocol=protocol)
        return lift(local, mesh_layout(mesh, dp_axis, tp_axis))
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 2:
        raise FutureMapError(f"pool_size must be an int >= 2 (slot 0 is padding), got {pool_size}")
    if not isinstance(debug, bool):
        raise FutureMapError(f"debug must be a bool, got {debug!r}")
    dt = int_dtype(dtype)
    if pool_size - 1 > np.iinfo(dt).max:
        raise FutureMapError(
            f"pool_size {pool_size}: slots 0..{pool_size - 1} must fit the map's {dt} "
            f"(pool_size - 1 <= {np.iinfo(dt).max}); use a smaller pool or dtype=int64"
        )
    proto = parse_protocol(protocol)
    if spec is not None:
        spec = check_spec(spec)
    # What a spec map relays, in stash order; the bonus tokens live in output_tokens.
    fields = spec.fields() if spec is not None else ()
    consumed = tuple(f.name for f in fields if f.consumed)
    one_kernel = spec is not None and spec.kernel == "pallas"
    for f in fields if one_kernel else ():
        row_kernel.check_fits(f.name, pool_size, math.prod(f.shape), dt)
    cfg = OpsConfig(pool_size, dt, spec, fields, consumed, debug, proto, one_kernel)
    bind = functools.partial
    return FutureMapOps(
        bind(init, cfg),
        bind(publish, cfg),
        bind(stash, cfg),
        bind(resolve, cfg),
        bind(invalidate, cfg),
        bind(seq_lens_at, cfg),
        pool_size,
        dt,
        spec,
        debug,
        proto.name,
    )


def init(cfg: OpsConfig) -> FutureMapState:
    """The zeroed buffers (debug: the consume-tracked ones and the lengths poisoned)."""
    r, dt = cfg.pool_size, cfg.dtype
    fill = POISON if cfg.debug else 0
    state = FutureMapState(jnp.full((r,), fill, dtype=dt), jnp.full((r,), fill, dtype=dt))
    for f in cfg.fields:
        if f.name != "bonus_tokens":
            fill = POISON if cfg.debug and f.consumed else 0
            buf = jnp.full((r, *f.shape), fill, dtype=rf.buffer_dtype(f, dt))
            state = rf.put(state, f.name, buf)
    gamma = confidence_width(cfg.spec)
    if gamma:  # zeros, like every buffer not consume-tracked
        state = state._replace(confidence=jnp.zeros((r, gamma), CONFIDENCE_BITS))
    return state


def check_confidence(spec: SpecConfig | None, confidence: Any, rows: int) -> None:
    """Confidence rows given to a publish: [rows, gamma] float32 on a map whose spec
    declares `confidence`; refused on any other map (FutureMapError naming the field)."""
    gamma = confidence_width(spec)
    if not gamma:
        raise errors.confidence_not_declared()
    s.check_array("confidence", confidence, (rows, gamma))
    s.check_declared_dtype("confidence", confidence, CONFIDENCE_DTYPE)


def publish(
    cfg: OpsConfig,
    state: FutureMapState,
    indices: Any,
    new_seq_lens: Any,
    confidence: Any = None,
) -> FutureMapState:
    """`new_seq_lens[indices] := new_seq_lens` (and, given, `confidence[indices] :=
    confidence`); empty indices is a no-op."""
    dt = cfg.dtype
    chk = checks.OpChecks() if cfg.debug else None
    check_indices(cfg, "indices", indices, chk)
    s.check_1d_int("new_seq_lens", new_seq_lens, dt)
    s.check_rows("new_seq_lens", new_seq_lens, jnp.shape(indices)[0])
    if confidence is not None:
        check_confidence(cfg.spec, confidence, jnp.shape(indices)[0])
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
    state = state._replace(new_seq_lens=scatter(state.new_seq_lens, indices, new_seq_lens))
    if confidence is None:
        return state  # the rows already published stay
    assert state.confidence is not None  # declared: check_confidence passed
    bits = jax.lax.bitcast_convert_type(jnp.asarray(confidence), CONFIDENCE_BITS)
    return state._replace(confidence=scatter(state.confidence, indices, bits))


def _check_draft(cfg: OpsConfig, draft: DraftPayload, rows: int) -> tuple[rf.RelayField, ...]:
    """The fields the draft writes (`relay_fields.carried`: every consume-tracked one, any
    others), each [rows, *shape] (its kind and undeclared fields checked by
    `payload_rows`). An int field's rows may be of any int dtype whose every value fits
    its buffer (they are cast); any other field's are of its own dtype."""
    present = rf.carried(cfg.fields, draft)
    for f in present:
        name, v = f"draft.{f.name}", rf.get(draft, f.name)
        dt = rf.element_dtype(f, cfg.dtype)
        ints = dt.kind in "iu"
        if ints and not f.shape:  # one int per row
            s.check_1d_int(name, v, dt)
            s.check_rows(name, v, rows)
            continue
        s.check_array(name, v, (rows, *f.shape))
        if ints:
            s.check_ints(name, v, dt)
        else:
            s.check_declared_dtype(name, v, dt)
    return present


def stash(cfg: OpsConfig, state: FutureMapState, indices: Any, payload: Any) -> FutureMapState:
    """Write tokens (non-spec) or a DraftPayload (spec) at `indices`; empty is a no-op.

    A draft writes the fields it gives and keeps the others' rows (a partial stash; every
    consume-tracked field is required: `relay_fields.carried`)."""
    dt, fields = cfg.dtype, cfg.fields
    chk = checks.OpChecks() if cfg.debug else None
    check_indices(cfg, "indices", indices, chk)
    rows = jnp.shape(indices)[0]
    payload_rows(cfg.spec, payload)
    if cfg.spec is None:
        s.check_1d_int("tokens", payload, dt)
        s.check_rows("tokens", payload, rows)
    else:
        fields = _check_draft(cfg, payload, rows)
    if chk is not None:
        # Consumed fields must not be stashed negative: a -1 would read as the poison.
        relayed = (
            [("tokens", payload)]
            if cfg.spec is None
            else [(f"draft.{f.name}", rf.get(payload, f.name)) for f in fields if f.consumed]
        )
        for name, values in relayed:
            checks.relayed_values(
                name,
                checks.STASHED_TOKENS,
                row_min(jnp.asarray(values)),
                jnp.asarray(indices),
                dt,
                chk,
            )
        chk.run()
    if rows == 0:
        return state  # DP idle: nothing ran, nothing to relay
    if cfg.spec is None:
        return state._replace(output_tokens=scatter(state.output_tokens, indices, payload))
    bufs = [rf.get(state, f.name) for f in fields]
    values = [rf.to_buffer(f, jnp.asarray(rf.get(payload, f.name))) for f in fields]
    for f, buf in zip(fields, scatter_rows(cfg, bufs, indices, values), strict=True):
        state = rf.put(state, f.name, buf)
    return state


def resolve(cfg: OpsConfig, state: FutureMapState, batch: Batch) -> tuple[FutureMapState, Resolved]:
    """Fill the batch's placeholders from the buffers, at forward entry: the batch's fields
    checked (shapes and dtypes when traced; debug: its slots and mode on the device), then
    the protocol's resolve body (resolve_ops.py)."""
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
        s.check_scalar_int("forward_mode", mode)
        if chk is not None:
            checks.known_mode(mode, dt, chk)  # type: ignore[arg-type]  # traced here
    if batch.input_ids is None:
        if not protocol.gathers_decode_ids:
            raise FutureMapError("batch.input_ids is None: a sentinel-protocol batch has ids")
        if not isinstance(mode, int | np.integer):
            raise errors.no_ids_with_traced_mode("batch.")
        if mode != ForwardMode.DECODE:
            raise errors.no_ids_for_kind(ForwardMode(mode).name, "batch.")
        batch = batch._replace(input_ids=jnp.zeros(jnp.shape(idx)[0], dt))
    s.check_1d_int("input_ids", batch.input_ids, dt)
    s.check_1d_int("seq_lens", batch.seq_lens, dt)
    s.check_rows("seq_lens", batch.seq_lens, jnp.shape(idx)[0])
    # The sentinel protocol fills -slot placeholders; the gather protocol gathers at slots.
    fill = resolve_sentinel if protocol.invalidates else resolve_gather
    return fill(cfg, state, batch, idx, mode, chk)


def invalidate(cfg: OpsConfig, batch: Batch, indices: Any) -> Batch:
    """Leave sentinels for the next step: ids and lengths := -indices (padding: 0)."""
    if not cfg.protocol.invalidates:
        raise errors.invalidate_in_gather_protocol()
    s.check_1d_int("indices", indices, cfg.dtype)
    sentinel = -jnp.asarray(indices).astype(cfg.dtype)
    return batch._replace(input_ids=sentinel, seq_lens=sentinel)


def seq_lens_at(cfg: OpsConfig, state: FutureMapState, indices: Any) -> jax.Array:
    """`new_seq_lens[indices]`; an out-of-range slot clips (never wraps to another).
    Debug: every live slot read holds a length >= 0 (published, not consumed since)."""
    chk = checks.OpChecks() if cfg.debug else None
    check_indices(cfg, "indices", indices, chk)
    got = gather(state.new_seq_lens, indices)
    if chk is not None:
        checks.lengths_unconsumed(got, jnp.asarray(indices), chk)
        chk.run()
    return got
