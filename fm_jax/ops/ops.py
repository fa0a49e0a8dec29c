"""The FutureMap as pure functions over a state pytree (optax style), for an engine to inline
in its own jitted step with the state donated; `lift` runs them per rank of a mesh."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fm_jax.ops import checks, errors
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.checks import check_1d_int, check_array, check_int_array, check_ints
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import parse_protocol
from fm_jax.ops.relay_fields import check_spec, payload_rows
from fm_jax.ops.resolve import POISON, OpsConfig, check_indices, resolve, row_min
from fm_jax.ops.rows import check_fits, gather, scatter, scatter_rows
from fm_jax.ops.sharding import MeshLayout, check_split, mesh_layout
from fm_jax.ops.types import (
    CONFIDENCE_BITS,
    CONFIDENCE_DTYPE,
    Batch,
    DraftPayload,
    FutureMapState,
    Resolved,
    SpecConfig,
    confidence_width,
)


class FutureMapOps(NamedTuple):
    """The pure FutureMap ops for one static configuration.

    Attributes:
      init: () -> FutureMapState, the zeroed (debug: poisoned) buffers.
      publish: (state, indices, new_seq_lens, confidence=None) -> state; `confidence`
        ([B, gamma] float32) only where the spec declares gamma.
      stash: (state, indices, tokens | DraftPayload) -> state; a draft writes the fields
        it gives and keeps the others' rows.
      resolve: (state, batch) -> (state, Resolved); the state changes only in debug mode.
        A draft gather gives every declared field (a row never stashed reads 0).
      invalidate: (batch, indices) -> batch with sentinels `-indices` as ids and lengths
        (sentinel protocol only).
      seq_lens_at: (state, indices) -> `new_seq_lens[indices]` (`resolve_seq_lens_cpu`).
      pool_size, dtype, spec, debug, protocol: the static configuration.
      layout: on a mesh, its `MeshLayout` (global arrays, each rank's block run by
        `local`, the one-pool ops); None (and `local` None) for one pool on one device.
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
    layout: MeshLayout | None = None
    local: FutureMapOps | None = None

    def map_ranks(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` run on each DP rank's block (`MeshLayout.map`), as a mesh's ops run theirs:
        under the Pallas kernel without shard_map's varying-axes check, which Pallas's CPU
        interpreter cannot trace under (jax 0.10.2); the ops hold no collective for it."""
        if self.layout is None:
            raise FutureMapError("map_ranks needs the ops of a mesh (future_map(..., mesh=))")
        vma = self.spec is None or self.spec.kernel != "pallas"
        return self.layout.map(fn, check_vma=vma)


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
        On a mesh: slots per DP rank. R - 1 fits `dtype`.
      mesh: a `jax.sharding.Mesh` holding one pool per DP rank (global arrays, rank d's
        block its own pool); None (default): one pool. In debug mode wrap the step in
        `checkify.checkify(..., errors=checkify.user_checks)` and pass its error to
        `fm_jax.raise_if_violated(err, layout=ops.layout)`.
      dp_axis: the mesh's data-parallel axis, or None (one pool replicated everywhere).
      tp_axis: the mesh's tensor-parallel axis, or None; buffers are replicated along it.
      dtype: int32 (default) or int64 (needs JAX's x64 mode) for tokens, lengths, top-k ids.
      spec: the spec fields' declaration, or None for non-spec decoding.
      debug: poison the consume-tracked buffers and the lengths with -1 and add the
        checkify invariant checks (docs/CONTRACT.md, 'Debug mode').
      protocol: 'sentinel' (default) or 'gather' (docs/CONTRACT.md, 'Two protocols').

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
    fields = spec.fields() if spec is not None else ()
    consumed = tuple(f.name for f in fields if f.consumed)
    one_kernel = spec is not None and spec.kernel == "pallas"
    for f in fields if one_kernel else ():
        check_fits(f.name, pool_size, math.prod(f.shape), dt)
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


def init(cfg: OpsConfig) -> FutureMapState:
    """The zeroed buffers (debug: the consume-tracked ones and the lengths poisoned)."""
    r, dt = cfg.pool_size, cfg.dtype
    fill = POISON if cfg.debug else 0
    state = FutureMapState(jnp.full((r,), fill, dtype=dt), jnp.full((r,), fill, dtype=dt))
    for f in cfg.fields:
        if f.name != "bonus_tokens":  # it lives in output_tokens
            fill = POISON if cfg.debug and f.consumed else 0
            buf = jnp.full((r, *f.shape), fill, dtype=rf.buffer_dtype(f, dt))
            state = rf.put(state, f.name, buf)
    gamma = confidence_width(cfg.spec)
    if gamma:
        state = state._replace(confidence=jnp.zeros((r, gamma), CONFIDENCE_BITS))
    return state


def publish(
    cfg: OpsConfig, state: FutureMapState, indices: Any, new_seq_lens: Any, confidence: Any = None
) -> FutureMapState:
    """`new_seq_lens[indices] := new_seq_lens` (and, given, `confidence[indices] :=
    confidence`); empty indices is a no-op."""
    dt = cfg.dtype
    chk = checks.OpChecks() if cfg.debug else None
    check_indices(cfg, "indices", indices, chk)
    check_1d_int("new_seq_lens", new_seq_lens, dt, jnp.shape(indices)[0])
    gamma = confidence_width(cfg.spec)
    if confidence is not None:
        if not gamma:
            raise errors.confidence_not_declared()
        check_array("confidence", confidence, (jnp.shape(indices)[0], gamma), CONFIDENCE_DTYPE)
    if chk is not None:
        lens, idx = jnp.asarray(new_seq_lens), jnp.asarray(indices)
        checks.relayed_values("new_seq_lens", checks.PUBLISHED_LENGTHS, lens, idx, dt, chk)
        chk.run()
    if jnp.shape(indices)[0] == 0:
        return state  # DP idle: nothing ran, nothing to relay
    state = state._replace(new_seq_lens=scatter(state.new_seq_lens, indices, new_seq_lens))
    if confidence is None:
        return state  # the rows already published stay
    assert state.confidence is not None  # declared: gamma > 0
    bits = jax.lax.bitcast_convert_type(jnp.asarray(confidence), CONFIDENCE_BITS)
    return state._replace(confidence=scatter(state.confidence, indices, bits))


def _check_draft(cfg: OpsConfig, draft: DraftPayload, rows: int) -> tuple[rf.RelayField, ...]:
    """The fields the draft writes, each checked [rows, *shape]: an int field of any int
    dtype whose values fit its buffer (they are cast), any other of its own dtype."""
    present = rf.carried(cfg.fields, draft)
    for f in present:
        name, v = f"draft.{f.name}", rf.get(draft, f.name)
        dt = rf.element_dtype(f, cfg.dtype)
        if dt.kind not in "iu":
            check_array(name, v, (rows, *f.shape), dt)
        elif f.shape:
            check_array(name, v, (rows, *f.shape))
            check_ints(name, v, dt)
        else:  # one int per row
            check_1d_int(name, v, dt, rows)
    return present


def stash(cfg: OpsConfig, state: FutureMapState, indices: Any, payload: Any) -> FutureMapState:
    """Write tokens (non-spec) or a DraftPayload (spec) at `indices`; empty is a no-op. A
    draft writes the fields it gives (`relay_fields.carried`)."""
    dt = cfg.dtype
    chk = checks.OpChecks() if cfg.debug else None
    check_indices(cfg, "indices", indices, chk)
    rows = jnp.shape(indices)[0]
    relayed = payload_rows(cfg.spec, payload)  # its kind checked first
    if cfg.spec is None:
        check_1d_int("tokens", payload, dt, rows)
    fields = () if cfg.spec is None else _check_draft(cfg, payload, rows)
    if chk is not None:
        # Consumed fields must not be stashed negative: a -1 would read as the poison.
        if cfg.spec is not None:
            relayed = [(f"draft.{f.name}", rf.get(payload, f.name)) for f in fields if f.consumed]
        for name, values in relayed:
            low, idx = row_min(jnp.asarray(values)), jnp.asarray(indices)
            checks.relayed_values(name, checks.STASHED_TOKENS, low, idx, dt, chk)
        chk.run()
    if rows == 0:
        return state  # DP idle: nothing ran, nothing to relay
    if cfg.spec is None:
        return state._replace(output_tokens=scatter(state.output_tokens, indices, payload))
    bufs = [rf.get(state, f.name) for f in fields]
    values = [rf.to_buffer(f, jnp.asarray(rf.get(payload, f.name)), dt) for f in fields]
    for f, buf in zip(fields, scatter_rows(bufs, indices, values, cfg.one_kernel, dt), strict=True):
        state = rf.put(state, f.name, buf)
    return state


def invalidate(cfg: OpsConfig, batch: Batch, indices: Any) -> Batch:
    """Leave sentinels for the next step: ids and lengths := -indices (padding: 0)."""
    if not cfg.protocol.invalidates:
        raise errors.invalidate_in_gather_protocol()
    check_1d_int("indices", indices, cfg.dtype)
    sentinels = -jnp.asarray(indices).astype(cfg.dtype)
    return batch._replace(input_ids=sentinels, seq_lens=sentinels)


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


def lift(ops: FutureMapOps, layout: MeshLayout) -> FutureMapOps:
    """The one-pool `ops` over global arrays laid out by `layout`, each rank on its block
    (`future_map(..., mesh=)`, and the class's ops on one device or a mesh)."""
    pool_size, dp = ops.pool_size, layout.dp
    lifted = ops._replace(layout=layout, local=ops)
    each = lifted.map_ranks

    def check_state(state: FutureMapState) -> None:
        for path, buf in jax.tree_util.tree_leaves_with_path(state):
            if not jnp.shape(buf) or jnp.shape(buf)[0] != dp * pool_size:
                raise FutureMapError(
                    f"state{jax.tree_util.keystr(path)} has shape {jnp.shape(buf)}, expected "
                    f"DP*R = {dp}*{pool_size} = {dp * pool_size} rows"
                )

    def init() -> FutureMapState:
        return jax.shard_map(ops.init, mesh=layout.mesh, in_specs=(), out_specs=layout.spec)()  # type: ignore[no-any-return]

    def publish(
        state: FutureMapState, indices: Any, new_seq_lens: Any, confidence: Any = None
    ) -> FutureMapState:
        check_state(state)
        rows = [("indices", indices), ("new_seq_lens", new_seq_lens), ("confidence", confidence)]
        check_split(layout, "publish", rows)
        conf = () if confidence is None else (confidence,)
        return each(ops.publish)(state, indices, new_seq_lens, *conf)  # type: ignore[no-any-return]

    def stash(state: FutureMapState, indices: Any, payload: Any) -> FutureMapState:
        check_state(state)
        check_split(layout, "stash", [("indices", indices), *payload_rows(ops.spec, payload)])
        return each(ops.stash)(state, indices, payload)  # type: ignore[no-any-return]

    def resolve(state: FutureMapState, batch: Batch) -> tuple[FutureMapState, Resolved]:
        check_state(state)
        mode = batch.forward_mode
        # A host mode is fixed in every rank's executable; a traced one: each rank its [1].
        fixed = mode if isinstance(mode, int | np.integer) else None
        if fixed is None:
            check_int_array("forward_mode", mode)
            shape = jnp.shape(mode)  # type: ignore[arg-type]
            if shape == ():
                mode = jnp.broadcast_to(mode, (layout.dp,))  # type: ignore[arg-type]
            elif shape != (layout.dp,):
                raise FutureMapError(
                    f"batch.forward_mode must be one mode for every rank (a scalar) or one per "
                    f"DP rank, shape ({layout.dp},), got {shape}"
                )

        def local_resolve(state: FutureMapState, b: Batch) -> Any:
            local_mode = b.forward_mode[0] if fixed is None else fixed  # type: ignore[index]
            return ops.resolve(state, b._replace(forward_mode=local_mode))

        batch = batch._replace(forward_mode=mode if fixed is None else None)
        check_split(layout, "resolve", list(zip(Batch._fields, batch, strict=True)))
        return each(local_resolve)(state, batch)  # type: ignore[no-any-return]

    def invalidate(batch: Batch, indices: Any) -> Batch:
        check_split(layout, "invalidate", [("indices", indices)])
        # Elementwise: every rank's sentinels are its own rank-local -indices.
        return ops.invalidate(batch, indices)

    def seq_lens_at(state: FutureMapState, indices: Any) -> jax.Array:
        check_state(state)
        check_split(layout, "seq_lens_at", [("indices", indices)])
        return each(ops.seq_lens_at)(state, indices)  # type: ignore[no-any-return]

    return lifted._replace(
        init=init,
        publish=publish,
        stash=stash,
        resolve=resolve,
        invalidate=invalidate,
        seq_lens_at=seq_lens_at,
    )
