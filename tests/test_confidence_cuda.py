"""The confidence relay on a GPU: a ring read whose copy is not done yet returns None at
once, without waiting for the device (docs/CONTRACT.md, 'The confidence relay').

Each case queues a long computation (a chain of large matmuls, well over 20 ms) before a
publish with confidence, publishes once more, and reads the entry of the first publish
(two back) right away: the copy cannot be done, the read must say None within a host-time
bound far below the computation, and a waiting read then gives the rows. The host time of
the early read is printed (the GPU checklist's figure: run with -s).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"
NO_JAX_GPU = "needs a GPU for JAX (jax.devices('gpu') finds none on this machine)"
pytestmark = pytest.mark.cuda

R, GAMMA = 64, 4
EARLY_READ_S = 0.005  # far below the queued work; a read that waited would take it all


def _jax_gpu():
    import jax

    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


def test_fm_jax_read_with_the_copy_not_done_returns_none_at_once():
    device = _jax_gpu()
    if device is None:
        pytest.skip(NO_JAX_GPU)
    import jax
    import jax.numpy as jnp

    import fm_jax

    fm = fm_jax.FutureMap(
        R,
        spec=fm_jax.SpecConfig(topk=1, confidence=GAMMA),
        batch_buckets=(2,),
        token_buckets=(2,),
        device=device,
    )
    gen = np.zeros(R, np.int64)
    slots = np.array([1, 2])

    @jax.jit
    def slow_rows(x: jax.Array) -> jax.Array:
        def body(_: int, a: jax.Array) -> jax.Array:
            return jnp.tanh(a @ a)

        a = jax.lax.fori_loop(0, 400, body, x)
        return jnp.broadcast_to(a[0, :GAMMA], (2, GAMMA)).astype(jnp.float32)

    x = jax.device_put(jnp.full((4096, 4096), 1e-3, jnp.float32), device)
    jax.block_until_ready(slow_rows(x))  # compiled
    # Every publish takes device rows (one executable, compiled by the first).
    quick = jax.device_put(np.zeros((2, GAMMA), np.float32), device)
    fm.publish(slots, [3, 4], confidence=quick, generation=gen)
    fm.publish(slots, [3, 4], confidence=quick, generation=gen)
    jax.block_until_ready(fm.state)
    rows = slow_rows(x)  # queued: the first publish below waits for it
    fm.publish(slots, [5, 6], confidence=rows, generation=gen)
    fm.publish(slots, [5, 6], confidence=quick, generation=gen)
    t0 = time.perf_counter()
    early = fm.resolve_confidence_cpu(slots)
    host_s = time.perf_counter() - t0
    print(f"fm_jax: read with the copy not done: {host_s * 1e6:.1f} us host time")
    assert early is None
    assert host_s < EARLY_READ_S
    got = fm.resolve_confidence_cpu(slots, wait=True)
    assert got is not None
    np.testing.assert_array_equal(got.confidence, np.asarray(rows))


def test_fm_torch_read_with_the_copy_not_done_returns_none_at_once():
    import torch

    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    import fm_torch

    dev = torch.device("cuda", torch.cuda.current_device())
    fm = fm_torch.FutureMap(R, device=dev, spec=True, needs_confidence_relay=True)
    gen = torch.zeros(R, dtype=torch.int64)
    slots = torch.tensor([1, 2], device=dev)
    lens = torch.tensor([3, 4], device=dev)
    quick = torch.zeros(2, GAMMA, device=dev)
    x = torch.full((4096, 4096), 1e-3, device=dev)
    with fm.forward_stream():
        fm.publish(slots, lens, confidence=quick, generation=gen)
        fm.publish(slots, lens, confidence=quick, generation=gen)
        # Every kernel launched below while the chain runs was launched once before: with
        # CUDA's lazy module loading a kernel's first launch blocks the host until the
        # device is idle (an H200 ran the whole chain inside the rows' copy, so the ring
        # copy was done by the read).
        x[0, :GAMMA].expand(2, GAMMA).contiguous()
    torch.cuda.synchronize(dev)
    with fm.forward_stream():
        a = x
        for _ in range(200):
            a = torch.tanh(a @ a)
        rows = a[0, :GAMMA].expand(2, GAMMA).contiguous()
        fm.publish(slots, lens, confidence=rows, generation=gen)
        fm.publish(slots, lens, confidence=quick, generation=gen)
    host_slots = torch.tensor([1, 2])
    t0 = time.perf_counter()
    early = fm.resolve_confidence_cpu(host_slots)
    host_s = time.perf_counter() - t0
    print(f"fm_torch: read with the copy not done: {host_s * 1e6:.1f} us host time")
    assert early is None
    assert host_s < EARLY_READ_S
    got = fm.resolve_confidence_cpu(host_slots, wait=True)
    assert got is not None
    assert torch.equal(got.confidence, rows.cpu())
