"""Placement (fm_jax/host/place.py): what a map remembers of the layouts it has placed."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import fm_jax as fj
from fm_jax.host import place

E = fj.ForwardMode.EXTEND


def _batch(n: int) -> fj.Batch:
    a = np.arange(1, n + 1, dtype=np.int32)
    return fj.Batch(E, a, a, a)


def test_a_map_remembers_at_most_max_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layout placed is remembered until MAX_LAYOUTS are; a layout past that is decided
    at each of its calls (placed alike), and a layout already remembered stays."""
    monkeypatch.setattr(place, "MAX_LAYOUTS", 2)
    fm = fj.FutureMap(16, batch_buckets=(1, 2, 4), token_buckets=(1, 2, 4))
    placement = fm._placement
    first = [placement.resolve(_batch(n)) for n in (1, 2, 3)]
    assert len(placement._decided) == 2
    again = [placement.resolve(_batch(n)) for n in (1, 2, 3)]
    assert len(placement._decided) == 2
    for p, q in zip(first, again, strict=True):
        assert p.key == q.key
        leaves = [jax.tree_util.tree_leaves(x.args) for x in (p, q)]
        assert leaves[0]
        assert [[np.asarray(a).tobytes() for a in xs] for xs in leaves] == [
            [np.asarray(a).tobytes() for a in leaves[0]]
        ] * 2
