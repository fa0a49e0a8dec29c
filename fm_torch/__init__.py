"""fm_torch: the PyTorch FutureMap twin, faithful to SGLang, the parity reference for fm_jax."""

from fm_torch.batch import DraftInput, DraftPayload, ForwardMode, ScheduleBatch
from fm_torch.errors import FutureMapError, InvariantViolation
from fm_torch.future_map import DEBUG_ENV, POISON, FutureMap, debug_from_env

__all__ = [
    "DEBUG_ENV",
    "POISON",
    "DraftInput",
    "DraftPayload",
    "ForwardMode",
    "FutureMap",
    "FutureMapError",
    "InvariantViolation",
    "ScheduleBatch",
    "debug_from_env",
]
