"""Buckets (fm_jax/host/buckets.py): the sizes a call is padded to, and a map whose batch
buckets skip a token bucket serving a traced DECODE from them."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

import fm_jax as fj
from fm_jax.host.buckets import resolve_sizes

D = fj.ForwardMode.DECODE


def host(x: Any) -> list[Any]:
    return np.asarray(x).tolist()  # type: ignore[no-any-return]


def test_buckets_that_skip_a_token_bucket_still_serve_a_traced_decode() -> None:
    """Defect (found beside reliability round two): with batch buckets (4, 8, 32) and token
    buckets (4, 16, 64), 16 tokens paired with 32 rows, so a gather warm-up with traced
    modes failed (a DECODE gathers one id per row: T >= B) and so did serving such a batch.
    Tokens now go up to the bucket that holds the rows: warm-up and a traced DECODE of 10
    rows run, the DECODE from the warmed executables."""
    assert resolve_sizes(10, 10, (4, 8, 32), (4, 16, 64)) == (32, 64)
    assert resolve_sizes(3, 3, (4, 8, 32), (4, 16, 64)) == (4, 4)
    fm = fj.FutureMap(64, protocol="gather", batch_buckets=(4, 8, 32), token_buckets=(4, 16, 64))
    fm.warm_up(guard=True)
    idx = np.arange(1, 11, dtype=np.int32)
    fm.publish(idx, idx)
    fm.stash(idx, idx + 100)
    out = fm.resolve(fj.Batch(jnp.int32(D), idx, np.zeros(10, np.int32), idx))
    assert host(out.input_ids)[:10] == (idx + 100).tolist()
