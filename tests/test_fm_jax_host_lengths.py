"""Lengths to the host without a stall (`needs_cpu_seq_lens`): a publish starts copying its
lengths to the host, and `resolve_seq_lens_cpu` at those slots takes the copy, waiting for
the publishing step only; anything else gathers from the buffer, with the same values."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fm_jax as fj

D = fj.ForwardMode.DECODE


def a(*x: int) -> np.ndarray:
    return np.array(x, np.int32)


def make(needs: bool, protocol: str = "sentinel") -> fj.FutureMap:
    return fj.FutureMap(
        32,
        batch_buckets=(4,),
        token_buckets=(4,),
        needs_cpu_seq_lens=needs,
        protocol=protocol,
    )


@jax.jit
def slow(x: jax.Array) -> jax.Array:
    """A forward long enough to be still running when the host reads (about 0.1-1 s)."""
    for _ in range(12):
        x = jnp.tanh(x @ x)
    return x


FORWARD_SIZE = 600 if jax.default_backend() == "cpu" else 8192
"""`slow`'s matrix size: 12 products of 600 x 600 take a CPU 0.1-1 s, an H100 microseconds
(8192: about 10 ms of float32 products there)."""


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_host_lengths_are_the_buffers_values(protocol: str) -> None:
    """With and without the copy, every read returns new_seq_lens at the slots: after a
    publish of host or device lengths, a finish, an engine step, at the slots last
    published, at other slots, and after a later publish elsewhere."""

    def run(needs: bool) -> list[list[int]]:
        fm = make(needs, protocol)
        out = []
        fm.publish(a(3, 5), a(4, 6))  # host lengths: kept as given
        out.append(fm.resolve_seq_lens_cpu(a(3, 5)).tolist())
        fm.publish(a(3, 5, 7), jax.device_put(a(8, 9, 10, 0)))  # device lengths: copied
        out.append(fm.resolve_seq_lens_cpu(a(3, 5, 7)).tolist())
        out.append(fm.resolve_seq_lens_cpu(a(5, 3)).tolist())  # other slots: gathered
        ids = a(1, 2) if protocol == "gather" else a(-3, -5)
        b = fj.Batch(
            D,
            a(3, 5),
            None if protocol == "gather" else ids,
            a(8, 9) if protocol == "gather" else ids,
        )
        fm.finish(b, a(3, 5), jax.device_put(a(11, 12, 0, 0)), a(1, 2))
        out.append(fm.resolve_seq_lens_cpu(a(3, 5)).tolist())
        out.append(fm.resolve_seq_lens_cpu(a(7)).tolist())

        def forward(res: fj.Resolved, batch: fj.Batch, inputs: Any) -> fj.StepOutput:
            return fj.StepOutput(res.seq_lens + 1, res.input_ids, None)

        step = fm.engine_step(forward)
        step(
            fj.Batch(
                D,
                a(3, 5),
                None if protocol == "gather" else a(-3, -5),
                a(11, 12) if protocol == "gather" else a(-3, -5),
            )
        )
        out.append(fm.resolve_seq_lens_cpu(a(3, 5)).tolist())
        fm.publish(a(9), a(2))  # a publish elsewhere: slots 3, 5 are read from the buffer
        out.append(fm.resolve_seq_lens_cpu(a(3, 5)).tolist())
        return out

    assert run(True) == run(False)
    assert run(True)[:2] == [[4, 6], [8, 9, 10]]


@pytest.mark.parametrize("reset", [False, True])
@pytest.mark.parametrize("needs", [True, False])
def test_reading_the_last_published_lengths_waits_for_their_step_only(
    needs: bool, reset: bool
) -> None:
    """With the next step's forward queued behind the publish (it reads the map), the read
    of the slots just published returns while that forward still runs; without the copy
    (`needs_cpu_seq_lens=False`) the read is a sync behind it. A map `reset()` (after a
    publish) serves as it was made: it copies exactly when `needs_cpu_seq_lens` says."""
    fm = make(needs)
    if reset:
        fm.publish(a(3, 5, 7, 9), a(1, 1, 1, 1))
        fm.reset()
    x = jnp.ones((FORWARD_SIZE, FORWARD_SIZE), jnp.float32)
    slow(x).block_until_ready()
    idx = a(3, 5, 7, 9)
    lens = jax.jit(lambda: jnp.arange(4, dtype=jnp.int32) + 3)()
    fm.publish(idx, lens)  # step N publishes
    res = fm.resolve(fj.Batch(D, idx, -idx, -idx))
    queued = slow(x + res.input_ids[0])  # step N + 1's forward, queued behind it
    got = fm.resolve_seq_lens_cpu(idx)
    running = not queued.is_ready()
    assert got.tolist() == [3, 4, 5, 6]
    assert running is needs
    queued.block_until_ready()


def test_needs_cpu_seq_lens_is_a_bool() -> None:
    """A clear error for anything else."""
    with pytest.raises(fj.FutureMapError, match="needs_cpu_seq_lens must be a bool"):
        fj.FutureMap(8, needs_cpu_seq_lens="no")  # type: ignore[arg-type]


def test_a_host_array_reused_after_publish_does_not_change_the_read() -> None:
    """The host lengths and slots a publish was given are kept as copies: an engine that
    refills its own arrays for the next batch does not change what the read returns."""
    fm = make(True)
    idx, lens = a(3, 5, 7, 9), a(4, 5, 6, 7)
    fm.publish(idx, lens)
    lens[:] = 99
    assert fm.resolve_seq_lens_cpu(a(3, 5, 7, 9)).tolist() == [4, 5, 6, 7]
    idx[:] = a(1, 2, 4, 6)
    assert fm.resolve_seq_lens_cpu(a(1, 2, 4, 6)).tolist() == [0, 0, 0, 0]
