"""Jitted, donated entry points over a FutureMap's pure ops, shared by the map classes."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.experimental import checkify

from fm_jax._src.types import Batch, FutureMapState, Resolved


class EntryPoints(NamedTuple):
    """The jitted ops. In debug mode each returns (checkify error, out).

    `finish` is the tail phase of a step in one donated call: publish, stash, and the
    sentinels `-indices` that invalidate leaves for the next step.
    """

    publish: Any
    stash: Any
    resolve: Any
    finish: Any


def jit_entry_points(ops: Any, *, debug: bool) -> EntryPoints:
    """Jit `ops.publish`, `ops.stash` and `ops.resolve` with the state (argument 0) donated.

    Without debug, resolve only reads the buffers: it is jitted without donation and returns
    only the Resolved outputs (returning a non-donated state would make XLA copy it).
    With debug, every op is checkified (user checks) and resolve donates the state, since it
    writes the consume poison back.
    """

    def jit(fn: Any, donate: bool) -> Any:
        if debug:
            fn = checkify.checkify(fn, errors=checkify.user_checks)
        return jax.jit(fn, donate_argnums=(0,) if donate else ())

    def resolve_only(state: FutureMapState, batch: Batch) -> Resolved:
        return ops.resolve(state, batch)[1]  # type: ignore[no-any-return]

    def finish(
        state: FutureMapState, indices: jax.Array, new_seq_lens: jax.Array, payload: Any
    ) -> tuple[FutureMapState, jax.Array]:
        state = ops.publish(state, indices, new_seq_lens)
        state = ops.stash(state, indices, payload)
        return state, -indices.astype(state.output_tokens.dtype)

    resolve = jit(ops.resolve, True) if debug else jax.jit(resolve_only)
    return EntryPoints(jit(ops.publish, True), jit(ops.stash, True), resolve, jit(finish, True))
