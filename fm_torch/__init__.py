"""fm_torch: the PyTorch twin of the FutureMap contract, the parity reference for fm_jax.

The contract is docs/CONTRACT.md. `FutureMap` is modelled on SGLang's FutureMap
(`python/sglang/srt/managers/overlap_utils.py`), written for this project, not copied. It
has two protocols, chosen when it is built: "sentinel" (the default; SGLang's relay of late
May 2026, PRs #25862 to #26108: invalidate leaves -slot sentinels that resolve fills) and
"gather" (SGLang's later relay, commit 0178132: no sentinels, no invalidate; resolve
gathers decode ids, a MIXED batch's running tokens and spec lengths by slot). What it checks
that SGLang's class does not: every input's rank, shape, dtype and device, the forward mode
and spec payload shapes (always, metadata only); and, on CPU tensors (no device sync there)
or in debug mode on any device, their values: slots in [0, R), no live slot twice in a
batch, sentinels naming a slot in [0, R), int rows of any int dtype whose values fit the
buffer's dtype (then cast), relayed tokens and lengths >= 0, no negative input id in the
gather protocol. All of them run before
anything is written.
"""

from fm_torch.batch import DraftInput, DraftPayload, ForwardMode, ScheduleBatch
from fm_torch.confidence import ResolvedConfidence
from fm_torch.errors import FutureMapError, InvariantViolation
from fm_torch.future_map import DEBUG_ENV, POISON, FutureMap, debug_from_env
from fm_torch.relay import RelayBuffers

__all__ = [
    "DEBUG_ENV",
    "POISON",
    "DraftInput",
    "DraftPayload",
    "ForwardMode",
    "FutureMap",
    "FutureMapError",
    "InvariantViolation",
    "RelayBuffers",
    "ResolvedConfidence",
    "ScheduleBatch",
    "debug_from_env",
]
