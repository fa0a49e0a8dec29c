"""The one-row path (fm_jax/ops/rows.py): a batch of one row (a static shape; the default
buckets start at 1) compiles to a dynamic slice or a select and dynamic-update-slice, not a
gather or a scatter (XLA's simplifiers rewrite a one-index gather or scatter so), with the
bytes of the contract's rule at every slot, out-of-range ones included: a write drops, a
read clips (a plain dynamic-update-slice would clamp a write into slot 0 or R-1)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fm_jax as fj
from fm_jax.ops.rows import gather, scatter

R = 5
SLOTS = [0, 1, R - 1, R, R + 7, -1, -R, np.iinfo(np.int32).min]


def _bytes(x: object) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def _bufs() -> list[jax.Array]:
    """An int buffer, and float rows whose bits hold NaN payloads and -0.0."""
    bits = np.arange(R * 3, dtype=np.uint32).reshape(R, 3) | np.uint32(0x7FC00000)
    bits[2, 1] = 0x80000000  # -0.0
    return [jnp.arange(R, dtype=jnp.int32) * 10, jnp.asarray(bits.view(np.float32))]


@pytest.mark.parametrize("slot", SLOTS)
def test_one_row_moves_the_bytes_of_the_general_path(slot: int) -> None:
    """The same bytes as numpy's rule: a write to a slot out of [0, R) changes nothing, a
    read clips to [0, R)."""
    idx = jnp.array([slot], jnp.int32)
    for buf in _bufs():
        host = np.asarray(buf)
        row = np.full((1, *host.shape[1:]), 7, host.dtype)
        if host.dtype == np.float32:
            row.view(np.uint32)[...] = 0x7FC0ABCD  # a NaN payload
        want = host.copy()
        if 0 <= slot < R:
            want[slot] = row[0]
        got = jax.jit(scatter)(buf, idx, jnp.asarray(row))
        assert _bytes(got) == _bytes(want)
        read = jax.jit(gather)(buf, idx)
        assert _bytes(read) == _bytes(host[[min(max(slot, 0), R - 1)]])


def _ops_hlo(debug: bool, protocol: str, spec: fj.SpecConfig | None) -> str:
    """The compiled HLO of publish, stash and a DECODE resolve of one row (slots passed
    in, not constants XLA could fold; the state donated)."""
    ops = fj.future_map(R, debug=debug, protocol=protocol, spec=spec)

    def payload(i: jax.Array) -> object:
        if spec is None:
            return i
        return fj.DraftPayload(i, jnp.ones((1, 2), jnp.float32), jnp.ones((1, 2), jnp.int32))

    def batch(i: jax.Array) -> fj.Batch:
        b = fj.Batch(fj.ForwardMode.DECODE, i, -i, -i)
        return b if spec is None else b._replace(draft_indices=i)

    fns = [
        lambda s, i: ops.publish(s, i, i + 3),
        lambda s, i: ops.stash(s, i, payload(i)),
        lambda s, i: ops.resolve(s, batch(i)),
    ]
    if debug:
        from jax.experimental import checkify

        fns = [checkify.checkify(f) for f in fns]
    one = jnp.array([2], jnp.int32)
    return "".join(
        jax.jit(f, donate_argnums=0).lower(ops.init(), one).compile().as_text() or "" for f in fns
    )


@pytest.mark.parametrize(
    ("debug", "protocol", "spec"),
    [
        (False, "sentinel", None),
        (False, "gather", fj.SpecConfig(2)),
        (True, "sentinel", None),
    ],
)
def test_one_row_compiles_to_no_gather_or_scatter(debug: bool, protocol: str, spec: object) -> None:
    """Publish, stash and resolve of a one-row batch compile to slices, not gathers or
    scatters, spec fields with kernel='xla' included (a debug resolve's consume poison
    writes the batch's slot and the slot its sentinel read: that one scatters)."""
    hlo = _ops_hlo(debug, protocol, spec)  # type: ignore[arg-type]
    assert re.findall(r"\bgather\(", hlo) == []
    assert len(re.findall(r"\bscatter\(", hlo)) == (1 if debug else 0)
    assert "dynamic-update-slice(" in hlo
