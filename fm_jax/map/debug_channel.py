"""Debug errors, from the checkify check inside a jitted op to the `InvariantViolation`.

Inside jit an op's error is packed into one int array (a `checkify.Error` leaves a jitted
call as several arrays and a pytree rebuild, ~7 us a call); `record` keeps it on device
with no sync; `check()` fetches them all in one transfer and translates every failure.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from fm_jax.ops.checks import SLOT_NAMED
from fm_jax.ops.errors import FutureMapError, InvariantViolation
from fm_jax.ops.sharding import MeshLayout

MAX_PENDING_ERRORS = 4096
"""Packed errors kept on device; past this many, `record` fetches them (one host sync per
this many ops), keeps the failures for `check()` and never raises in an unrelated call."""

_MAPPED = re.compile(r"^at mapped index (\d+): (.*)$")
_INVARIANT = re.compile(r"^\[([^\]]+)\]")


def _violation(line: str, step: int | None, op: str, rank: int | None) -> InvariantViolation:
    """One failed check's `line` ('[invariant] text') as a violation at `step`, `op` and
    DP rank `rank` (None: the map has one)."""
    inv, slot = _INVARIANT.match(line), SLOT_NAMED.search(line)
    where = f"DP rank {rank}, " if rank is not None else ""
    where += "" if step is None else f"step {step}, "
    where += f"{op}: " if op else ""
    return InvariantViolation(
        f"FutureMap invariant violated at {where}{line}",
        invariant=inv.group(1) if inv else "",
        step=step,
        op=op,
        rank=rank,
        slots=[int(slot.group(1))] if slot else [],
    )


def _violations(
    msg: str, step: int | None, op: str, layout: MeshLayout | None
) -> list[InvariantViolation]:
    """`msg` (a failed checkify error's message) as one violation per failing DP rank
    (checkify names a shard_map'd failure 'at mapped index i'; TP replicas: once)."""
    out: dict[int | None, InvariantViolation] = {}
    for line in msg.splitlines():
        m = _MAPPED.match(line)
        rank = None
        if m is not None:
            line = m.group(2)
            if layout is not None:
                rank = layout.rank_of(layout.mesh.devices.flat[int(m.group(1))])
        elif out:
            continue  # a continuation line of the previous message
        if rank not in out:
            named = rank if layout is not None and layout.dp > 1 else None
            out[rank] = _violation(line, step, op, named)
    return list(out.values())


def _to_host(packed: Any) -> np.ndarray:
    """A packed error on the host. Across processes only this process's ranks are readable:
    the others' rows read as no error (all zeros, with this process's trace id)."""
    if not isinstance(packed, jax.Array) or packed.is_fully_addressable:
        return np.asarray(jax.device_get(packed))
    out: np.ndarray | None = None
    for shard in packed.addressable_shards:
        data = np.asarray(shard.data)
        if out is None:
            out = np.zeros(packed.shape, data.dtype)
            out[..., 0] = data.reshape(-1, data.shape[-1])[0, 0]  # the trace id
        out[shard.index] = data
    assert out is not None, "a process holds at least one shard of its map's state"
    return out


def _raise_all(found: list[InvariantViolation]) -> None:
    """Raise the one violation found, or one listing them all (its attributes: the first's)."""
    if len(found) > 1:
        first, lines = found[0], "\n".join(f"  {v}" for v in found)
        raise InvariantViolation(
            f"{len(found)} FutureMap invariant violations:\n{lines}",
            invariant=first.invariant,
            step=first.step,
            op=first.op,
            rank=first.rank,
            violations=found,
            slots=first.slots,
        )
    if found:
        raise found[0]


def raise_if_violated(
    err: checkify.Error, *, step: int | None = None, op: str = "", layout: MeshLayout | None = None
) -> None:
    """Raise InvariantViolation if `err` (from a checkified fm_jax step) holds a failure;
    a host sync. `step`, `op` are named in the message; `layout` (the sharded ops') names
    the failing DP rank."""
    host = jax.tree.map(np.asarray, err)  # on the host: no sharding rules apply to get()
    msg = host.get()
    if msg is not None:
        _raise_all(_violations(msg, step, op, layout))


class DebugChannel:
    """The debug errors of one map: packed inside its jitted ops, pending on device, reported
    by `check()`."""

    def __init__(self, layout: MeshLayout) -> None:
        self.layout = layout
        # Per trace of a checked op: the error's pytree structure, leaf shapes and dtypes.
        self._layouts: list[tuple[Any, list[tuple[tuple[int, ...], np.dtype]]]] = []
        # (step, op, packed error): on device, or on the host once fetched by a flush.
        self._pending: list[tuple[int, str, Any]] = []
        # Failures already fetched by a flush (or found on the host), in op order.
        self._failed: list[InvariantViolation] = []

    def checked(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` with its checkify user checks, returning (packed error, fn's outputs)."""
        checkified = checkify.checkify(fn, errors=checkify.user_checks)

        def packed(*args: Any) -> Any:
            err, out = checkified(*args)
            return self._pack(err), out

        return packed

    def _pack(self, err: checkify.Error) -> jax.Array:
        """Inside jit: `err` as one int array [..., 1 + leaves] (trace id first). The leaves
        stack along a new last axis, so per-device leaves stay where they are (no collective)."""
        leaves, treedef = jax.tree_util.tree_flatten(err)
        if not leaves:
            raise FutureMapError("internal: a checkified op produced an error with no leaves")
        shape = jnp.shape(leaves[0])
        for leaf in leaves:
            kind = jnp.dtype(leaf.dtype).kind
            if jnp.shape(leaf) != shape or kind not in "biu":
                raise FutureMapError(
                    f"internal: cannot pack a checkify error leaf {leaf.shape} {leaf.dtype}"
                )
        wide = jnp.result_type(*(leaf.dtype for leaf in leaves), jnp.int32)
        trace_id = len(self._layouts)
        self._layouts.append((treedef, [(tuple(jnp.shape(x)), np.dtype(x.dtype)) for x in leaves]))
        parts = [jnp.full(shape, trace_id, wide), *(leaf.astype(wide) for leaf in leaves)]
        return jnp.stack(parts, axis=-1)

    def unpack(self, packed: Any) -> checkify.Error:
        """On the host: the checkify.Error that `_pack` packed into `packed`."""
        flat = np.asarray(packed)
        treedef, metas = self._layouts[int(flat[..., 0].reshape(-1)[0])]
        leaves = [
            flat[..., 1 + i].astype(dtype).reshape(shape) for i, (shape, dtype) in enumerate(metas)
        ]
        return jax.tree_util.tree_unflatten(treedef, leaves)  # type: ignore[no-any-return]

    def record(self, step: int, op: str, packed: jax.Array) -> None:
        """Keep `op`'s packed error (still on device) until `check()`."""
        self._pending.append((step, op, packed))
        if len(self._pending) >= MAX_PENDING_ERRORS:
            self._flush()

    @property
    def pending(self) -> int:
        """How many op errors wait for `check()` (on device, or fetched and failed)."""
        return len(self._pending) + len(self._failed)

    def _failures(self) -> list[InvariantViolation]:
        """The pending errors fetched to the host (one transfer each), as violations."""
        found = []
        for step, op, packed in self._pending:
            msg = self.unpack(_to_host(packed)).get()
            if msg is not None:
                found += _violations(msg, step, op, self.layout)
        return found

    def _flush(self) -> None:
        """Fetch the pending errors and keep only the failed ones (a host sync). Never
        raises (it runs inside an unrelated op): a failed fetch leaves all for `check()`."""
        try:
            failed = self._failures()
        except Exception:  # noqa: BLE001  # reported by check(), not by this op
            return
        self._failed += failed
        self._pending = []

    def host_violation(
        self, step: int, op: str, invariant: str, text: str, rank: int | None = None
    ) -> None:
        """Record a violation found on the host (the fresh publish a read waits for), after
        every op error pending before it (a host sync), for `check()` in op order."""
        self._flush()
        named = rank if self.layout.dp > 1 else None
        self._failed.append(_violation(f"[{invariant}] {text}", step, op, named))

    def check(self) -> None:
        """Raise InvariantViolation listing every failed check since the last call, in op
        order (a host sync); the pending list is cleared only once all are translated."""
        if not self._pending and not self._failed:
            return
        found = self._failed + self._failures()
        self._pending, self._failed = [], []
        _raise_all(found)
