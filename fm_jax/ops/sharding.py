"""The FutureMap on a `jax.sharding.Mesh`: one pool of R slots per data-parallel rank.
Every state buffer and batch field is one global array sharded over `dp_axis`: rank d owns
rows [d*R, (d+1)*R) (a batch: its B rows, padded, end to end), every other axis holds
replicas. Each op is the one-pool op under `jax.shard_map`: no collectives."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fm_jax.ops.errors import FutureMapError


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
        """The sharding of every state buffer and batch field (one device: its
        SingleDeviceSharding, as committed arrays carry; a NamedSharding would compile
        another executable)."""
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
        """`fn` run on each DP rank's block of every argument and result (`jax.shard_map`)."""
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=self.spec, out_specs=self.spec, check_vma=check_vma
        )

    def global_array(self, blocks: Mapping[int, np.ndarray], size: int, like: np.ndarray) -> Any:
        """The global [DP*size, ...] array whose rank-d block is `blocks[d]` padded with
        zero rows to `size`: in one process a host array, across processes a global
        jax.Array of this process's blocks."""
        tail, dt = like.shape[1:], like.dtype
        if self.single_process:
            out = np.zeros((self.dp * size, *tail), dt)
            for rank, block in blocks.items():
                out[rank * size : rank * size + block.shape[0]] = block
            return out
        local = {}
        for rank in self.local_ranks():
            local[rank] = np.zeros((size, *tail), dt)
            got = blocks.get(rank)
            if got is not None:
                local[rank][: got.shape[0]] = got
        sharding = NamedSharding(self.mesh, self.spec)
        arrays = [jax.device_put(local[self.rank_of(d)], d) for d in sharding.addressable_devices]
        shape = (self.dp * size, *tail)
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def single_device_layout(device: jax.Device) -> MeshLayout:
    """The layout of a map on one device: a one-device mesh, one DP rank."""
    return mesh_layout(Mesh(np.array([device]), ("dp",)), "dp")


def mesh_layout(mesh: Mesh, dp_axis: str | None = "dp", tp_axis: str | None = None) -> MeshLayout:
    """The layout of `mesh` with these axes (None: no such axis; `tp_axis` is only
    checked). Its mesh has every axis Auto, so that its shard_maps take arrays of
    Explicit meshes (`jax.make_mesh`'s default) as they take host arrays."""
    if not isinstance(mesh, Mesh):
        raise FutureMapError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    for role, axis in (("dp_axis", dp_axis), ("tp_axis", tp_axis)):
        if axis is not None and axis not in names:
            raise FutureMapError(f"{role} {axis!r} is not an axis of the mesh {names}")
    if dp_axis is not None and dp_axis == tp_axis:
        raise FutureMapError(f"dp_axis and tp_axis must differ, both are {dp_axis!r}")
    dp = int(mesh.shape[dp_axis]) if dp_axis is not None else 1
    auto = Mesh(mesh.devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    return MeshLayout(auto, dp_axis, tp_axis, dp)


def check_split(layout: MeshLayout, what: str, named: Iterable[tuple[str, Any]]) -> None:
    """Each named per-row value (None: not given) an array whose leading size splits into
    DP equal per-rank parts; else FutureMapError naming the op `what` and the field."""
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
    return f"a Python {type(x).__name__}" if type(x) in (list, tuple) else f"a {type(x).__name__}"


def per_rank(x: jax.Array, layout: MeshLayout) -> dict[int, np.ndarray]:
    """Host copies of each local DP rank's block of a global [DP*N, ...] array."""
    out: dict[int, np.ndarray] = {}
    for sh in x.addressable_shards:
        rank = layout.rank_of(sh.device)
        if rank not in out:
            out[rank] = np.asarray(sh.data)
    return out
