"""The FutureMap on a `jax.sharding.Mesh`: one pool of slots per data-parallel rank.

DP = the size of the mesh's `dp_axis` (1 without one), R = slots per rank. Every state
buffer is one global array of DP*R rows sharded over `dp_axis`: rank d owns rows
[d*R, (d+1)*R), row d*R its padding slot 0; every other axis (`tp_axis` too) holds
replicas. A batch likewise: each rank's rows padded to one size B (its tokens to T), laid
end to end, with rank-local slots in [0, R); `forward_mode` is one mode per rank, [DP]
int32 (an idle rank: IDLE, all rows padding). Each op is the one-pool op mapped over
`dp_axis` with `jax.shard_map`: a rank touches only its own block, so the compiled ops
hold no collectives and outputs keep the inputs' sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.relay_fields import payload_rows
from fm_jax.ops.types import Batch, FutureMapOps, FutureMapState, Resolved, check_int_array


class MeshLayout(NamedTuple):
    """Where a sharded FutureMap lives: the mesh, its data-parallel axis (one pool per
    index along it; None: DP = 1), its tensor-parallel axis (buffers replicated along it)
    or None, and the number of DP ranks."""

    mesh: Mesh
    dp_axis: str | None
    tp_axis: str | None
    dp: int

    @property
    def spec(self) -> PartitionSpec:
        """Leading axis over `dp_axis`, everything else replicated."""
        return PartitionSpec(self.dp_axis) if self.dp_axis else PartitionSpec()

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """The sharding of every state buffer and batch field. On one device, that
        device's SingleDeviceSharding, which arrays committed to it carry: they, host
        arrays and the map's outputs reach one executable (a NamedSharding would compile
        another)."""
        if self.mesh.devices.size == 1:
            return jax.sharding.SingleDeviceSharding(self.mesh.devices.flat[0])
        return NamedSharding(self.mesh, self.spec)

    @property
    def replicated(self) -> jax.sharding.Sharding:
        """A sharding that holds the whole array on every device (one device: as `sharding`)."""
        if self.mesh.devices.size == 1:
            return self.sharding
        return NamedSharding(self.mesh, PartitionSpec())

    def rank_of(self, device: jax.Device) -> int:
        """The DP rank whose pool `device` holds (a replica of)."""
        pos = np.argwhere(self.mesh.devices == device)
        if pos.size == 0:
            raise FutureMapError(f"device {device} is not in the mesh")
        if self.dp_axis is None:
            return 0
        return int(pos[0][self.mesh.axis_names.index(self.dp_axis)])

    def local_ranks(self) -> tuple[int, ...]:
        """The DP ranks with at least one device in this process, ascending."""
        return tuple(sorted({self.rank_of(d) for d in self.mesh.local_devices}))

    @property
    def single_process(self) -> bool:
        """Every device of the mesh belongs to this process (host arrays can be placed whole)."""
        return len(self.mesh.local_devices) == self.mesh.devices.size

    def map(self, fn: Callable[..., Any], *, check_vma: bool = True) -> Callable[..., Any]:
        """`fn` run on each DP rank's block of every argument and result (`jax.shard_map`;
        blocks along the leading axis, replicated over every other mesh axis); `check_vma`
        as shard_map's."""
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=self.spec, out_specs=self.spec, check_vma=check_vma
        )

    def global_array(self, blocks: Mapping[int, np.ndarray], size: int, like: np.ndarray) -> Any:
        """The global [DP*size, ...] array whose rank-d block is `blocks[d]` padded with
        zero rows to `size` (a local rank missing: zeros, padding); `like` gives the
        trailing shape and dtype. In one process a host array (a jit with this sharding
        places it); across processes a global jax.Array of this process's blocks."""
        tail, dt = like.shape[1:], like.dtype
        if self.single_process:
            out = np.zeros((self.dp * size, *tail), dt)
            for rank, block in blocks.items():
                out[rank * size : rank * size + block.shape[0]] = block
            return out
        local = {}
        for rank in self.local_ranks():
            block = np.zeros((size, *tail), dt)
            got = blocks.get(rank)
            if got is not None:
                block[: got.shape[0]] = got
            local[rank] = block
        sharding = NamedSharding(self.mesh, self.spec)
        arrays = [jax.device_put(local[self.rank_of(d)], d) for d in sharding.addressable_devices]
        shape = (self.dp * size, *tail)
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` with every axis Auto: the map's arrays carry no sharding in their types, so
    its shard_maps take host arrays, committed ones and those of Explicit meshes
    (`jax.make_mesh`'s default) alike."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None:
        return mesh
    names = tuple(mesh.axis_names)
    return Mesh(mesh.devices, names, axis_types=(axis_type.Auto,) * len(names))


def single_device_layout(device: jax.Device) -> MeshLayout:
    """The layout of a map on one device: a one-device mesh, one DP rank."""
    return mesh_layout(Mesh(np.array([device]), ("dp",)), "dp")


def mesh_layout(mesh: Mesh, dp_axis: str | None = "dp", tp_axis: str | None = None) -> MeshLayout:
    """The layout of `mesh` with these axes (None: no such axis; `tp_axis` is only
    checked, buffers being replicated along every axis but `dp_axis`); FutureMapError
    naming a missing or repeated axis."""
    if not isinstance(mesh, Mesh):
        raise FutureMapError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    for role, axis in (("dp_axis", dp_axis), ("tp_axis", tp_axis)):
        if axis is not None and axis not in names:
            raise FutureMapError(f"{role} {axis!r} is not an axis of the mesh {names}")
    if dp_axis is not None and dp_axis == tp_axis:
        raise FutureMapError(f"dp_axis and tp_axis must differ, both are {dp_axis!r}")
    dp = int(mesh.shape[dp_axis]) if dp_axis is not None else 1
    return MeshLayout(_auto_axes(mesh), dp_axis, tp_axis, dp)


def check_split(layout: MeshLayout, what: str, named: Iterable[tuple[str, Any]]) -> None:
    """Each named per-row value (None: not given) an array whose leading size splits into
    DP equal per-rank parts; else FutureMapError naming the op `what` (empty: the caller
    names it), the field and what it is (a list or number, a 0-d array, uneven rows)."""
    rows = "[B, ...]" if layout.dp == 1 else f"[{layout.dp}*B, ...], each DP rank's B rows"
    head = f"{what}: " if what else ""
    for name, x in named:
        if x is None:
            continue
        if not isinstance(x, np.ndarray | jax.Array) or x.ndim == 0:
            got = "a 0-d array" if isinstance(x, np.ndarray | jax.Array) else _kind(x)
            raise FutureMapError(f"{head}{name} must be an array of rows {rows}, got {got}")
        if x.shape[0] % layout.dp:
            raise FutureMapError(
                f"{head}{name} has leading size {x.shape[0]}, which does not split into "
                f"{layout.dp} equal per-rank parts (lay each rank's rows out end to end, "
                "padded to one size)"
            )


def _kind(x: Any) -> str:
    """What a value that is no array is, for a refusal."""
    if isinstance(x, bool | int | float | complex):
        return f"a Python {type(x).__name__} ({x!r})"
    if isinstance(x, np.generic):
        return f"a numpy scalar ({x.dtype})"
    if type(x) in (list, tuple):
        return f"a Python {type(x).__name__}"
    return f"a {type(x).__name__}"


def _check_state(layout: MeshLayout, state: FutureMapState, pool_size: int) -> None:
    want = layout.dp * pool_size
    for path, buf in jax.tree_util.tree_leaves_with_path(state):
        if not jnp.shape(buf) or jnp.shape(buf)[0] != want:
            raise FutureMapError(
                f"state{jax.tree_util.keystr(path)} has shape {jnp.shape(buf)}, expected "
                f"DP*R = {layout.dp}*{pool_size} = {want} rows"
            )


def lift(ops: FutureMapOps, layout: MeshLayout) -> FutureMapOps:
    """The one-pool `ops` over global arrays laid out by `layout`, each rank on its block
    (`future_map(..., mesh=)`, and the class's ops on one device or a mesh)."""
    pool_size, mesh, spec_ = ops.pool_size, layout.mesh, layout.spec
    lifted = ops._replace(layout=layout, local=ops)
    each = lifted.map_ranks

    def init() -> FutureMapState:
        return jax.shard_map(ops.init, mesh=mesh, in_specs=(), out_specs=spec_)()  # type: ignore[no-any-return]

    def publish(
        state: FutureMapState, indices: Any, new_seq_lens: Any, confidence: Any = None
    ) -> FutureMapState:
        _check_state(layout, state, pool_size)
        rows = [("indices", indices), ("new_seq_lens", new_seq_lens), ("confidence", confidence)]
        check_split(layout, "publish", rows)
        if confidence is None:
            return each(ops.publish)(state, indices, new_seq_lens)  # type: ignore[no-any-return]
        return each(ops.publish)(state, indices, new_seq_lens, confidence)  # type: ignore[no-any-return]

    def stash(state: FutureMapState, indices: Any, payload: Any) -> FutureMapState:
        _check_state(layout, state, pool_size)
        check_split(layout, "stash", [("indices", indices), *payload_rows(ops.spec, payload)])
        return each(ops.stash)(state, indices, payload)  # type: ignore[no-any-return]

    def resolve(state: FutureMapState, batch: Batch) -> tuple[FutureMapState, Resolved]:
        _check_state(layout, state, pool_size)
        mode = batch.forward_mode
        # A host mode is fixed in every rank's executable; a traced one is a scalar or one
        # per rank, each rank seeing its [1] slice.
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
        _check_state(layout, state, pool_size)
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


def per_rank(x: jax.Array, layout: MeshLayout) -> dict[int, np.ndarray]:
    """Host copies of each local DP rank's block of a global [DP*N, ...] array (this
    process's shards only, one replica per rank: it works in every process)."""
    out: dict[int, np.ndarray] = {}
    for sh in x.addressable_shards:
        rank = layout.rank_of(sh.device)
        if rank not in out:
            out[rank] = np.asarray(sh.data)
    return out
