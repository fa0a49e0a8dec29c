"""fm_jax: a functional FutureMap for overlap-scheduled JAX serving engines: pure ops
(`future_map`) to inline in an engine's own jitted step, and a `FutureMap` class with
donated, in-place entry points, on one device or a mesh."""

from fm_jax.host.buckets import pad_to_bucket, power_of_two_buckets
from fm_jax.map.debug_channel import raise_if_violated
from fm_jax.map.engine_step import EngineStep, HostOut, StepInput, StepOutput, StepResult
from fm_jax.map.executables import compiler_options, use_persistent_cache
from fm_jax.map.future_map import FutureMap
from fm_jax.map.host_reads import ResolvedConfidence
from fm_jax.map.warm_up import WarmUpReport
from fm_jax.ops.errors import FutureMapError, InvariantViolation, StateLost
from fm_jax.ops.ops import POISON, FutureMapOps, future_map
from fm_jax.ops.sharding import (
    MeshLayout,
    mesh_layout,
    per_rank,
)
from fm_jax.ops.types import (
    Batch,
    DraftPayload,
    ForwardMode,
    FutureMapState,
    MixedTails,
    RelayField,
    Resolved,
    SpecConfig,
)

__all__ = [
    "POISON",
    "Batch",
    "DraftPayload",
    "EngineStep",
    "HostOut",
    "ForwardMode",
    "FutureMap",
    "FutureMapError",
    "FutureMapOps",
    "FutureMapState",
    "InvariantViolation",
    "MeshLayout",
    "MixedTails",
    "RelayField",
    "Resolved",
    "ResolvedConfidence",
    "SpecConfig",
    "StateLost",
    "StepInput",
    "StepOutput",
    "StepResult",
    "WarmUpReport",
    "compiler_options",
    "future_map",
    "mesh_layout",
    "pad_to_bucket",
    "per_rank",
    "power_of_two_buckets",
    "raise_if_violated",
    "use_persistent_cache",
]
