"""One rule for bad gather-protocol input: each bad input through the fm_jax class, its pure
ops (where tracing sees it) and fm_torch, refused alike with a FutureMapError naming the
field, every buffer byte-identical afterwards, each map still working.

fm_jax names a MIXED batch's running rows per token (`token_slots`), fm_torch per row as
SGLang does (`mix_running_indices`): the same batch in each twin's layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
import torch

import fm_jax as fj
import fm_torch as ft

R = 8
D, E, M = fj.ForwardMode.DECODE, fj.ForwardMode.EXTEND, fj.ForwardMode.MIXED


def a(*x: int) -> np.ndarray:
    return np.array(x, np.int64)


def t(*x: int) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


# name -> (what the twins' refusals name, the jax call, the torch call, traced by the ops)
Case = tuple[str, Callable[[Any], Any], Callable[[Any], Any], bool]
CASES: dict[str, Case] = {
    "negative prefill id": (
        "input_ids",
        lambda fm: fm.resolve(fj.Batch(E, a(3), a(7, -3), a(2))),
        lambda fm: fm.resolve(ft.ScheduleBatch(ft.ForwardMode.EXTEND, t(3), t(7, -3), t(2))),
        False,
    ),
    "ids given to a DECODE batch": (
        "input_ids given for a DECODE batch",
        lambda fm: fm.resolve(fj.Batch(D, a(3), a(30), a(5))),
        lambda fm: fm.resolve(ft.ScheduleBatch(ft.ForwardMode.DECODE, t(3), t(30), t(5))),
        False,
    ),
    "MIXED without running slots": (
        "MIXED",
        lambda fm: fm.resolve(fj.Batch(M, a(2, 3), a(9, 0), a(1, 5))),
        lambda fm: fm.resolve(ft.ScheduleBatch(ft.ForwardMode.MIXED, t(2, 3), t(9), t(1, 5))),
        True,
    ),
    "running slots on a DECODE batch": (
        "DECODE",
        lambda fm: fm.resolve(fj.Batch(D, a(3), None, a(5), token_slots=a(3))),
        lambda fm: fm.resolve(
            ft.ScheduleBatch(ft.ForwardMode.DECODE, t(3), None, t(5), None, t(3))
        ),
        True,
    ),
    "a running slot out of range": (
        "slot",
        lambda fm: fm.resolve(fj.Batch(M, a(2, 3), a(9, 0), a(1, 5), token_slots=a(0, R))),
        lambda fm: fm.resolve(
            ft.ScheduleBatch(ft.ForwardMode.MIXED, t(2, 3), t(9), t(1, 5), None, t(R))
        ),
        False,
    ),
    "a running slot twice": (
        "more than once",
        lambda fm: fm.resolve(fj.Batch(M, a(2, 3), a(9, 0, 0), a(1, 5), token_slots=a(0, 3, 3))),
        lambda fm: fm.resolve(
            ft.ScheduleBatch(ft.ForwardMode.MIXED, t(2, 3), t(9), t(1, 5), None, t(3, 3))
        ),
        False,
    ),
    "invalidate": (
        "no sentinels",
        lambda fm: fm.invalidate(fj.Batch(D, a(3), None, a(1)), a(3)),
        lambda fm: fm.invalidate(ft.ScheduleBatch(ft.ForwardMode.DECODE, t(3), None, t(1)), t(3)),
        True,
    ),
}


def primed_jax() -> fj.FutureMap:
    fm = fj.FutureMap(R, protocol="gather", debug=True)
    fm.publish(a(3, 5), a(4, 6))
    fm.stash(a(3, 5), a(30, 50))
    return fm


def primed_torch() -> ft.FutureMap:
    fm = ft.FutureMap(R, protocol="gather", debug=True)
    fm.publish(t(3, 5), t(4, 6))
    fm.stash(t(3, 5), t(30, 50))
    return fm


def raw_jax(fm: fj.FutureMap) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(fm.state)]


def raw_torch(fm: ft.FutureMap) -> list[bytes]:
    return [x.numpy().tobytes() for x in (fm.output_tokens, fm.new_seq_lens)]


def refusal(call: Callable[[Any], Any], fm: Any) -> str:
    with pytest.raises((fj.FutureMapError, ft.FutureMapError)) as err:
        call(fm)
    return str(err.value)


@pytest.mark.parametrize("name", sorted(CASES))
def test_both_twins_refuse_alike_and_keep_every_byte(name: str) -> None:
    """Both twins refuse the bad input naming the same thing, write nothing, and resolve
    the next good DECODE batch to the same ids."""
    what, jax_call, torch_call, _ = CASES[name]
    jm, tm = primed_jax(), primed_torch()
    jb, tb = raw_jax(jm), raw_torch(tm)
    assert what.lower() in refusal(jax_call, jm).lower()
    assert what.lower() in refusal(torch_call, tm).lower()
    assert raw_jax(jm) == jb and raw_torch(tm) == tb
    got = jm.resolve(fj.Batch(D, a(3, 5), None, a(5, 7)))
    batch = ft.ScheduleBatch(ft.ForwardMode.DECODE, t(3, 5), None, t(5, 7))
    tm.resolve(batch)
    assert batch.input_ids is not None
    assert np.asarray(got.input_ids)[:2].tolist() == batch.input_ids.tolist() == [30, 50]
    jm.check()


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[3]))
def test_the_pure_ops_refuse_what_tracing_sees(name: str) -> None:
    """The pure ops refuse the same input when it is visible at trace time (the forward
    mode known on the host, which fields are given)."""
    what, jax_call, _, _ = CASES[name]
    ops = fj.future_map(R, protocol="gather", debug=True)

    class Pure:
        """The class's call surface over the pure ops (what the case calls)."""

        def resolve(self, batch: fj.Batch) -> Any:
            b = jax.tree_util.tree_map(lambda x: np.asarray(x, np.int32), batch)
            b = b._replace(forward_mode=batch.forward_mode)
            return ops.resolve(ops.init(), b)

        def invalidate(self, batch: fj.Batch, indices: Any) -> Any:
            return ops.invalidate(batch, indices)

    assert what.lower() in refusal(jax_call, Pure()).lower()
