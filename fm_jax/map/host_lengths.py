"""The last published lengths on their way to the host, so reading them waits for the
publishing step only.

`resolve_seq_lens_cpu(indices)` used to gather `new_seq_lens[indices]` on the device and
fetch it: a sync behind everything queued before it, the next forward included when the
engine had already enqueued it. SGLang instead copies the published lengths to the host on
a side stream, into pinned memory, gated on the publish; the scheduler then waits for the
publishing step alone (its #29556 took a 2.1 ms DFlash verify wait out that way). Here the
publish starts the same copy (`jax.Array.copy_to_host_async`: a host copy in flight, not a
wait) and keeps it with the slots it was published at; a later read of exactly those slots
takes the copy, waiting only for the computation that produced the lengths. A publish given
host lengths needs no device-to-host copy: it keeps a host copy of them (the caller may refill
its arrays for the next batch). Only the most recent publish is kept:
a read of other slots, or after another publish, gathers from the buffer as before.

Device lengths given to `publish` or `finish` are the caller's array: the copy is started
on it, and the caller may donate or delete it after the call. The copy is then gone with it
(JAX drops a deleted array's host value), so the read gathers from the map's buffer, which
holds the same lengths: the map's answer never depends on the caller's array living on.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.host.host_inputs import Rows


class _Published(NamedTuple):
    idx: Rows  # the slots, as placed (host: padded; a jax array: taken as given)
    lens: Any  # the lengths, placed like idx: a host array, or a jax array copying to host


class HostLengths:
    """The most recent publish's lengths (one map; single process)."""

    def __init__(self) -> None:
        self._last: _Published | None = None

    def published(self, idx: Rows, lens: Any) -> None:
        """A publish wrote `lens` at `idx` (both as placed): keep them, a device array with
        its host copy started."""
        if isinstance(lens, jax.Array):
            lens.copy_to_host_async()
        else:  # the caller's own array may be reused for the next batch: keep a copy
            lens = np.array(lens)
        if idx.counts is not None:
            idx = idx._replace(array=np.array(idx.array))
        self._last = _Published(idx, lens)

    def forget(self) -> None:
        """The buffer may no longer hold what was last published (a debug resolve
        consumed it): the next read gathers from the buffer."""
        self._last = None

    def read(self, idx: Rows, subset: bool = False) -> np.ndarray | None:
        """The lengths last published at exactly the slots `idx` (as placed, padded), or
        None when the last publish was at other slots (or there was none). `subset`: host
        slots each among the last publish's (of its rank) do too."""
        last = self._last
        if subset and last is not None and idx.counts is not None:
            return self._among(last, idx)
        if last is None or last.idx.size != idx.size:
            return None
        if idx.counts is None or last.idx.counts is None:  # jax slots: not read, same array
            same = idx.array is last.idx.array
        else:
            same = idx.counts == last.idx.counts and np.array_equal(idx.array, last.idx.array)
        if not same or (isinstance(last.lens, jax.Array) and last.lens.is_deleted()):
            return None  # other slots, or the caller's array donated since: the buffer
        return np.asarray(last.lens)

    @staticmethod
    def _among(last: _Published, idx: Rows) -> np.ndarray | None:
        """Host slots `idx` looked up, rank by rank, among the live slots of `last` (host
        slots too); None when one is not there or the lengths were donated since."""
        counts = last.idx.counts
        if counts is None or idx.counts is None:
            return None
        if isinstance(last.lens, jax.Array) and last.lens.is_deleted():
            return None
        have, lens = np.asarray(last.idx.array), np.asarray(last.lens)
        want = np.asarray(idx.array)
        out = np.zeros(want.shape, lens.dtype)
        s0, s1 = last.idx.size, idx.size
        for d, (n0, n1) in enumerate(zip(counts, idx.counts, strict=True)):
            if not n1:
                continue
            if not n0:
                return None
            slots, got = have[d * s0 : d * s0 + n0], lens[d * s0 : d * s0 + n0]
            w = want[d * s1 : d * s1 + n1]
            order = np.argsort(slots, kind="stable")
            at = np.clip(np.searchsorted(slots, w, sorter=order), 0, n0 - 1)
            if not np.array_equal(slots[order[at]], w):
                return None
            out[d * s1 : d * s1 + n1] = got[order[at]]
        return out
