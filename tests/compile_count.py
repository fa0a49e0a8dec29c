"""Compiles counted in a block, through JAX's public monitoring hooks (a test of the serving
guard: a warmed map or step compiles nothing), not through fm_jax's own registry."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from jax import monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compile or a cache load


class Compiles:
    """The process's compiles (every thread's) while registered: `executables`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.executables = 0

    def __call__(self, event: str, duration_secs: float, **kwargs: object) -> None:
        if event == COMPILE_EVENT:
            with self.lock:
                self.executables += 1


@contextmanager
def counting_compiles() -> Iterator[Compiles]:
    """Count the compiles inside the block."""
    counter = Compiles()
    monitoring.register_event_duration_secs_listener(counter)
    try:
        yield counter
    finally:
        monitoring.unregister_event_duration_listener(counter)
