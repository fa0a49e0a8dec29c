"""One module per benchmarked implementation; each has `build(cfg, data, debug, ops)`.

`build` returns {op: Op} for the ops it implements. Each Op's `run` blocks until its device
work is done; `setup` (untimed) keeps the workload valid, e.g. a stash before a debug resolve.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _nothing() -> None:
    return None


@dataclass
class Op:
    """A timed workload and its untimed setup; `baseline` names a paired series (fused)."""

    run: Callable[[], object]
    setup: Callable[[], object] = _nothing
    baseline: Callable[[], object] | None = None
