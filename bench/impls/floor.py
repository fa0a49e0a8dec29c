"""The floor: a jitted no-op on the op's batch arrays (one dispatch, no work)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from bench.impls import Op
from bench.impls.jax_common import device_data
from bench.workload import Config, HostData


@jax.jit
def _noop(*arrays: Any) -> jax.Array:
    del arrays
    return jnp.zeros((), jnp.int32)


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """One no-op dispatch per op, taking the arrays that op takes."""
    if debug:
        return {}
    dd = device_data(cfg, data)
    args = {
        "publish": (dd.idx, dd.lens),
        "stash": (dd.idx, dd.tokens),
        "stash_spec": (dd.idx, dd.tokens, dd.topk_p, dd.topk_index, dd.hidden),
        "resolve_decode": (dd.decode_mode, dd.idx, dd.idx, dd.idx),
        "resolve_mixed": (dd.mixed_mode, dd.idx, dd.mixed_ids, dd.mixed_lens),
        "resolve_spec": (dd.decode_mode, dd.idx, dd.idx, dd.idx, dd.idx),
        "invalidate": (dd.idx, dd.idx, dd.idx),
        "step": (dd.decode_mode, dd.idx, dd.idx, dd.idx, dd.lens, dd.tokens),
    }
    return {op: Op(lambda a=args[op]: jax.block_until_ready(_noop(*a))) for op in ops if op in args}
