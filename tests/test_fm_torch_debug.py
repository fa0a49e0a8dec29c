"""fm_torch debug mode: consume tracking (WRWR) and positive restored lengths (docs/CONTRACT.md).

On CPU every violation must raise InvariantViolation at the offending call.
"""

from __future__ import annotations

import pytest
import torch

from fm_torch import (
    DEBUG_ENV,
    DraftInput,
    DraftPayload,
    ForwardMode,
    FutureMap,
    FutureMapError,
    InvariantViolation,
    ScheduleBatch,
    debug_from_env,
)


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def decode(slots: list[int]) -> ScheduleBatch:
    """A DECODE batch carrying -slot sentinels, as invalidate leaves it."""
    s = [-x for x in slots]
    return ScheduleBatch(ForwardMode.DECODE, t(slots), t(s), t(s))


def spec_draft(rows: int, bonus: list[int]) -> DraftPayload:
    return DraftPayload(
        t(bonus),
        torch.ones((rows, 2), dtype=torch.float32),
        torch.ones((rows, 2), dtype=torch.int64),
    )


def spec_decode(slots: list[int]) -> ScheduleBatch:
    batch = decode(slots)
    batch.draft = DraftInput(t(slots))
    return batch


def published(fm: FutureMap, slots: list[int], length: int = 5) -> FutureMap:
    fm.publish(t(slots), t([length] * len(slots)))
    return fm


# ------------------------------------------------------------------------- consume tracking
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_write_read_write_read_passes(dtype: torch.dtype):
    """Pins: a false positive on the legal pattern W R W R, or the poison not written back."""
    fm = published(FutureMap(4, dtype=dtype, debug=True), [1, 2])
    for step, tokens in enumerate(([3, 0], [7, 8])):
        fm.stash(t([1, 2]), t(tokens))
        batch = decode([1, 2])
        fm.resolve(batch)
        assert batch.input_ids.tolist() == tokens, step
        # The read slots hold the poison again until the next write.
        assert fm.output_tokens[[1, 2]].tolist() == [-1, -1]


def test_read_read_raises_at_the_second_read():
    """Pins: RR (a slot read twice with no write between) not being caught on CPU."""
    fm = published(FutureMap(4, debug=True), [2])
    fm.stash(t([2]), t([9]))
    fm.resolve(decode([2]))
    batch = decode([2])
    with pytest.raises(InvariantViolation, match="consume") as err:
        fm.resolve(batch)
    assert err.value.invariant == "consume (WRWR)"
    assert err.value.slots == [2]
    # The violation is reported before the batch is rewritten: its sentinel is intact.
    assert batch.input_ids.tolist() == [-2]


def test_read_before_first_write_raises():
    """Pins: a decode reading a slot no forward ever stashed (it still holds the -1 poison)."""
    fm = published(FutureMap(4, debug=True), [1, 3])
    fm.stash(t([1]), t([4]))
    with pytest.raises(InvariantViolation, match="consume") as err:
        fm.resolve(decode([1, 3]))
    assert err.value.slots == [3]
    assert "before its first write" in str(err.value)


def test_write_write_then_one_read_is_not_caught():
    """A WW followed by one read does NOT raise, by design: the check only sees reads.

    Consume tracking poisons a slot when it is read and checks the poison at the next read.
    A second write before any read overwrites a non-poison value with another one; nothing
    looks at output_tokens on the write path, so the lost first write is invisible. The
    second read after that single write does raise (RR). Pins: a check that would flag WW
    (and so differ from SGLang's), and the RR after it not being caught.
    """
    fm = published(FutureMap(4, debug=True), [1])
    fm.stash(t([1]), t([5]))
    fm.stash(t([1]), t([6]))
    batch = decode([1])
    fm.resolve(batch)
    assert batch.input_ids.tolist() == [6]
    with pytest.raises(InvariantViolation, match="consume"):
        fm.resolve(decode([1]))


def test_non_debug_mode_does_not_check_consumes():
    """Pins: consume tracking running (and costing a scatter) with debug off."""
    fm = published(FutureMap(4, debug=False), [1])
    fm.stash(t([1]), t([5]))
    for _ in range(2):
        batch = decode([1])
        fm.resolve(batch)
        assert batch.input_ids.tolist() == [5]
    assert fm.output_tokens.tolist() == [0, 5, 0, 0]


def test_padding_rows_are_not_consumed():
    """Pins: a padding row (slot 0, sentinel 0) being read as a consume of slot 0."""
    fm = published(FutureMap(4, debug=True), [1])
    fm.stash(t([1]), t([5]))
    batch = decode([1, 0, 0])
    fm.resolve(batch)
    assert batch.input_ids.tolist() == [5, 0, 0]


def test_extend_batch_consumes_nothing_but_rearms_its_slots():
    """Pins: EXTEND rows (real ids >= 0) being flagged, or an intermediate chunk's unread stash
    making the final chunk's stash look like WW-then-RR when the first decode reads it."""
    fm = FutureMap(4, debug=True)
    chunk1 = ScheduleBatch(ForwardMode.EXTEND, t([2]), t([1, 2]), t([2]))
    fm.resolve(chunk1)
    fm.publish(t([2]), t([3]))
    fm.stash(t([2]), t([11]))  # intermediate chunk: never read
    chunk2 = ScheduleBatch(ForwardMode.EXTEND, t([2]), t([3, 0]), t([4]))
    fm.resolve(chunk2)
    assert chunk2.input_ids.tolist() == [3, 0]
    fm.publish(t([2]), t([5]))
    fm.stash(t([2]), t([12]))
    batch = decode([2])
    fm.resolve(batch)
    assert batch.input_ids.tolist() == [12] and batch.seq_lens.tolist() == [5]


def test_mixed_batch_tail_sentinels_are_consume_checked():
    """Pins: MIXED batches skipping the consume check on their running decode rows."""
    fm = published(FutureMap(5, debug=True), [1, 3])
    fm.stash(t([1]), t([4]))
    mixed = ScheduleBatch(ForwardMode.MIXED, t([2, 1, 3]), t([8, 8, -1, -3]), t([2, 6, 6]))
    with pytest.raises(InvariantViolation, match="consume") as err:
        fm.resolve(mixed)
    assert err.value.slots == [3]


def test_spec_read_read_raises_on_bonus_tokens():
    """Pins: spec extras gathers not being consume-tracked (RR on bonus tokens)."""
    fm = published(FutureMap(4, spec=True, debug=True), [1, 2])
    fm.stash(t([1, 2]), spec_draft(2, [7, 0]))
    batch = spec_decode([1, 2])
    fm.resolve(batch)
    assert batch.draft is not None and batch.draft.payload is not None
    assert batch.draft.payload.bonus_tokens.tolist() == [7, 0]
    published(fm, [1, 2])  # the lengths again: only the bonus tokens were read twice
    with pytest.raises(InvariantViolation, match="consume") as err:
        fm.resolve(spec_decode([2, 1]))
    assert sorted(err.value.slots) == [1, 2]


def test_spec_read_before_write_raises():
    """Pins: a spec decode gathering a slot whose draft was never stashed going unnoticed."""
    fm = published(FutureMap(4, spec=True, debug=True), [1, 2])
    fm.stash(t([1]), spec_draft(1, [7]))
    with pytest.raises(InvariantViolation, match="consume") as err:
        fm.resolve(spec_decode([1, 2]))
    assert err.value.slots == [2]


def test_spec_padding_rows_reading_slot_zero_are_not_consume_checked():
    """Pins: a false violation when a padded spec decode gathers slot 0 (padding garbage,
    still poisoned because the previous step had no padding row to write it)."""
    fm = published(FutureMap(4, spec=True, debug=True), [1, 2])
    fm.stash(t([1, 2]), spec_draft(2, [7, 3]))
    batch = spec_decode([1, 2, 0, 0])
    fm.resolve(batch)
    assert batch.draft is not None and batch.draft.payload is not None
    assert batch.draft.payload.bonus_tokens.tolist()[:2] == [7, 3]
    published(fm, [1, 2])  # the lengths again: only the bonus tokens were read twice
    # Live slots are still tracked in the same batch.
    with pytest.raises(InvariantViolation, match="consume") as err:
        fm.resolve(spec_decode([2, 0]))
    assert err.value.slots == [2]


# --------------------------------------------------------------------------- seq_lens > 0
def test_decode_of_a_never_published_slot_raises_positive_lengths():
    """Pins: a DECODE sentinel whose length was never published restoring 0 silently."""
    fm = FutureMap(4, debug=True)
    fm.stash(t([1, 2]), t([3, 4]))
    fm.publish(t([1]), t([6]))
    batch = decode([1, 2])
    with pytest.raises(InvariantViolation, match=r"seq_lens > 0") as err:
        fm.resolve(batch)
    assert err.value.invariant == "seq_lens > 0"
    assert err.value.slots == [2]
    assert batch.seq_lens.tolist() == [-1, -2]


@pytest.mark.parametrize("debug", [True, False])
def test_published_sentinel_length_is_caught(debug: bool):
    """Pins: publishing the invalidated seq_lens (-slot) instead of the new lengths going
    unseen, or seen only at the next DECODE as an unpublished length: the publish itself
    is refused (a length is never negative) and stores nothing."""
    fm = FutureMap(4, debug=debug)
    fm.stash(t([3]), t([1]))
    stale = decode([3])
    before = fm.new_seq_lens.clone()
    with pytest.raises(FutureMapError, match=r"new_seq_lens holds negative values \[-3\]"):
        fm.publish(t([3]), stale.seq_lens)  # the bug: lengths published after invalidate
    assert torch.equal(fm.new_seq_lens, before)


def test_positive_lengths_ignore_padding_rows_and_non_decode_batches():
    """Pins: padding rows (slot 0, garbage length) or MIXED/EXTEND lengths tripping the check."""
    fm = published(FutureMap(4, debug=True), [1])
    fm.stash(t([1]), t([2]))
    batch = decode([1, 0])
    fm.resolve(batch)
    assert batch.seq_lens.tolist()[0] == 5  # the padding row's: slot 0's garbage (poison)
    # MIXED keeps host lengths and does no restore, so nothing there is checked.
    fm.resolve(ScheduleBatch(ForwardMode.MIXED, t([2]), t([4]), t([1])))


def test_non_debug_mode_lets_a_zero_length_through():
    """Pins: the positive-lengths check (a host sync on accelerators) running with debug off."""
    fm = FutureMap(4, debug=False)
    batch = decode([2])
    fm.resolve(batch)
    assert batch.seq_lens.tolist() == [0]


# ------------------------------------------------------------------------------- FM_DEBUG
@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_fm_debug_env_turns_debug_on(monkeypatch: pytest.MonkeyPatch, value: str):
    """Pins: FM_DEBUG being ignored, so whole runs cannot switch debug on without code edits."""
    monkeypatch.setenv(DEBUG_ENV, value)
    assert DEBUG_ENV == "FM_DEBUG"
    assert debug_from_env()
    fm = FutureMap(3)
    assert fm.debug
    assert fm.output_tokens.tolist() == [-1, -1, -1]
    fm.publish(t([1]), t([2]))
    with pytest.raises(InvariantViolation):
        fm.resolve(decode([1]))


@pytest.mark.parametrize("value", [None, "", "0", "false", "off"])
def test_fm_debug_env_off_or_unset_means_no_debug(monkeypatch: pytest.MonkeyPatch, value: str):
    """Pins: debug mode on by default (production must not pay for the checks)."""
    if value is None:
        monkeypatch.delenv(DEBUG_ENV, raising=False)
    else:
        monkeypatch.setenv(DEBUG_ENV, value)
    assert not FutureMap(3).debug


def test_explicit_debug_flag_overrides_the_env(monkeypatch: pytest.MonkeyPatch):
    """Pins: the constructor flag losing to the environment variable."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert not FutureMap(3, debug=False).debug
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert FutureMap(3, debug=True).debug
