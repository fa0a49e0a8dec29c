"""The floor: jitted no-ops on the arrays each class call takes (dispatches, no work).

An op is one no-op dispatch on the arrays that op's class call puts on the device; the step
is two, as the class step is two calls: `resolve` (the batch: slots, ids, lengths, and a
spec batch's draft slots) and `finish` (slots, new lengths and the payload). The batch's
forward mode is known on the host (the class fixes it in its executable): no mode array.

`floor` takes jax arrays already on the device; `floor_host` takes the same values as numpy
arrays, which the jitted call's dispatch transfers, as the class's host path does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fm_bench.impls import Op
from fm_bench.impls.jax_common import device_data, int_dtype
from fm_bench.timing import wait_jax
from fm_bench.workload import Config, HostData


# keep_unused: by default jit drops arguments its function does not read, and a dropped
# numpy argument is never transferred: the floor would then not pay the host path's copies.
@functools.partial(jax.jit, keep_unused=True)
def noop(*arrays: Any) -> jax.Array:
    """A jitted call that takes `arrays` (transferring host ones) and does no work."""
    del arrays
    return jnp.zeros((), jnp.int32)


def _run(*calls: tuple[Any, ...]) -> Callable[[], object]:
    """One timed run: a no-op dispatch per argument tuple, then a wait for all of them."""

    def run() -> object:
        return wait_jax([noop(*a) for a in calls])

    return run


def _build(cfg: Config, arrays: Any, ops: Sequence[str]) -> dict[str, Op]:
    a = arrays
    neg = a["neg"]
    payload: tuple[Any, ...] = (a["tokens"],)
    if cfg.spec:
        payload = (a["tokens"], a["topk_p"], a["topk_index"], a["hidden"])
    resolve = (a["idx"], neg, neg, a["idx"]) if cfg.spec else (a["idx"], neg, neg)
    calls: dict[str, list[tuple[Any, ...]]] = {
        "publish": [(a["idx"], a["lens"])],
        "stash": [(a["idx"], a["tokens"])],
        "stash_spec": [(a["idx"], *payload)],
        "resolve_decode": [resolve],
        "resolve_mixed": [(a["idx"], a["mixed_ids"], a["mixed_lens"])],
        "resolve_spec": [resolve],
        "invalidate": [(a["idx"],)],
        "step": [resolve, (a["idx"], a["lens"], *payload)],
    }
    return {op: Op(_run(*calls[op])) for op in ops if op in calls}


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """No-op dispatches on device arrays: one per op, two for the step (the sentinel
    protocol's arrays: no gather variant)."""
    if debug or cfg.gather:
        return {}
    dd = device_data(cfg, data)
    arrays = dd._asdict()
    arrays["neg"] = jax.device_put(-data.idx.astype(int_dtype(cfg)), jax.devices()[0])
    return _build(cfg, arrays, ops)


def build_host(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """The same dispatches on numpy arrays (each call transfers its inputs; sentinel only)."""
    if debug or cfg.gather:
        return {}
    dt = int_dtype(cfg)
    arrays: dict[str, np.ndarray] = {
        k: getattr(data, k).astype(dt)
        for k in ("idx", "tokens", "lens", "mixed_ids", "mixed_lens", "topk_index")
    }
    arrays["neg"] = -arrays["idx"]
    arrays["topk_p"] = data.topk_p
    arrays["hidden"] = data.hidden.astype(jnp.dtype(cfg.hidden_dtype))
    return _build(cfg, arrays, ops)
