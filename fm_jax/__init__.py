"""fm_jax: a functional FutureMap for overlap-scheduled JAX serving engines.

Pure ops (`future_map`, `sharded_future_map` on a mesh) to inline in an engine's own
jitted step, and a `FutureMap` class with donated, in-place entry points for engines that
call ops one by one, on one device or a mesh.
"""

from fm_jax._src.buckets import pad_to_bucket, power_of_two_buckets
from fm_jax._src.compile_options import compiler_options, use_persistent_cache
from fm_jax._src.confidence import ResolvedConfidence
from fm_jax._src.debug_channel import raise_if_violated
from fm_jax._src.engine_step import EngineStep, StepInput, StepOutput, StepResult
from fm_jax._src.errors import FutureMapError, InvariantViolation, StateLost
from fm_jax._src.future_map import FutureMap
from fm_jax._src.ops import POISON, FutureMapOps, future_map
from fm_jax._src.registry import WarmUpReport
from fm_jax._src.relay_fields import RelayField
from fm_jax._src.sharding import (
    MeshLayout,
    ShardedFutureMapOps,
    mesh_layout,
    per_rank,
    sharded_future_map,
)
from fm_jax._src.types import (
    Batch,
    DraftPayload,
    ForwardMode,
    FutureMapState,
    MixedTails,
    Resolved,
    SpecConfig,
)

__all__ = [
    "POISON",
    "Batch",
    "DraftPayload",
    "EngineStep",
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
    "ShardedFutureMapOps",
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
    "sharded_future_map",
    "use_persistent_cache",
]
