"""A FutureMap's parts, assembled from its constructor's arguments (each checked here).

The layout (one device, or a mesh), the lifted pure ops, the protocol, the host-input
placement, the runtime (state, lock, debug channel, host lengths) and the executable
registry. `FutureMap` holds them and says which op is which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh

from fm_jax.host import buckets as bk
from fm_jax.host.host_inputs import HostInputs
from fm_jax.host.keys import Key
from fm_jax.host.placement import Placement
from fm_jax.map.compile_options import compiler_options
from fm_jax.map.confidence import ConfidenceRing
from fm_jax.map.debug_channel import DebugChannel
from fm_jax.map.entry_points import entry_points
from fm_jax.map.host_lengths import HostLengths
from fm_jax.map.registry import Registry
from fm_jax.map.runtime import MapRuntime
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.ops import future_map
from fm_jax.ops.protocol import parse_protocol
from fm_jax.ops.sharding import (
    MeshLayout,
    lift,
    mesh_layout,
    single_device_layout,
)
from fm_jax.ops.types import FutureMapOps, FutureMapState, SpecConfig


class MapParts(NamedTuple):
    """What a FutureMap is made of."""

    layout: MeshLayout
    ops: FutureMapOps
    placement: Placement
    runtime: MapRuntime
    registry: Registry
    options: dict[str, str]


def assemble(
    pool_size: int,
    *,
    mesh: Mesh | None,
    dp_axis: str | None,
    tp_axis: str | None,
    dtype: Any,
    spec: SpecConfig | None,
    debug: bool,
    batch_buckets: Sequence[int] | None,
    token_buckets: Sequence[int] | None,
    device: jax.Device | None,
    protocol: str,
    pack_inputs: bool | None,
    needs_cpu_seq_lens: bool,
) -> MapParts:
    """A map's parts (the arguments as `FutureMap` documents them); FutureMapError names
    the first argument that is wrong."""
    if mesh is not None and device is not None:
        raise FutureMapError("pass a mesh or a device, not both")
    if device is not None and not isinstance(device, jax.Device):
        raise FutureMapError(f"device must be a jax.Device, got {device!r}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise FutureMapError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
    layout = (
        single_device_layout(device or jax.devices()[0])
        if mesh is None
        else mesh_layout(mesh, dp_axis, tp_axis)
    )
    local = future_map(pool_size, dtype=dtype, spec=spec, debug=debug, protocol=protocol)
    platform = layout.mesh.devices.flat[0].platform
    if local.spec is not None and local.spec.kernel == "pallas" and platform not in ("cpu", "gpu"):
        raise FutureMapError(
            f"spec.kernel='pallas' is a Triton kernel (GPU; on CPU interpreted): no "
            f"lowering for {platform}; use kernel='xla'"
        )
    ops = lift(local, layout)
    proto = parse_protocol(local.protocol)
    batch_buckets = bk.normalize_buckets(
        bk.power_of_two_buckets(1024) if batch_buckets is None else batch_buckets
    )
    token_buckets = bk.normalize_buckets(
        bk.power_of_two_buckets(8192) if token_buckets is None else token_buckets
    )
    if token_buckets[-1] < batch_buckets[-1]:
        # A batch has at least one token per row (a DECODE row one): its rows are padded to
        # a batch bucket and its tokens to a token bucket >= those rows (resolve_sizes).
        raise FutureMapError(
            f"token_buckets {token_buckets} must reach the largest batch bucket "
            f"{batch_buckets[-1]}: a batch of B rows carries at least B tokens (a DECODE "
            "row one), so the largest token bucket must be >= the largest batch bucket "
            "(or a resolve of those rows, and warm_up, could not be placed)"
        )
    inputs = HostInputs(
        layout,
        pool_size,
        local.dtype,
        batch_buckets,
        token_buckets,
        proto,
    )
    debug_channel = DebugChannel(layout) if debug else None
    fresh: Callable[[], FutureMapState] = jax.jit(ops.init, out_shardings=layout.sharding)
    try:
        state = fresh()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise FutureMapError(
            f"pool_size {pool_size}: the buffers do not fit the device's memory ({e})"
        ) from None
    if pack_inputs is not None and not isinstance(pack_inputs, bool):
        raise FutureMapError(f"pack_inputs must be a bool or None, got {pack_inputs!r}")
    packs = inputs.single_process and (platform != "cpu" if pack_inputs is None else pack_inputs)
    options = compiler_options(platform)
    if not isinstance(needs_cpu_seq_lens, bool):
        raise FutureMapError(f"needs_cpu_seq_lens must be a bool, got {needs_cpu_seq_lens!r}")
    # The last publish's lengths on their way to the host (one process only).
    lengths = HostLengths() if needs_cpu_seq_lens and inputs.single_process else None
    ring = None
    if local.spec is not None and local.spec.confidence:
        ring = ConfidenceRing(pool_size, layout.dp, layout.rank_of, layout.local_ranks())
    optional = rf.optional(local.spec.fields()) if local.spec is not None else ()
    runtime = MapRuntime(
        fresh,
        state,
        debug_channel,
        lengths,
        ring,
        optional,
        layout.dp,
        spec=local.spec is not None,
    )
    placement = Placement(inputs, proto, local.spec, pack_inputs=packs, debug=debug)
    placement.last_checked = runtime.last_checked
    # Debug: the tail ops' only checks are slot checks; slots already checked take
    # executables without them (a checked one costs ~35 us more per call on XLA:CPU).
    unchecked = (
        lift(future_map(pool_size, dtype=dtype, spec=spec, protocol=protocol), layout)
        if debug
        else ops
    )
    build = entry_points(ops, unchecked, proto, token_buckets, debug_channel, options)
    registry = Registry(build, _refusal(batch_buckets, token_buckets))
    return MapParts(layout, ops, placement, runtime, registry, options)


def _refusal(
    batch_buckets: tuple[int, ...], token_buckets: tuple[int, ...]
) -> Callable[[Key], str]:
    """The serving guard's words for a class call warm-up did not compile."""

    def words(key: Key) -> str:
        return (
            f"serving guard: {key.describe()} was not compiled by warm_up() (batch buckets "
            f"{batch_buckets}, token buckets {token_buckets}); a call would "
            "compile it: add its bucket, or pass inputs padded to a warmed one"
        )

    return words
