"""What a run records: one OpRecord per FutureMap op (and per forward) and DP rank, in order."""

from __future__ import annotations

from collections.abc import Sequence
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
    """The state after one op on one DP rank: scheduler `step`, `op` name, fields by name.

    `rank` is the data-parallel rank whose pool and batch the record describes (0 on one
    device); a rank's records keep their order whatever process recorded them.
    """

    step: int
    op: str
    fields: dict[str, Field]
    rank: int = 0


@dataclass
class RunResult:
    """One overlap run of a twin over one or more DP ranks.

    Attributes:
      records: the trace, every rank's records in host order.
      streams: (rank, request id) -> what the model produced for the request, in order
        (non-spec: tokens; spec: accept length and bonus token per step).
      steps: scheduler steps run (the longest rank's).
      error: the FutureMap error that stopped the run, if any.
      error_kind: 'debug' (an invariant violation), 'checks' (input checks) or 'sync' (a
        device-to-host transfer the detector could not let through), or None.
      syncs: the device-to-host transfers inside map ops ('step N: op: ...'), where the
        twin watches for them (fm_jax, gather protocol: the 'sync' check); none is allowed.
    """

    records: list[OpRecord] = field(default_factory=list)
    streams: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    steps: int = 0
    error: str | None = None
    error_kind: str | None = None
    syncs: list[str] = field(default_factory=list)

    def ranks(self) -> list[int]:
        """The DP ranks with records or streams, ascending."""
        return sorted({r.rank for r in self.records} | {rank for rank, _ in self.streams})


def merge(parts: Sequence[RunResult]) -> RunResult:
    """One run from the runs of disjoint DP ranks (one per process of a distributed run).

    ValueError when two parts hold the same rank: each rank has one recorder.
    """
    out = RunResult()
    owner: dict[int, int] = {}
    for i, part in enumerate(parts):
        for rank in part.ranks():
            if owner.setdefault(rank, i) != i:
                raise ValueError(f"DP rank {rank} recorded by parts {owner[rank]} and {i}")
        out.records += part.records
        out.streams.update(part.streams)
        out.steps = max(out.steps, part.steps)
        out.syncs += part.syncs
        if out.error is None and part.error is not None:
            out.error, out.error_kind = part.error, part.error_kind
    return out
