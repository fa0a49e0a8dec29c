"""Value checks on host (numpy) slot arrays: free on the host, so always on."""

from __future__ import annotations

import numpy as np

from fm_jax._src.errors import FutureMapError


def check_host_slots(name: str, a: np.ndarray, pool_size: int, where: str = "") -> None:
    """Raise FutureMapError unless every slot of 1-D int `a` is in [0, pool_size) and no live
    slot (>= 1) appears twice. `where` qualifies the pool in messages (e.g. "the rank's")."""
    bad = a[(a < 0) | (a >= pool_size)]
    pool = f"{where} pool " if where else ""
    if bad.size:
        raise FutureMapError(f"{name} holds slots {bad.tolist()} outside {pool}[0, {pool_size})")
    uniq, counts = np.unique(a[a != 0], return_counts=True)
    if (counts > 1).any():
        raise FutureMapError(
            f"{name} holds live slots {uniq[counts > 1].tolist()} more than once in one batch"
        )
