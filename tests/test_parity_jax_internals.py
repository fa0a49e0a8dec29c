"""fm_parity's JAX internals: present on the installed JAX, and a clear error naming the
internal and the JAX version when one is missing (not a failure deep inside a run)."""

from __future__ import annotations

import pytest

from fm_parity import jax_internals
from fm_parity.transfers import no_device_to_host


def test_the_internals_are_present_on_this_jax() -> None:
    """The array class holds each read entry point the detector patches; the coordination
    client is None before jax.distributed.initialize()."""
    impl = jax_internals.array_impl()
    assert all(k in impl.__dict__ for k in jax_internals.ARRAY_READS)
    assert jax_internals.coordination_client() is None


def test_a_missing_internal_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """An array class without one of the patched methods, or a distributed module without
    its global state: JaxInternalsChanged names what is missing and the tested versions."""
    import jax
    from jax._src import distributed

    class Plain:
        pass

    jax_internals.array_impl.cache_clear()
    monkeypatch.setattr(jax_internals.jnp, "zeros", lambda n: Plain())
    with pytest.raises(jax_internals.JaxInternalsChanged, match="copy_to_host_async"):
        jax_internals.array_impl()
    with (
        pytest.raises(jax_internals.JaxInternalsChanged, match="copy_to_host_async"),
        no_device_to_host(),
    ):
        pass
    monkeypatch.undo()
    jax_internals.array_impl.cache_clear()
    monkeypatch.delattr(distributed, "global_state")
    with pytest.raises(jax_internals.JaxInternalsChanged, match=f"jax {jax.__version__}"):
        jax_internals.coordination_client()
