"""Deliberately broken FutureMap variants, to show that the suite catches them.

Each variant wraps a twin (fm_parity.twin.Twin) and breaks one thing in how the FutureMap
behaves as the engine sees it; everything else passes through. They apply to either
framework alike, so the same bug can be put into fm_jax alone (parity must see it) or
into both twins (then only the oracle or the debug checks can). Each is a mistake of one
relay protocol (docs/CONTRACT.md, 'Two protocols') and is judged under it (`judged_under`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from fm_parity.host_batch import MODE, HostBatch
from fm_parity.scenario import Kind
from fm_parity.twin import ResolvedOut, Sizes, Twin

Slots = Mapping[int, np.ndarray]


class Mutant:
    """A twin with one op broken; every other attribute is the wrapped twin's.

    `judged_under` is the relay protocol whose mistake it makes: the mutation check runs
    it under that protocol only. Its `protocol`, like every other attribute, is the wrapped
    twin's: the driver lays out batches for the map's protocol.
    """

    judged_under = "sentinel"
    # a mistake only debug mode's writes make visible, or one of debug mode's own
    # bookkeeping: judged in debug mode
    debug_only = False

    def __init__(self, inner: Twin) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SkipStash(Mutant):
    """Every third non-empty stash is dropped: the slots keep their previous (read) tokens."""

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        self.calls = 0

    def stash(self, slots: Slots, payload: Mapping[int, Any], sizes: Sizes) -> None:
        if any(len(s) for s in slots.values()):
            self.calls += 1
            if self.calls % 3 == 0:
                return
        self.inner.stash(slots, payload, sizes)


class StashTwice(Mutant):
    """Every stash is issued twice: again, one step late, right after the next stash.

    The late copy overwrites the fresh tokens of slots that ran in both steps.
    """

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        self.previous: tuple[Slots, Mapping[int, Any]] | None = None

    def stash(self, slots: Slots, payload: Mapping[int, Any], sizes: Sizes) -> None:
        self.inner.stash(slots, payload, sizes)
        if self.previous is not None:
            self.inner.stash(*self.previous, sizes)
        busy = {r for r, s in slots.items() if len(s)}
        if busy:
            self.previous = ({r: slots[r] for r in busy}, {r: payload[r] for r in busy})


class PublishWithoutPlusOne(Mutant):
    """publish writes the lengths one short (seq_lens instead of seq_lens + 1)."""

    def publish(self, slots: Slots, lens: Mapping[int, Any], sizes: Sizes, **kw: Any) -> None:
        self.inner.publish(slots, {r: v - 1 for r, v in lens.items()}, sizes, **kw)


class SentinelOffByOne(Mutant):
    """invalidate leaves -(slot + 1) instead of -slot in live rows."""

    def invalidate(
        self, batches: Mapping[int, HostBatch], res: Mapping[int, ResolvedOut], sizes: Sizes
    ) -> dict[int, tuple[Any, Any]]:
        out = {}
        for r, (ids, lens) in self.inner.invalidate(batches, res, sizes).items():
            ids, lens = self.inner.host(ids).copy(), self.inner.host(lens).copy()
            live = np.zeros(len(ids), bool)
            live[: len(batches[r].slots)] = batches[r].slots != 0
            ids[live] -= 1
            lens[live] -= 1
            out[r] = (ids, lens)
        return out


class StaleSlotAfterReuse(Mutant):
    """A stash into a slot that still holds an unread token is dropped.

    A map that treats an unread slot as still owned: after retirement and reuse, the new
    request's first decode resolves the previous occupant's last token (and after a
    chunked prefill, an intermediate chunk's token). Consume tracking cannot see it: the
    stale value was written and never read.
    """

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        self.unread: dict[int, set[int]] = {}

    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]:
        for r, hb in batches.items():
            read = hb.live_slots if hb.spec_decode else -hb.input_ids[hb.input_ids < 0]
            self.unread.setdefault(r, set()).difference_update(read.tolist())
        return self.inner.resolve(batches, sizes)

    def stash(self, slots: Slots, payload: Mapping[int, Any], sizes: Sizes) -> None:
        kept = {}
        for r, s in slots.items():
            unread = self.unread.setdefault(r, set())
            k = s.copy()
            k[np.isin(s, list(unread)) & (s != 0)] = 0  # to the padding row
            unread |= set(s[s != 0].tolist())
            kept[r] = k
        self.inner.stash(kept, payload, sizes)


class SkipDecodeRestore(Mutant):
    """resolve skips the DECODE length restore: the batch keeps its length sentinels."""

    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]:
        extend = MODE[Kind.EXTEND]
        changed = {
            r: dataclasses.replace(hb, mode=extend) if hb.mode == MODE[Kind.DECODE] else hb
            for r, hb in batches.items()
        }
        return self.inner.resolve(changed, sizes)


class MixedGathersWrongRows(Mutant):
    """Gather protocol: a MIXED batch gathers its running rows' tokens at the batch's first
    rows (req_pool_indices[:M], prefill rows among them) instead of the running rows'
    slots."""

    judged_under = "gather"

    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]:
        changed = {
            r: dataclasses.replace(hb, running=hb.slots[: len(hb.running)])
            if hb.mode == MODE[Kind.MIXED]
            else hb
            for r, hb in batches.items()
        }
        return self.inner.resolve(changed, sizes)


class SpecKeepsHostLengths(Mutant):
    """Gather protocol, spec: resolve gathers the draft but not the verified lengths; the
    forward gets the host's seq_lens, which lag a step behind the accepted drafts."""

    judged_under = "gather"

    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]:
        out = self.inner.resolve(batches, sizes)
        for r, res in out.items():
            hb = batches[r]
            if hb.spec_decode:
                out[r] = res._replace(seq_lens=_like(res.seq_lens, hb.seq_lens))
        return out


class MixedSpecKeepsHostLengths(Mutant):
    """Gather protocol, spec MIXED: resolve gathers the running rows' tokens but leaves
    their lengths as the host planned them, before the last verify's accept lengths
    landed (no late binding)."""

    judged_under = "gather"

    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]:
        out = self.inner.resolve(batches, sizes)
        for r, res in out.items():
            hb = batches[r]
            if hb.mode == MODE[Kind.MIXED]:  # a non-spec MIXED batch's are the host's
                out[r] = res._replace(seq_lens=_like(res.seq_lens, hb.seq_lens))
        return out


class SkipStashRows(Mutant):
    """Gather protocol: every second non-empty stash skips its first live row. Its slot
    keeps what it held: the token its last resolve already gathered (debug mode: the
    poison that resolve wrote), or after a prefill the slot's previous value."""

    judged_under = "gather"

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        self.calls = 0

    def stash(self, slots: Slots, payload: Mapping[int, Any], sizes: Sizes) -> None:
        if any(len(s) for s in slots.values()):
            self.calls += 1
            if self.calls % 2 == 0:
                slots = {r: s.copy() for r, s in slots.items()}
                for s in slots.values():
                    s[:1] = 0  # to the padding row (live rows come first)
        self.inner.stash(slots, payload, sizes)


class SkipVerifiedIdStash(Mutant):
    """Spec with verified ids: every second stash of a draft with live rows leaves the
    verified id of its first row whose slot was stashed before as it was (the value last
    stashed there, from this request or the slot's previous one); the bonus token and
    the rest of the draft are written. Relay fields are the same in both protocols
    (docs/CONTRACT.md, 'Relay fields'), so it is a mistake of either: the mutation table
    judges it under the sentinel protocol, the tests under both. Consume tracking cannot
    see it (a non-negative value is in the slot when the next verify reads it); the
    verify hashes the stale id, so the oracle can."""

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        self.calls = 0
        self.stashed: dict[int, dict[int, int]] = {}  # rank -> slot -> verified id held

    def stash(self, slots: Slots, payload: Mapping[int, Any], sizes: Sizes) -> None:
        drafts = {
            r: p
            for r, p in payload.items()
            if getattr(p, "verified_id", None) is not None and (slots[r] != 0).any()
        }
        if drafts:
            self.calls += 1
        changed = dict(payload)
        for r, p in drafts.items():
            held = self.stashed.setdefault(r, {})
            vid = self.inner.host(p.verified_id).copy()
            if self.calls % 2 == 0:
                stale = [i for i, s in enumerate(slots[r].tolist()) if s in held]
                if stale:
                    vid[stale[0]] = held[int(slots[r][stale[0]])]
                    changed[r] = _with_verified_id(p, vid)
            for s, v in zip(slots[r].tolist(), vid.tolist(), strict=False):
                if s != 0:  # slot 0 is padding: what it holds is never read
                    held[s] = v
        self.inner.stash(slots, changed, sizes)


class PartialStashZeroesKeptRows(Mutant):
    """A partial stash writes zeros into the fields its draft leaves out, instead of keeping
    their rows (as a stash that writes every buffer from a payload padded with zeros would):
    the next verify reads zero top-k, hidden states or draft probabilities, and a field no
    stash carried reads as relayed. Relay fields are the same in both protocols: judged
    under the sentinel one."""

    def stash(self, slots: Slots, payload: Mapping[int, Any], sizes: Sizes) -> None:
        spec = getattr(self.inner, "spec", None)
        changed = dict(payload)
        for r, p in payload.items():
            if spec is not None and len(slots[r]) and hasattr(p, "topk_p"):
                changed[r] = _zeros_for_omitted(p, spec, len(slots[r]))
        self.inner.stash(slots, changed, sizes)


def _zeros_for_omitted(payload: Any, spec: Any, rows: int) -> Any:
    """`payload` (either twin's DraftPayload) with every field of the layout `spec` it
    leaves out given as zero host rows."""
    import ml_dtypes

    ints = np.asarray(_host(payload.bonus_tokens)).dtype
    zeros = {
        "topk_p": np.zeros((rows, spec.topk), np.float32),
        "topk_index": np.zeros((rows, spec.topk), ints),
        "hidden_states": np.zeros((rows, spec.hidden), ml_dtypes.bfloat16) if spec.hidden else None,
    }
    kw = {
        k: getattr(payload, k) if getattr(payload, k) is not None else v for k, v in zeros.items()
    }
    extras = dict(payload.extras or {})
    for e in spec.extras:
        if e.name not in extras:
            dtype = np.float32 if e.kind == "f32" else ints
            extras[e.name] = np.zeros((rows, e.width) if e.width else (rows,), dtype)
    if hasattr(payload, "_replace"):  # fm_jax's NamedTuple
        return payload._replace(**kw, extras=extras or None)
    return dataclasses.replace(payload, **kw, extras=extras or None)


def _host(x: Any) -> Any:
    """`x` (a torch tensor or a jax array) as numpy."""
    if type(x).__module__.startswith("torch"):
        return x.cpu().numpy()
    return np.asarray(x)


class HostCopySyncs(Mutant):
    """Gather protocol: resolve reads the lengths it resolved back to the host, as a host
    length copy that was switched off yet still syncs would (the engine never called
    resolve_seq_lens_cpu, so the step must move nothing from the device to the host).
    Every value is as it should be: only the 'sync' check, which watches fm_jax's map ops
    for device-to-host transfers, can catch it (fm_torch's maps read theirs unwatched)."""

    judged_under = "gather"

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        if hasattr(inner, "fm"):  # fm_jax: one map
            inner.fm = _SyncingMap(inner.fm)
        if hasattr(inner, "fms"):  # fm_torch: one map per rank
            inner.fms = {r: _SyncingMap(fm) for r, fm in inner.fms.items()}


class _SyncingMap:
    """A FutureMap whose resolve reads the resolved lengths to the host before it returns
    (fm_jax's come back in its output, fm_torch's in the batch it resolves in place)."""

    def __init__(self, fm: Any) -> None:
        self._fm = fm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fm, name)

    def resolve(self, batch: Any, *args: Any, **kw: Any) -> Any:
        out = self._fm.resolve(batch, *args, **kw)
        lens = getattr(out, "seq_lens", None)
        if lens is None:
            lens = batch.seq_lens
        if type(lens).__module__.startswith("torch"):
            lens.tolist()
        else:
            import jax

            jax.device_get(lens)  # the sync a skipped host copy must not do
        return out


class OneRowAliases(Mutant):
    """A one-row DECODE resolve hands the forward a view of the buffer row instead of a
    copy: the forward reads the row as the resolve left it, which in debug mode is the
    consume poison the resolve wrote back (non-spec: the token; spec: the bonus token).
    Without debug nothing writes the row before the forward reads it: judged in debug."""

    debug_only = True

    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]:
        out = self.inner.resolve(batches, sizes)
        one = [
            r for r, hb in batches.items() if hb.mode == MODE[Kind.DECODE] and len(hb.slots) == 1
        ]
        if not one:
            return out
        bufs = self.inner.buffers({r: () for r in one})
        for r in one:
            slot = int(batches[r].slots[0])
            if slot == 0:
                continue
            row = self.inner.host(bufs[r]["output_tokens"])[slot - 1]  # slots 1..R-1
            res = out[r]
            if res.draft is not None:
                bonus = self.inner.host(res.draft.bonus_tokens).copy()
                bonus[0] = row
                out[r] = res._replace(
                    draft=_with_bonus(res.draft, _like(res.draft.bonus_tokens, bonus))
                )
            else:
                ids = self.inner.host(res.input_ids).copy()
                ids[0] = row
                out[r] = res._replace(input_ids=_like(res.input_ids, ids))
        return out


class OwnedRelayUnwritten(Mutant):
    """With an engine-owned relay, the map skips its publish for lengths the engine never
    wrote (its skip taken on the wrong tensor): every second non-empty publish writes
    nothing, so the next decode restores a step-old length."""

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        self.calls = 0

    def publish(self, slots: Slots, lens: Mapping[int, Any], sizes: Sizes, **kw: Any) -> None:
        if any(len(s) for s in slots.values()):
            self.calls += 1
            if self.calls % 2 == 0:
                return
        self.inner.publish(slots, lens, sizes, **kw)


def _with_bonus(draft: Any, bonus: Any) -> Any:
    """`draft` (either twin's DraftPayload) with bonus tokens `bonus`."""
    if hasattr(draft, "_replace"):  # fm_jax's NamedTuple
        return draft._replace(bonus_tokens=bonus)
    return dataclasses.replace(draft, bonus_tokens=bonus)


class ConfidenceGenerationNotSnapshotted(Mutant):
    """The confidence relay keeps one generation array, the last one published, instead of
    a snapshot per ring entry: a read gives the generations of the last publish with its
    rows of two publishes back, so a row of a slot that went to a new request in between
    reads as the new request's own. The rows are right; the read's generations are not.
    The relay is the same in both protocols: the mutation table judges it under the
    sentinel one. Parity sees it in fm_jax alone; in both twins the oracle does (each
    read's freshness is in the request's stream)."""

    def __init__(self, inner: Twin) -> None:
        super().__init__(inner)
        self.last: dict[int, np.ndarray] = {}

    def publish(self, slots: Slots, lens: Mapping[int, Any], sizes: Sizes, **kw: Any) -> None:
        self.inner.publish(slots, lens, sizes, **kw)
        for r, g in (kw.get("generation") or {}).items():
            self.last[r] = np.array(g)

    def resolve_confidence_cpu(self, slots: Slots) -> dict[int, Any]:
        out = self.inner.resolve_confidence_cpu(slots)
        for r, got in out.items():
            if got is not None:
                out[r] = (got[0], self.last[r][slots[r]])
        return out


class LengthsNotConsumed(Mutant):
    """Debug, spec: a DECODE resolve leaves the verified lengths it read in the buffer
    instead of consuming them (written back as they were read), so a second read with no
    publish between would find a length. Only the buffers show it: parity (debug mode)."""

    debug_only = True

    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]:
        out = self.inner.resolve(batches, sizes)
        read = {r: hb for r, hb in batches.items() if hb.spec_decode}
        if read:
            lens = {
                r: np.where(hb.slots != 0, self.inner.host(out[r].seq_lens), 0).astype(
                    hb.slots.dtype
                )
                for r, hb in read.items()
            }
            self.inner.publish({r: hb.slots for r, hb in read.items()}, lens, sizes)
        return out


class ReadsLengthsTwice(Mutant):
    """resolve_seq_lens_cpu waits for the publish twice per read (as a retry would): the
    second wait has no fresh publish behind it. Every value is as it should be: only the
    debug 'fresh publish' check can see it."""

    debug_only = True

    def resolve_seq_lens_cpu(self, slots: Slots, sizes: Sizes) -> dict[int, np.ndarray]:
        self.inner.resolve_seq_lens_cpu(slots, sizes)
        return self.inner.resolve_seq_lens_cpu(slots, sizes)


class MixedTailsOffByOne(Mutant):
    """Gather protocol, spec MIXED: the host's rebound running rows are one short
    (`seq_lens_cpu` the published length, not + 1; `prefix_lens` one below it), and so is
    what the host learns of their lengths."""

    judged_under = "gather"

    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]:
        out = self.inner.resolve(batches, sizes)
        for r, res in out.items():
            if res.tails is None:
                continue
            seq, total, prefix = (np.array(x, np.int64) for x in res.tails)
            m = len(batches[r].running)
            if m:
                live = np.flatnonzero(batches[r].slots != 0)[-m:]
                seq[live] -= 1
                prefix[live] -= 1
            out[r] = res._replace(tails=(seq, int(total) - m, prefix))
        return out


def _with_verified_id(payload: Any, vid: np.ndarray) -> Any:
    """`payload` (either twin's DraftPayload: a NamedTuple or a dataclass) with host verified
    ids `vid`; both twins take host rows in a stash."""
    if hasattr(payload, "_replace"):  # fm_jax's NamedTuple
        return payload._replace(verified_id=vid)
    return dataclasses.replace(payload, verified_id=vid)


def _like(x: Any, host: np.ndarray) -> Any:
    """`host` as an array of `x`'s framework, dtype and device (x: a torch tensor or a
    one-device jax array)."""
    if type(x).__module__.startswith("torch"):
        import torch

        return torch.as_tensor(host).to(device=x.device, dtype=x.dtype)
    import jax

    return jax.device_put(host.astype(x.dtype), next(iter(x.devices())))


MUTATIONS: dict[str, type[Mutant]] = {
    "skip_stash": SkipStash,
    "stash_twice": StashTwice,
    "publish_without_plus_one": PublishWithoutPlusOne,
    "sentinel_off_by_one": SentinelOffByOne,
    "stale_slot_after_reuse": StaleSlotAfterReuse,
    "skip_decode_restore": SkipDecodeRestore,
    "mixed_gathers_wrong_rows": MixedGathersWrongRows,
    "spec_keeps_host_lengths": SpecKeepsHostLengths,
    "mixed_spec_keeps_host_lengths": MixedSpecKeepsHostLengths,
    "skip_stash_rows": SkipStashRows,
    "skip_verified_id_stash": SkipVerifiedIdStash,
    "partial_stash_zeroes_kept_rows": PartialStashZeroesKeptRows,
    "host_copy_syncs": HostCopySyncs,
    "one_row_aliases": OneRowAliases,
    "owned_relay_unwritten": OwnedRelayUnwritten,
    "confidence_generation_not_snapshotted": ConfidenceGenerationNotSnapshotted,
    "lengths_not_consumed": LengthsNotConsumed,
    "reads_lengths_twice": ReadsLengthsTwice,
    "mixed_tails_off_by_one": MixedTailsOffByOne,
}
"""Mutation name -> wrapper class (`judged_under`: the protocol it is judged under)."""


class FlipByte(Mutant):
    """After the stash of step `step`, one byte of rank `rank`'s buffer flips: the token of
    the first slot stashed there (its lowest bit). Not a mutation of the check: it shows
    that a one-byte difference in one DP rank is found and located."""

    def __init__(self, inner: Twin, rank: int, step: int) -> None:
        super().__init__(inner)
        self.rank, self.step, self.calls = rank, step, 0

    def stash(self, slots: Slots, payload: Mapping[int, Any], sizes: Sizes) -> None:
        self.inner.stash(slots, payload, sizes)
        self.calls += 1  # the driver stashes once per step
        s = slots.get(self.rank)
        if self.calls == self.step and s is not None and len(s) and s[0] != 0:
            token = self.inner.host(payload[self.rank])[:1] ^ 1
            self.inner.stash({self.rank: s[:1]}, {self.rank: token}, sizes)
