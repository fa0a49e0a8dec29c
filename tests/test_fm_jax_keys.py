"""The executables' key (fm_jax/host/keys.py): warm-up, the class's calls and the serving
guard key executables by one typed key."""

from __future__ import annotations

import numpy as np
import pytest

import fm_jax as fj
from fm_jax.host.keys import Key


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_warm_up_and_serving_key_executables_by_one_typed_key(protocol: str) -> None:
    """Warm-up plans, the class's calls and the serving guard share one key type
    (`keys.Key`): every planned key is one, and after a guarded warm-up each op of a
    serving loop finds its executable under the key the call builds (a key built apart,
    e.g. a bare tuple, would find nothing and be refused)."""
    fm = fj.FutureMap(8, batch_buckets=(2,), token_buckets=(4,), protocol=protocol)
    fm.warm_up(guard=True)
    serving = fm._registry._serving
    assert serving is not None and all(type(k) is Key for k, _ in serving)
    slots = np.array([1, 2], np.int32)
    ids = None if protocol == "gather" else -slots
    fm.publish(slots, np.array([3, 4], np.int32))
    fm.stash(slots, np.array([5, 6], np.int32))
    fm.resolve(fj.Batch(fj.ForwardMode.DECODE, slots, ids, np.array([3, 4], np.int32)))
    assert (Key("publish", 2), None) in serving and (("publish", 2), None) not in serving
