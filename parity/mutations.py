"""Deliberately broken FutureMap variants, to show that the suite catches them.

Each variant wraps a twin (parity.twin.Twin) and breaks one thing in how the FutureMap
behaves as the engine sees it; everything else passes through. They apply to either
framework alike, so the same bug can be put into fm_jax alone (parity must see it) or
into both twins (then only the oracle or the debug checks can).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from parity.host_batch import MODE, HostBatch
from parity.scenario import Kind
from parity.twin import ResolvedOut, Twin


class Mutant:
    """A twin with one op broken; every other attribute is the wrapped twin's."""

    def __init__(self, inner: Twin) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SkipStash(Mutant):
    """Every third non-empty stash is dropped: the slot keeps its previous (read) token."""

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        self.calls = 0

    def stash(self, slots: np.ndarray, payload: Any) -> None:
        if len(slots):
            self.calls += 1
            if self.calls % 3 == 0:
                return
        self.inner.stash(slots, payload)


class StashTwice(Mutant):
    """Every stash is issued twice: again, one step late, right after the next stash.

    The late copy overwrites the fresh tokens of slots that ran in both steps.
    """

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        self.previous: tuple[np.ndarray, Any] | None = None

    def stash(self, slots: np.ndarray, payload: Any) -> None:
        self.inner.stash(slots, payload)
        if self.previous is not None:
            self.inner.stash(*self.previous)
        if len(slots):
            self.previous = (slots, payload)


class PublishWithoutPlusOne(Mutant):
    """publish writes the lengths one short (seq_lens instead of seq_lens + 1)."""

    def publish(self, slots: np.ndarray, lens: Any) -> None:
        self.inner.publish(slots, lens - 1)


class SentinelOffByOne(Mutant):
    """invalidate leaves -(slot + 1) instead of -slot in live rows."""

    def invalidate(self, hb: HostBatch, res: ResolvedOut | None) -> tuple[Any, Any]:
        ids, lens = self.inner.invalidate(hb, res)
        ids, lens = self.inner.host(ids).copy(), self.inner.host(lens).copy()
        live = hb.slots != 0
        ids[live] -= 1
        lens[live] -= 1
        return ids, lens


class StaleSlotAfterReuse(Mutant):
    """A stash into a slot that still holds an unread token is dropped.

    A map that treats an unread slot as still owned: after retirement and reuse, the new
    request's first decode resolves the previous occupant's last token (and after a
    chunked prefill, an intermediate chunk's token). Consume tracking cannot see it: the
    stale value was written and never read.
    """

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        self.unread: set[int] = set()

    def resolve(self, hb: HostBatch) -> ResolvedOut:
        read = hb.live_slots if hb.spec_decode else -hb.input_ids[hb.input_ids < 0]
        self.unread -= set(read.tolist())
        return self.inner.resolve(hb)

    def stash(self, slots: np.ndarray, payload: Any) -> None:
        kept = slots.copy()
        kept[np.isin(slots, list(self.unread)) & (slots != 0)] = 0  # to the padding row
        self.unread |= set(slots[slots != 0].tolist())
        self.inner.stash(kept, payload)


class SkipDecodeRestore(Mutant):
    """resolve skips the DECODE length restore: the batch keeps its length sentinels."""

    def resolve(self, hb: HostBatch) -> ResolvedOut:
        if hb.mode == MODE[Kind.DECODE]:
            hb = dataclasses.replace(hb, mode=MODE[Kind.EXTEND])
        return self.inner.resolve(hb)


MUTATIONS: dict[str, type[Mutant]] = {
    "skip_stash": SkipStash,
    "stash_twice": StashTwice,
    "publish_without_plus_one": PublishWithoutPlusOne,
    "sentinel_off_by_one": SentinelOffByOne,
    "stale_slot_after_reuse": StaleSlotAfterReuse,
    "skip_decode_restore": SkipDecodeRestore,
}
"""Mutation name -> wrapper class."""
