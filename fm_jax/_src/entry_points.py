"""Jitted, donated entry points over a FutureMap's pure ops, shared by the map classes."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.experimental import checkify

from fm_jax._src.compile_options import compiler_options
from fm_jax._src.packed_errors import ErrorPacker
from fm_jax._src.types import Batch, ForwardMode, FutureMapState, Resolved


class EntryPoints(NamedTuple):
    """The jitted ops. In debug mode each returns (checkify error, out).

    `resolve` takes the mode from the batch (a traced scalar); `resolve_by_mode[decode]`
    are the same op with the mode fixed when traced (DECODE or not), for callers that know it
    on the host: no branch in the executable. `finish` is the tail phase of a step in one
    donated call: publish, stash, and the sentinels `-indices` that invalidate leaves.
    """

    publish: Any
    stash: Any
    resolve: Any
    resolve_by_mode: tuple[Any, Any]
    finish: Any


def jit_entry_points(
    ops: Any, *, debug: bool, platform: str, errors: ErrorPacker | None = None
) -> EntryPoints:
    """Jit `ops.publish`, `ops.stash` and `ops.resolve` with the state (argument 0) donated.

    Compiled for `platform` with `compiler_options(platform)` (on CPU: on the calling
    thread, so the cost stays O(batch) at any pool size).

    Without debug, resolve only reads the buffers: it is jitted without donation and returns
    only the Resolved outputs (returning a non-donated state would make XLA copy it).
    With debug, every op is checkified (user checks) and resolve donates the state, since it
    writes the consume poison back; with `errors`, each op returns its error packed by it
    (one int array) instead of a checkify.Error.
    """

    options = compiler_options(platform)

    def jit(fn: Any, donate: bool) -> Any:
        if debug:
            fn = checkify.checkify(fn, errors=checkify.user_checks)
            if errors is not None:
                fn = _packing(fn, errors)
        return jax.jit(fn, donate_argnums=(0,) if donate else (), compiler_options=options)

    def jit_resolve(fixed_mode: ForwardMode | None) -> Any:
        """resolve, with the batch's mode replaced by `fixed_mode` when one is given."""

        def full(state: FutureMapState, batch: Batch) -> Any:
            if fixed_mode is not None:
                batch = batch._replace(forward_mode=fixed_mode)
            return ops.resolve(state, batch)

        def read_only(state: FutureMapState, batch: Batch) -> Resolved:
            return full(state, batch)[1]  # type: ignore[no-any-return]

        return jit(full, True) if debug else jax.jit(read_only, compiler_options=options)

    def finish(
        state: FutureMapState, indices: jax.Array, new_seq_lens: jax.Array, payload: Any
    ) -> tuple[FutureMapState, jax.Array]:
        state = ops.publish(state, indices, new_seq_lens)
        state = ops.stash(state, indices, payload)
        return state, -indices.astype(state.output_tokens.dtype)

    by_mode = (jit_resolve(ForwardMode.EXTEND), jit_resolve(ForwardMode.DECODE))
    return EntryPoints(
        jit(ops.publish, True), jit(ops.stash, True), jit_resolve(None), by_mode, jit(finish, True)
    )


def _packing(checked: Any, errors: ErrorPacker) -> Any:
    """`checked` (a checkified op) returning its error packed by `errors`."""

    def packed(*args: Any) -> Any:
        err, out = checked(*args)
        return errors.pack(err), out

    return packed
