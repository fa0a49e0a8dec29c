"""What a run records: one OpRecord per FutureMap op (and per forward), in host order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Field:
    """One recorded array and the slot of each leading entry (for divergence reports).

    `value` is a host numpy array, or on an accelerator a device tensor (see exchange.py).
    """

    value: Any
    slots: np.ndarray


@dataclass(frozen=True)
class OpRecord:
    """The state after one op: `step` (scheduler step), `op` name, fields by name."""

    step: int
    op: str
    fields: dict[str, Field]


@dataclass
class RunResult:
    """One overlap (or reference) run of a scenario.

    Attributes:
      records: the trace (empty for the reference loop).
      streams: request id -> what the model produced for it, in order (non-spec: tokens;
        spec: accept length and bonus token per step).
      steps: scheduler steps run.
      error: the FutureMap error that stopped the run, if any.
      error_kind: 'debug' (an invariant violation) or 'checks' (input checks), or None.
    """

    records: list[OpRecord] = field(default_factory=list)
    streams: dict[int, list[int]] = field(default_factory=dict)
    steps: int = 0
    error: str | None = None
    error_kind: str | None = None
