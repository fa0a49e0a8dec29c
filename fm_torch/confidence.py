"""The confidence relay (DSpark), modelled on SGLang 0.5.23's `ConfidenceRelay`.

A publish with confidence rows scatters them into a per-slot buffer ([R, gamma] float32,
shaped by the first confidence published) and copies the whole buffer into a host ring
(LAG 2, DEPTH 3), with a snapshot of the host's per-slot generation counters. On CUDA the
copy runs on a side stream behind the publish event, into pinned memory, and an event marks
it done; on CPU it is a plain copy, done at once. A read takes the entry LAG publishes back
without waiting: None before LAG publishes, for no slots, or while that copy is not done.

Where this differs from SGLang (docs/CONTRACT.md, 'The confidence relay'): the ring runs on
every device (SGLang's CPU path returns the current rows, not the lagged ones); the host
passes its generation counters to each publish (SGLang's relay holds the request pool);
a read may wait for its entry; the next scatter waits (on the device) for the copy of the
buffer still in flight, so an entry holds the buffer exactly as its publish left it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fm_torch import validate as v
from fm_torch.errors import FutureMapError

LAG = 2
"""Publishes back a read looks (SGLang's CONFIDENCE_RELAY_RING_LAG)."""

DEPTH = LAG + 1
"""Ring entries: the one read, the one landing, the one being written."""


class ResolvedConfidence(NamedTuple):
    """A batch's confidence rows as the ring held them ([B, gamma] float32, host) and each
    slot's generation when they were copied ([B] int64)."""

    confidence: torch.Tensor
    generation: torch.Tensor


def not_declared() -> FutureMapError:
    """Confidence given to (or read from) a map built without the relay."""
    return FutureMapError(
        "confidence given but the map relays none: build it with needs_confidence_relay=True"
    )


class ConfidenceRelay:
    """The confidence buffer and its host ring, for one map.

    Args:
      pool_size: R, slots.
      device: the map's device.
    """

    def __init__(self, pool_size: int, device: torch.device) -> None:
        self.pool_size = pool_size
        self.device = device
        self.confidence_buf: torch.Tensor | None = None
        self.conf_ring: torch.Tensor | None = None
        self.gen_ring = torch.zeros((DEPTH, pool_size), dtype=torch.int64)
        self.copy_done: list[torch.cuda.Event] | None = None
        self.ring_pos = 0
        self._stream: torch.cuda.Stream | None = None

    def check(
        self, confidence: object, generation: object, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Confidence rows [rows, gamma] float32 on the map's device (gamma the buffer's once
        shaped) and the host's generation counters [R] (CPU ints); FutureMapError naming the
        field otherwise. Reads no device value."""
        if not isinstance(confidence, torch.Tensor) or confidence.dim() != 2:
            raise FutureMapError("confidence must be a 2-D tensor [B, gamma]")
        buf = self.confidence_buf
        gamma = confidence.shape[1] if buf is None else buf.shape[1]
        conf = v.check_tensor(
            "confidence", confidence, self.device, (rows, gamma), (torch.float32,)
        )
        if generation is None:
            raise FutureMapError(
                "generation is required with confidence: the request pool's per-slot "
                f"generation counter, [{self.pool_size}] ints (SGLang's req_generation)"
            )
        gen = v.check_tensor(
            "generation", generation, torch.device("cpu"), (self.pool_size,), v.INT_DTYPES
        )
        return conf, gen

    def scatter(self, indices: torch.Tensor, confidence: torch.Tensor) -> None:
        """`confidence_buf[indices] := confidence` (the buffer and ring shaped on first use)."""
        if self.confidence_buf is None:
            self._shape(confidence.shape[1])
        assert self.confidence_buf is not None
        if self.copy_done is not None and self.ring_pos:
            # The last copy may still read the buffer: this write goes after it (on the
            # device; the host does not wait).
            self.copy_done[(self.ring_pos - 1) % DEPTH].wait()
        self.confidence_buf[indices] = confidence

    def _shape(self, gamma: int) -> None:
        r = self.pool_size
        self.confidence_buf = torch.zeros((r, gamma), dtype=torch.float32, device=self.device)
        on_cuda = self.device.type == "cuda"
        self.conf_ring = torch.zeros((DEPTH, r, gamma), dtype=torch.float32, pin_memory=on_cuda)
        if on_cuda:
            self.copy_done = [torch.cuda.Event() for _ in range(DEPTH)]
            self._stream = torch.cuda.Stream(device=self.device)

    def issue_ring_copy(self, generation: torch.Tensor, publish_ready: torch.Event | None) -> None:
        """Copy the buffer into the next ring entry (on CUDA: on the side stream, behind
        `publish_ready`, without waiting) and snapshot `generation` with it."""
        assert self.confidence_buf is not None and self.conf_ring is not None
        entry = self.ring_pos % DEPTH
        if self._stream is not None and self.copy_done is not None:
            if publish_ready is not None:
                self._stream.wait_event(publish_ready)  # type: ignore[arg-type]
            with torch.cuda.stream(self._stream):
                self.conf_ring[entry].copy_(self.confidence_buf, non_blocking=True)
                self.copy_done[entry].record()
        else:
            self.conf_ring[entry].copy_(self.confidence_buf)
        self.gen_ring[entry].copy_(generation)
        self.ring_pos += 1

    def resolve(self, indices: torch.Tensor, wait: bool) -> ResolvedConfidence | None:
        """The rows and generations at host slots `indices` from the entry LAG publishes
        back, or None (see the module docstring)."""
        if self.ring_pos < LAG or indices.numel() == 0 or self.conf_ring is None:
            return None
        entry = (self.ring_pos - LAG) % DEPTH
        if self.copy_done is not None:
            done = self.copy_done[entry]
            if not done.query():
                if not wait:
                    return None
                done.synchronize()
        return ResolvedConfidence(self.conf_ring[entry][indices], self.gen_ring[entry][indices])
