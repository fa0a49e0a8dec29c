"""A device-to-host transfer detector for JAX: the 'sync' check of the gather protocol.

In the gather protocol `resolve_seq_lens_cpu` is the only device-to-host transfer
(docs/CONTRACT.md, 'Two protocols'): an engine that never asks for the host lengths moves
nothing from the device to the host in resolve, publish or stash. `no_device_to_host()`
watches a block of code for such a transfer:

- JAX's transfer guard (`jax.transfer_guard_device_to_host("disallow")`), live on
  accelerators (on CPU a jax array is host memory and the guard lets reads through);
- on every backend, the Python entry points that read an array's values, patched for the
  block: `jax.Array._value` (`int(x)`, `x.tolist()`, `x.item()`, ...), `__array__`
  (`np.asarray(x)` of a device array) and `copy_to_host_async` (`jax.device_get`). A
  CPU array also offers numpy its memory through the buffer protocol, which no patch
  reaches: `np.asarray(x)` (and `x.item()`) of one goes unseen (it moves nothing: the array is host
  memory).

With no `on_transfer` a transfer raises DeviceToHostTransfer. With one, the patched entry
points call `on_transfer(what)` and then read as usual (the block runs to its end; the
detector records, it does not change what the code computes); a transfer only the guard
sees cannot be let through, so it is reported the same way and then raised as
DeviceToHostTransfer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from fm_parity.jax_internals import ARRAY_READS, array_impl

GUARD_MESSAGE = "Disallowed device-to-host transfer"
"""What JAX's transfer guard says when it refuses a transfer."""


class DeviceToHostTransfer(RuntimeError):
    """A device-to-host transfer inside a `no_device_to_host()` block."""


@contextlib.contextmanager
def no_device_to_host(on_transfer: Callable[[str], None] | None = None) -> Iterator[None]:
    """Watch the block for device-to-host transfers (see the module docstring).

    Args:
      on_transfer: None: a transfer raises DeviceToHostTransfer ('device-to-host transfer
        (<entry point>)'). Else it is called with that text for each read and the read
        goes ahead.
    """
    impl = array_impl()
    saved = {k: impl.__dict__[k] for k in ARRAY_READS}

    def seen(what: str) -> None:
        text = f"device-to-host transfer ({what})"
        if on_transfer is None:
            raise DeviceToHostTransfer(text)
        on_transfer(text)

    def value(self: Any) -> Any:
        seen("jax.Array._value")
        with jax.transfer_guard_device_to_host("allow"):
            return saved["_value"].__get__(self, impl)

    def array(self: Any, *args: Any, **kw: Any) -> Any:
        seen("jax.Array.__array__")
        with jax.transfer_guard_device_to_host("allow"):
            return saved["__array__"](self, *args, **kw)

    def copy_async(self: Any) -> Any:
        seen("jax.Array.copy_to_host_async")
        with jax.transfer_guard_device_to_host("allow"):
            return saved["copy_to_host_async"](self)

    try:
        for k, v in zip(ARRAY_READS, (property(value), array, copy_async), strict=True):
            setattr(impl, k, v)
        with jax.transfer_guard_device_to_host("disallow"):
            yield
    except DeviceToHostTransfer:
        raise
    except Exception as e:
        if GUARD_MESSAGE not in str(e):
            raise
        text = f"device-to-host transfer (transfer guard: {e})"
        if on_transfer is not None:
            on_transfer(text)
        raise DeviceToHostTransfer(text) from e
    finally:
        for k, v in saved.items():
            setattr(impl, k, v)
