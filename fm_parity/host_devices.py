"""Virtual CPU devices for a child process: the one way fm_parity, fm_bench and the tests
ask XLA for them (it reads the flag once, when JAX starts, so only a new process gets them)."""

from __future__ import annotations

from collections.abc import Mapping

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def with_host_devices(env: Mapping[str, str], n: int) -> dict[str, str]:
    """A copy of `env` whose XLA_FLAGS ask for `n` virtual CPU devices (appended to the
    flags already there: XLA takes the last occurrence)."""
    out = dict(env)
    out["XLA_FLAGS"] = f"{out.get('XLA_FLAGS', '')} {HOST_DEVICES_FLAG}={n}".strip()
    return out
