"""Every JAX internal fm_parity relies on, in one place, each checked before use.

fm_jax itself uses JAX's public API only, and so does fm_parity except here: the
device-to-host transfer detector (`fm_parity.transfers`) patches the read entry points of
jax's concrete array class, which is not public API. The JAX requirement has no upper
bound, so each accessor checks that what it needs is there and otherwise raises
`JaxInternalsChanged` naming the internal, the JAX version and the versions it was tested
on, instead of failing somewhere inside a run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

TESTED = "jax 0.10.2 (CPU), 0.11.2 (CPU, CUDA 13) and 0.12.0.1 (CPU)"
"""The JAX versions these internals were checked against."""

ARRAY_READS = ("_value", "__array__", "copy_to_host_async")
"""The methods of jax's concrete array class through which a device array reaches the host."""


class JaxInternalsChanged(RuntimeError):
    """A JAX internal fm_parity relies on is missing from the installed JAX."""


def _changed(what: str) -> JaxInternalsChanged:
    return JaxInternalsChanged(
        f"fm_parity relies on {what}, which jax {jax.__version__} does not have (checked on "
        f"{TESTED}); see fm_parity/jax_internals.py"
    )


@functools.cache
def array_impl() -> type:
    """jax's concrete array class (`ArrayImpl`), holding each of `ARRAY_READS` itself (the
    transfer detector patches them on the class)."""
    impl = type(jnp.zeros(1))
    missing = [k for k in ARRAY_READS if k not in impl.__dict__]
    if missing:
        raise _changed(f"the read entry points {missing} defined on {impl.__name__}")
    return impl
