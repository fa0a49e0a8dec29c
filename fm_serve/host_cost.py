"""The simulated host scheduling cost: a fixed time per scheduled batch.

Real schedulers spend host time per step (radix-cache matching, sampling params, batch
bookkeeping). The demo stands that in with a calibrated wait of `seconds` per batch:
`spin` busy-waits (holds a CPU core, as real Python scheduling does), `sleep` yields the core
(as a host that does not share cores with the device would see).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

KINDS = ("spin", "sleep")


@dataclass(frozen=True)
class HostCost:
    """Wait `seconds` per call, spinning or sleeping."""

    seconds: float = 0.0
    kind: str = "spin"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"host cost kind must be one of {KINDS}, got {self.kind!r}")
        if self.seconds < 0:
            raise ValueError(f"host cost must be >= 0 seconds, got {self.seconds}")

    def __call__(self) -> None:
        """Spend the configured host time."""
        if self.seconds <= 0:
            return
        if self.kind == "sleep":
            time.sleep(self.seconds)
            return
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
