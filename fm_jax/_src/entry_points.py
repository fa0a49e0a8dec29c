"""The FutureMap class's jitted executables over its layout's ops, state donated.

Every argument but the forward mode is placed with the layout's sharding by the jit itself:
a host (numpy) argument is transferred in JAX's C++ dispatch path, with no Python
`device_put`, and a jax array already there is taken as it is. One call of an entry point
is one dispatch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from fm_jax._src import checks
from fm_jax._src.compile_options import compiler_options
from fm_jax._src.debug_channel import DebugChannel
from fm_jax._src.packing import PackSpec, unpack
from fm_jax._src.sharding import ShardedFutureMapOps
from fm_jax._src.types import Batch, ForwardMode, FutureMapState, Resolved, relay_protocol


class EntryPoints(NamedTuple):
    """The jitted ops. With a debug channel each returns (packed error, out).

    `resolve` takes the mode from the batch (traced: a scalar or one per DP rank);
    `resolve_by_mode[decode]` is the same op with the mode fixed when traced (DECODE or
    not), for callers that know it on the host: no branch in the executable, and the
    batch's `forward_mode` is None. `finish` is the tail phase of a step in one donated
    call: publish, stash, and (sentinel protocol) the sentinels `-indices` that invalidate
    leaves.
    """

    publish: Any
    stash: Any
    resolve: Any
    resolve_by_mode: tuple[Any, Any]
    finish: Any
    sentinels: Any
    seq_lens_at: Any


def writes_state(name: str, debug: bool) -> bool:
    """Whether entry point `name` (or its `unchecked_` twin) writes the state, so takes it
    donated: the tail ops always, resolve only in debug (the consume poison)."""
    name = name.removeprefix("unchecked_")
    return name in ("publish", "stash", "finish") or (debug and name.startswith("resolve"))


def takes_state(name: str) -> bool:
    """Whether entry point `name` (or its `unchecked_` twin) takes the state first."""
    return name.removeprefix("unchecked_") != "sentinels"


def packed_entry_point(
    jitted: Any, name: str, spec: PackSpec, *, debug: bool, options: Any, sharding: Any
) -> Any:
    """Entry point `jitted` (named `name`) fed its host arguments as one packed buffer laid
    out by `spec`: `(state, packed)`, or `(packed,)` for an op without state.

    Traces the function `jitted` wraps (`__wrapped__`, as functools.wraps leaves it: a
    jit's compiler options cannot nest) with the same donation and options. The buffer
    goes to every device of `sharding` (replicated: each rank slices its own rows); the
    ops' shard_maps place the unpacked arguments.
    """
    fn = jitted.__wrapped__
    if not takes_state(name):
        return jax.jit(
            lambda packed: fn(*unpack(spec, packed, ())),
            in_shardings=sharding,
            compiler_options=options,
        )
    return jax.jit(
        lambda state, packed: fn(state, *unpack(spec, packed, ())),
        in_shardings=(None, sharding),
        donate_argnums=(0,) if writes_state(name, debug) else (),
        compiler_options=options,
    )


def tail(ops: ShardedFutureMapOps) -> Any:
    """The tail of a step over the layout's global arrays: (state, indices, new_seq_lens,
    payload) -> (state, sentinels `-indices`, or None in the gather protocol).

    Publish, stash and the sentinels in one shard_map: checkify cannot merge the errors of
    consecutive shard_maps (jax 0.10: "select cases must have the same shapes").
    """
    local = ops.local

    def local_tail(
        state: FutureMapState, indices: jax.Array, new_seq_lens: jax.Array, payload: Any
    ) -> tuple[FutureMapState, Any]:
        state = local.publish(state, indices, new_seq_lens)
        state = local.stash(state, indices, payload)
        if not relay_protocol(local.protocol).invalidates:
            return state, None  # no sentinels to leave
        return state, local.invalidate(Batch(None, indices, indices, indices), indices).input_ids

    return ops.map_ranks(local_tail)


def jit_entry_points(ops: ShardedFutureMapOps, debug: DebugChannel | None) -> EntryPoints:
    """Jit `ops` for the class: state (argument 0) donated where the op writes it.

    Compiled with `compiler_options` for the layout's platform (on CPU: on the calling
    thread, so the cost stays O(batch) at any pool size).

    Without debug, resolve only reads the buffers: it is jitted without donation and returns
    only the Resolved outputs (returning a non-donated state would make XLA copy it).
    With debug, every op is checked through `debug` and resolve donates the state, since it
    writes the consume poison back.
    """
    layout = ops.layout
    options = compiler_options(layout.mesh.devices.flat[0].platform)
    sh = layout.sharding
    # The traced mode (a scalar, or one per rank) is replicated: each rank slices its own.
    batch_sh: Any = Batch(layout.replicated, sh, sh, sh, sh, sh)  # type: ignore[arg-type]  # in_shardings

    def jit(fn: Any, name: str, in_shardings: Any, *, checked: bool = True) -> Any:
        if debug is not None and checked:
            fn = debug.checked(fn)
        return jax.jit(
            fn,
            in_shardings=in_shardings,
            donate_argnums=(0,) if writes_state(name, debug is not None) else (),
            compiler_options=options,
        )

    def jit_resolve(fixed_mode: ForwardMode | None) -> Any:
        """resolve, with the batch's mode replaced by `fixed_mode` when one is given."""

        def full(state: FutureMapState, batch: Batch) -> Any:
            if fixed_mode is not None:
                batch = batch._replace(forward_mode=fixed_mode)
            return ops.resolve(state, batch)

        def read_only(state: FutureMapState, batch: Batch) -> Resolved:
            return full(state, batch)[1]  # type: ignore[no-any-return]

        fn = full if debug is not None else read_only
        return jit(fn, "resolve", (sh, batch_sh))

    finish = tail(ops)

    local = ops.local

    def local_sentinels(indices: jax.Array) -> Any:
        # Debug: each rank's slots checked like every op's (range, no live slot twice).
        if debug is not None:
            chk = checks.OpChecks()
            checks.valid_slots("indices", indices, local.pool_size, local.dtype, chk)
            chk.run()
        return local.invalidate(Batch(None, indices, indices, indices), indices).input_ids

    sentinels = ops.map_ranks(local_sentinels)

    return EntryPoints(
        publish=jit(ops.publish, "publish", sh),
        stash=jit(ops.stash, "stash", sh),
        resolve=jit_resolve(None),
        resolve_by_mode=(jit_resolve(ForwardMode.EXTEND), jit_resolve(ForwardMode.DECODE)),
        finish=jit(finish, "finish", sh),
        sentinels=jit(sentinels, "sentinels", sh),
        seq_lens_at=jit(ops.seq_lens_at, "seq_lens_at", sh),
    )
