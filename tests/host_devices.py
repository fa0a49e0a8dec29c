"""The environment of a child process whose JAX runs on `n` virtual CPU devices."""

from __future__ import annotations

import os

from fm_parity.host_devices import with_host_devices


def cpu_devices_env(n: int) -> dict[str, str]:
    """os.environ with JAX pinned to the CPU platform (on a GPU machine the default backend
    is the GPU, which has no virtual devices), `n` host devices (appended to any XLA_FLAGS:
    the last occurrence wins) and x64 off."""
    env = with_host_devices(dict(os.environ, JAX_PLATFORMS="cpu"), n)
    env.pop("JAX_ENABLE_X64", None)
    return env
