"""The floor: jitted no-ops on the arrays each class call takes (dispatches, no work).

An op is one no-op dispatch on the arrays that op's class call puts on the device; the step
is two, as the class step is two calls: `resolve` (the batch: slots, ids, lengths, and a
spec batch's draft slots) and `finish` (slots, new lengths and the payload). The batch's
forward mode is known on the host (the class fixes it in its executable): no mode array.

`floor` takes jax arrays already on the device; `floor_host` takes the same values as numpy
arrays, which the jitted call's dispatch transfers, as the class's host path does.

`floor_state` is `floor` with the state the class's calls carry: each no-op also takes the
map's buffers (an array pytree like `fm_jax`'s state, on the device), the head's reading
them, the tail's donating them and getting them back, as a map's resolve and finish must.
What a dispatch costs the host grows with the arguments and outputs it carries, so this is
the floor of any implementation that keeps its buffers in JAX arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax as fj
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


@functools.partial(jax.jit, keep_unused=True)
def noop_read(state: Any, *arrays: Any) -> jax.Array:
    """A jitted call that takes the state and `arrays` and does no work (a head)."""
    del state, arrays
    return jnp.zeros((), jnp.int32)


@functools.partial(jax.jit, keep_unused=True, donate_argnums=0)
def noop_write(state: Any, *arrays: Any) -> tuple[Any, jax.Array]:
    """A jitted call that takes the state donated and `arrays`, and gives the state back
    unchanged (a tail: its buffers alias, nothing is copied)."""
    del arrays
    return state, jnp.zeros((), jnp.int32)


def _run(*calls: tuple[Any, ...]) -> Callable[[], object]:
    """One timed run: a no-op dispatch per argument tuple, then a wait for all of them."""

    def run() -> object:
        return wait_jax([noop(*a) for a in calls])

    return run


def _run_with_state(state: dict[str, Any], *calls: tuple[bool, tuple[Any, ...]]) -> Any:
    """One timed run: per (writes, arguments) a no-op taking the state (donated and given
    back where it `writes`), then a wait for all of them."""

    def run() -> object:
        out = []
        for writes, args in calls:
            if writes:
                state["s"], done = noop_write(state["s"], *args)
            else:
                done = noop_read(state["s"], *args)
            out.append(done)
        return wait_jax(out)

    return run


def _calls(cfg: Config, a: Any) -> dict[str, list[tuple[Any, ...]]]:
    """Per op, the argument tuples of its dispatches (the step: the head's, the tail's)."""
    neg = a["neg"]
    payload: tuple[Any, ...] = (a["tokens"],)
    if cfg.spec:
        payload = (a["tokens"], a["topk_p"], a["topk_index"], a["hidden"])
    resolve = (a["idx"], neg, neg, a["idx"]) if cfg.spec else (a["idx"], neg, neg)
    return {
        "publish": [(a["idx"], a["lens"])],
        "stash": [(a["idx"], a["tokens"])],
        "stash_spec": [(a["idx"], *payload)],
        "resolve_decode": [resolve],
        "resolve_mixed": [(a["idx"], a["mixed_ids"], a["mixed_lens"])],
        "resolve_spec": [resolve],
        "invalidate": [(a["idx"],)],
        "step": [resolve, (a["idx"], a["lens"], *payload)],
    }


def _build(cfg: Config, arrays: Any, ops: Sequence[str]) -> dict[str, Op]:
    calls = _calls(cfg, arrays)
    return {op: Op(_run(*calls[op])) for op in ops if op in calls}


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """No-op dispatches on device arrays: one per op, two for the step (the sentinel
    protocol's arrays: no gather variant)."""
    if debug or cfg.gather:
        return {}
    return _build(cfg, _on_device(cfg, data), ops)


def _on_device(cfg: Config, data: HostData) -> dict[str, Any]:
    """The workload's arrays on the device, and the decode rows' sentinels `-idx`."""
    arrays = device_data(cfg, data)._asdict()
    arrays["neg"] = jax.device_put(-data.idx.astype(int_dtype(cfg)), jax.devices()[0])
    return arrays


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


def build_state(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """`build`'s dispatches, each also taking the map's state (sentinel only): the heads
    (resolve) read it, the tails (publish, stash, the step's finish) donate it and get it
    back; invalidate takes none (as the class's)."""
    if debug or cfg.gather:
        return {}
    spec = fj.SpecConfig(cfg.topk, cfg.hidden, jnp.dtype(cfg.hidden_dtype)) if cfg.spec else None
    state = {"s": fj.future_map(cfg.pool, dtype=int_dtype(cfg), spec=spec).init()}
    calls = _calls(cfg, _on_device(cfg, data))
    heads = {"resolve_decode", "resolve_mixed", "resolve_spec"}
    out: dict[str, Op] = {}
    for op in ops:
        if op not in calls:
            continue
        if op == "step":
            head, tail = calls[op]
            out[op] = Op(_run_with_state(state, (False, head), (True, tail)))
        elif op == "invalidate":  # the sentinels of slots: no state, as the class's
            out[op] = Op(_run(*calls[op]))
        else:
            out[op] = Op(_run_with_state(state, *((op not in heads, c) for c in calls[op])))
    return out
