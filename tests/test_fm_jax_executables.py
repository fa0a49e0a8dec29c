"""compiler_options: FutureMap executables keep batch-sized ops on the calling thread (CPU)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fm_jax as fj
from fm_jax.map.executables import CPU_PARALLEL_TASK_PASS

SPLIT = "outer_dimension_partitions"  # XLA:CPU marks an instruction split over threads
POOL = 1 << 18  # 1 MB int32 buffers: XLA:CPU splits their gathers/scatters by default
B = 256

cpu_only = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the parallel task assigner is an XLA:CPU pass"
)


def test_cpu_options_disable_the_parallel_task_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert fj.compiler_options("cpu") == {"xla_disable_hlo_passes": CPU_PARALLEL_TASK_PASS}
    assert fj.compiler_options("gpu") == {}
    assert fj.compiler_options("tpu") == {}


def test_options_keep_the_passes_xla_flags_disables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_disable_hlo_passes=foo,bar")
    got = fj.compiler_options("cpu")["xla_disable_hlo_passes"].split(",")
    assert got == ["foo", "bar", CPU_PARALLEL_TASK_PASS]


def _class_args(fm: fj.FutureMap) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    idx = jnp.arange(1, B + 1, dtype=jnp.int32)
    batch = fj.Batch(None, idx, -idx, -idx)
    ex = fm.executables()
    return {
        "publish": (ex["publish"], (fm.state, idx, idx)),
        "stash": (ex["stash"], (fm.state, idx, idx)),
        "resolve DECODE": (ex["resolve_fixed_decode"], (fm.state, batch)),
        "resolve traced": (ex["resolve"], (fm.state, batch._replace(forward_mode=jnp.int32(1)))),
        "finish": (ex["finish"], (fm.state, idx, idx, idx)),
    }


@cpu_only
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_class_ops_are_not_split_over_threads_at_a_large_pool(debug: bool) -> None:
    fm = fj.FutureMap(POOL, debug=debug)
    for name, (fn, args) in _class_args(fm).items():
        hlo = fn.lower(*args).compile().as_text()
        assert SPLIT not in hlo, f"{name} is split over threads"


@cpu_only
def test_without_the_options_xla_splits_the_same_ops() -> None:
    # The control: at this pool size the default compile does split (else the test above
    # would pass for nothing).
    ops = fj.future_map(POOL)
    idx = jnp.arange(1, B + 1, dtype=jnp.int32)
    state = ops.init()
    for fn, args in (
        (ops.publish, (state, idx, idx)),
        (lambda s, b: ops.resolve(s, b)[1], (state, fj.Batch(1, idx, -idx, -idx))),
    ):
        hlo = jax.jit(fn).lower(*args).compile().as_text()
        assert SPLIT in hlo


@cpu_only
def test_an_engine_step_jitted_with_the_options_is_not_split() -> None:
    # A minimal engine step around the ops: resolve, publish and stash of values computed
    # from what was resolved (as a model's outputs are), invalidate.
    ops = fj.future_map(POOL)

    def step(state: fj.FutureMapState, batch: fj.Batch) -> Any:
        state, res = ops.resolve(state, batch)
        idx = batch.req_pool_indices
        state = ops.publish(state, idx, res.seq_lens + 1)
        state = ops.stash(state, idx, res.input_ids + 1)
        return state, ops.invalidate(batch, idx)

    idx = jnp.asarray(np.arange(1, B + 1, dtype=np.int32))
    batch = fj.Batch(jnp.int32(1), idx, -idx, -idx)
    jitted = jax.jit(step, donate_argnums=(0,), compiler_options=fj.compiler_options())
    hlo = jitted.lower(ops.init(), batch).compile().as_text()
    assert SPLIT not in hlo
    assert "input_output_alias" in hlo
