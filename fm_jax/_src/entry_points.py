"""Jitted, donated entry points over a FutureMap's pure ops, shared by the map classes."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.experimental import checkify

from fm_jax._src.types import Batch, FutureMapState, Resolved


class EntryPoints(NamedTuple):
    """publish / stash / resolve, jitted. In debug mode each returns (checkify error, out)."""

    publish: Any
    stash: Any
    resolve: Any


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

    resolve = jit(ops.resolve, True) if debug else jax.jit(resolve_only)
    return EntryPoints(jit(ops.publish, True), jit(ops.stash, True), resolve)
