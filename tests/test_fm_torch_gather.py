"""fm_torch's gather protocol (docs/CONTRACT.md, 'Two protocols'): no sentinels, no invalidate.

resolve builds the forward's ids at its entry: a DECODE batch's from `output_tokens` at its
slots, a MIXED batch's running tokens appended to its prefill ids, spec lengths and extras
at the draft's slots. Buffers are compared as raw bytes, so a stray write anywhere (a poison
on a slot nobody gathered, a partial write before a refusal) is caught.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fm_torch import (
    POISON,
    DraftInput,
    DraftPayload,
    ForwardMode,
    FutureMap,
    FutureMapError,
    InvariantViolation,
    ScheduleBatch,
)

NO_CUDA = "needs a CUDA device; torch.cuda.is_available() is False on this machine"
R = 6
K, H = 2, 3


def t(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def raw(x: object) -> object:
    """dtype, shape and raw bytes of a tensor (anything else, None or a bad input, as is)."""
    if not isinstance(x, torch.Tensor):
        return x
    return (
        str(x.dtype),
        tuple(x.shape),
        x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
    )


def snapshot(fm: FutureMap) -> dict[str, object]:
    """Everything the FutureMap stores, as raw bytes."""
    return {
        "output_tokens": raw(fm.output_tokens),
        "new_seq_lens": raw(fm.new_seq_lens),
        "topk_p": raw(fm.topk_p),
        "topk_index": raw(fm.topk_index),
        "hidden_states": raw(fm.hidden_states),
    }


def batch_snapshot(b: ScheduleBatch) -> dict[str, object]:
    payload = None if b.draft is None else b.draft.payload
    return {
        "mode": b.forward_mode,
        "req_pool_indices": raw(b.req_pool_indices),
        "input_ids": raw(b.input_ids),
        "seq_lens": raw(b.seq_lens),
        "draft_indices": None if b.draft is None else raw(b.draft.indices),
        "draft_payload": payload,
        "mix_running_indices": raw(b.mix_running_indices),
    }


def gather_map(debug: bool = False, spec: bool = False, dtype: torch.dtype = torch.int64):
    return FutureMap(R, dtype=dtype, spec=spec, debug=debug, protocol="gather")


def decode(slots: list[int], lens: list[int] | None = None) -> ScheduleBatch:
    """A gather-protocol DECODE batch: no ids, the host's lengths."""
    lens = [9] * len(slots) if lens is None else lens
    return ScheduleBatch(ForwardMode.DECODE, t(slots), None, t(lens))


def mixed(slots: list[int], prefill_ids: list[int], running: list[int]) -> ScheduleBatch:
    return ScheduleBatch(
        ForwardMode.MIXED,
        t(slots),
        t(prefill_ids),
        t([4] * len(slots)),
        mix_running_indices=t(running),
    )


def draft(bonus: list[int], base: float = 0.5, hidden: bool = True) -> DraftPayload:
    rows = len(bonus)
    return DraftPayload(
        t(bonus),
        torch.arange(rows * K, dtype=torch.float32).reshape(rows, K) + base,
        torch.arange(rows * K, dtype=torch.int64).reshape(rows, K) + 100 * int(base * 10),
        torch.arange(rows * H, dtype=torch.float32).reshape(rows, H).to(torch.bfloat16) - base
        if hidden
        else None,
    )


def spec_decode(slots: list[int], ids: torch.Tensor | None = None) -> ScheduleBatch:
    return ScheduleBatch(
        ForwardMode.DECODE, t(slots), ids, t([0] * len(slots)), DraftInput(t(slots))
    )


# ------------------------------------------------------------------------------ protocol
def test_protocol_defaults_to_sentinel_and_is_stored():
    """Pins: a default other than the sentinel protocol, or the choice not kept."""
    assert FutureMap(R).protocol == "sentinel"
    assert FutureMap(R, protocol="sentinel").protocol == "sentinel"
    assert FutureMap(R, protocol="gather").protocol == "gather"


@pytest.mark.parametrize("bad", ["Gather", "sentinels", "", " gather", None, 1, b"gather"])
def test_unknown_protocol_is_refused(bad: object):
    """Pins: a misspelt or non-string protocol silently falling back to one of the two."""
    with pytest.raises(FutureMapError, match="protocol"):
        FutureMap(R, protocol=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- batch kinds
@pytest.mark.parametrize("debug", [False, True])
def test_extend_takes_ids_and_lengths_as_given(debug: bool):
    """Pins: an EXTEND resolve rewriting ids or lengths, or consuming a slot."""
    fm = gather_map(debug=debug)
    fm.publish(t([1, 2]), t([5, 6]))
    fm.stash(t([1, 2]), t([11, 22]))
    ids, lens = t([7, 8, 9, 0, 3]), t([3, 2])
    batch = ScheduleBatch(ForwardMode.EXTEND, t([1, 2]), ids, lens)
    before = snapshot(fm)
    fm.resolve(batch)
    assert batch.input_ids is ids and batch.seq_lens is lens
    assert batch.input_ids.tolist() == [7, 8, 9, 0, 3]
    assert batch.seq_lens.tolist() == [3, 2]
    assert snapshot(fm) == before


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_decode_gathers_ids_at_its_slots_and_keeps_host_lengths(dtype: torch.dtype):
    """Pins: ids gathered from the wrong slots or order, lengths restored from the buffer
    (the gather protocol takes the host's), or the ids in another dtype than the map's."""
    fm = gather_map(dtype=dtype)
    fm.publish(t([1, 3, 5]), t([50, 51, 52]))
    fm.stash(t([1, 3, 5]), t([11, 33, 55]))
    batch = decode([5, 1, 3, 0], lens=[7, 8, 9, 1])
    fm.resolve(batch)
    assert batch.input_ids is not None
    assert batch.input_ids.dtype == dtype
    assert batch.input_ids.tolist() == [55, 11, 33, 0]  # slot 0 holds zeros (padding)
    assert batch.seq_lens.tolist() == [7, 8, 9, 1]


def test_decode_refuses_ids_it_brings():
    """Pins a DECODE batch's stale ids (the previous step's) surviving resolve, or being
    silently dropped: ids given to a gather-protocol DECODE batch are refused, nothing
    written."""
    fm = gather_map()
    fm.stash(t([2, 4]), t([20, 40]))
    batch = ScheduleBatch(ForwardMode.DECODE, t([4, 2]), t([3, 3]), t([5, 5]))
    before = snapshot(fm)
    with pytest.raises(FutureMapError, match="input_ids given for a DECODE batch"):
        fm.resolve(batch)
    assert snapshot(fm) == before


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_mixed_appends_running_tokens_after_prefill_ids(dtype: torch.dtype):
    """Pins: running tokens put before the prefill ids, gathered at req_pool_indices instead
    of mix_running_indices, in another order, or lengths rewritten."""
    fm = gather_map(dtype=dtype)
    fm.publish(t([2, 4, 1]), t([60, 61, 62]))
    fm.stash(t([2, 4, 1]), t([20, 40, 10]))
    # Row 0 (slot 1) is a prefill chunk of 3 tokens; rows 1, 2 run (slots 4, 2).
    batch = mixed([1, 4, 2], [100, 101, 102], [4, 2])
    fm.resolve(batch)
    assert batch.input_ids is not None
    assert batch.input_ids.dtype == dtype
    assert batch.input_ids.tolist() == [100, 101, 102, 40, 20]
    assert batch.seq_lens.tolist() == [4, 4, 4]


def test_mixed_with_padding_running_rows():
    """Pins: padding rows (slot 0) of the running part dropped or refused as duplicates."""
    fm = gather_map()
    fm.stash(t([3]), t([30]))
    batch = mixed([1, 3, 0, 0], [7, 7], [3, 0, 0])
    fm.resolve(batch)
    assert batch.input_ids is not None and batch.input_ids.tolist() == [7, 7, 30, 0, 0]


@pytest.mark.parametrize("debug", [False, True])
def test_idle_resolves_to_nothing(debug: bool):
    """Pins: an idle rank's resolve writing a buffer or the batch."""
    fm = gather_map(debug=debug)
    e = t([])
    batch = ScheduleBatch(ForwardMode.IDLE, e, e, e)
    before, before_batch = snapshot(fm), batch_snapshot(batch)
    fm.resolve(batch)
    assert snapshot(fm) == before
    assert batch_snapshot(batch) == before_batch
    assert batch.input_ids is e


# --------------------------------------------------------------------------------- spec
@pytest.mark.parametrize("debug", [False, True])
def test_spec_gathers_lengths_and_extras_at_draft_indices(debug: bool):
    """Pins: spec lengths taken from the host or from req_pool_indices instead of the
    draft's slots, extras or bonus tokens from the wrong rows, or ids gathered for a spec
    DECODE (it gathers none)."""
    fm = gather_map(debug=debug, spec=True)
    fm.publish(t([1, 2, 3]), t([31, 32, 33]))
    stashed = draft([11, 22, 33])
    fm.stash(t([1, 2, 3]), stashed)
    # The draft's slots in another order than req_pool_indices, to tell the two apart.
    batch = ScheduleBatch(
        ForwardMode.DECODE, t([1, 2, 3]), None, t([0, 0, 0]), DraftInput(t([3, 1, 2]))
    )
    fm.resolve(batch)
    assert batch.input_ids is None
    assert batch.seq_lens.tolist() == [33, 31, 32]
    payload = batch.draft.payload  # type: ignore[union-attr]
    assert payload is not None
    rows = [2, 0, 1]
    assert payload.bonus_tokens.tolist() == [33, 11, 22]
    assert raw(payload.topk_p) == raw(stashed.topk_p[rows])
    assert raw(payload.topk_index) == raw(stashed.topk_index[rows])
    assert stashed.hidden_states is not None
    assert raw(payload.hidden_states) == raw(stashed.hidden_states[rows])


def test_spec_decode_keeps_ids_it_brings():
    """Pins: a spec DECODE's host ids replaced by a gather."""
    fm = gather_map(spec=True)
    fm.publish(t([1]), t([4]))
    fm.stash(t([1]), draft([5], hidden=False))
    ids = t([77])
    batch = spec_decode([1], ids)
    fm.resolve(batch)
    assert batch.input_ids is ids and batch.input_ids.tolist() == [77]
    assert batch.seq_lens.tolist() == [4]
    assert batch.draft is not None and batch.draft.payload is not None
    assert batch.draft.payload.hidden_states is None


@pytest.mark.parametrize("debug", [False, True])
def test_spec_prefill_without_draft_gathers_nothing(debug: bool):
    """Pins: a spec prefill (no draft input) gathering lengths, ids or extras."""
    fm = gather_map(debug=debug, spec=True)
    fm.publish(t([2]), t([9]))
    fm.stash(t([2]), draft([5]))
    ids, lens = t([1, 2, 3]), t([3])
    batch = ScheduleBatch(ForwardMode.EXTEND, t([2]), ids, lens)
    before = snapshot(fm)
    fm.resolve(batch)
    assert batch.input_ids is ids and batch.seq_lens is lens and batch.draft is None
    assert snapshot(fm) == before


def test_spec_decode_without_draft_gathers_no_ids():
    """Pins: a spec map gathering decode ids (SGLang gathers them only without spec)."""
    fm = gather_map(spec=True)
    fm.stash(t([1]), draft([5]))
    batch = decode([1], lens=[3])
    fm.resolve(batch)
    assert batch.input_ids is None and batch.seq_lens.tolist() == [3]


# ---------------------------------------------------------------------------- debug mode
def expected_tokens(before: list[int], poisoned: list[int]) -> list[int]:
    return [POISON if s in poisoned else v for s, v in enumerate(before)]


def test_debug_decode_poisons_exactly_the_gathered_slots():
    """Pins: the poison missing, written to a slot nobody gathered, or the legal W R W R
    flagged."""
    fm = gather_map(debug=True)
    fm.stash(t([1, 2, 3, 4]), t([10, 20, 30, 40]))
    for step, tokens in enumerate(([10, 30], [11, 31])):
        if step:
            fm.stash(t([1, 3]), t(tokens))
        before = fm.output_tokens.tolist()
        batch = decode([3, 1])
        fm.resolve(batch)
        assert batch.input_ids is not None
        assert batch.input_ids.tolist() == tokens[::-1]
        assert fm.output_tokens.tolist() == expected_tokens(before, [1, 3]), step
    assert fm.output_tokens.tolist() == [POISON, POISON, 20, POISON, 40, POISON]


def test_debug_decode_read_read_is_caught_and_writes_nothing():
    """Pins: RR on a DECODE gather not caught, the wrong slot reported, or a partial write
    (poison or ids) before the raise."""
    fm = gather_map(debug=True)
    fm.stash(t([1, 2]), t([10, 20]))
    fm.resolve(decode([1, 2]))
    fm.stash(t([2]), t([21]))
    batch = decode([2, 1])
    before, before_batch = snapshot(fm), batch_snapshot(batch)
    with pytest.raises(InvariantViolation, match="consume") as err:
        fm.resolve(batch)
    assert err.value.invariant == "consume (WRWR)"
    assert err.value.slots == [1]
    assert snapshot(fm) == before
    assert batch_snapshot(batch) == before_batch


def test_debug_decode_padding_rows_are_not_checked():
    """Pins: a padding row (slot 0, poisoned from the start) flagged as a read before write."""
    fm = gather_map(debug=True)
    fm.stash(t([2]), t([20]))
    batch = decode([2, 0, 0])
    fm.resolve(batch)
    assert batch.input_ids is not None and batch.input_ids.tolist() == [20, POISON, POISON]


def test_debug_mixed_poisons_only_the_running_slots():
    """Pins: a MIXED consume poisoning the prefill rows' slots (req_pool_indices), or not
    poisoning the running ones."""
    fm = gather_map(debug=True)
    fm.stash(t([1, 2, 4]), t([10, 20, 40]))  # slot 1 is the prefill row: not gathered
    batch = mixed([1, 4, 2], [100, 101], [4, 2])
    fm.resolve(batch)
    assert batch.input_ids is not None and batch.input_ids.tolist() == [100, 101, 40, 20]
    assert fm.output_tokens.tolist() == [POISON, 10, POISON, POISON, POISON, POISON]


def test_debug_mixed_read_read_is_caught_and_writes_nothing():
    """Pins: RR on a MIXED batch's running rows not caught, or a write before the raise."""
    fm = gather_map(debug=True)
    fm.stash(t([2, 4]), t([20, 40]))
    fm.resolve(decode([4]))  # consumes slot 4
    batch = mixed([1, 4, 2], [100], [4, 2])
    before, before_batch = snapshot(fm), batch_snapshot(batch)
    with pytest.raises(InvariantViolation, match="consume") as err:
        fm.resolve(batch)
    assert err.value.slots == [4]
    assert snapshot(fm) == before
    assert batch_snapshot(batch) == before_batch


def test_debug_spec_poisons_exactly_the_draft_slots():
    """Pins: a spec consume poisoning req_pool_indices instead of the draft's slots, or a
    slot outside the draft."""
    fm = gather_map(debug=True, spec=True)
    fm.publish(t([1, 2, 3]), t([5, 6, 7]))
    fm.stash(t([1, 2, 3]), draft([11, 22, 33]))
    batch = ScheduleBatch(
        ForwardMode.DECODE, t([1, 2, 0]), None, t([0, 0, 0]), DraftInput(t([3, 1, 0]))
    )
    fm.resolve(batch)
    assert batch.draft is not None and batch.draft.payload is not None
    assert batch.draft.payload.bonus_tokens.tolist() == [33, 11, POISON]
    assert fm.output_tokens.tolist() == [POISON, POISON, 22, POISON, POISON, POISON]


def test_debug_spec_read_read_is_caught_and_writes_nothing():
    """Pins: RR on the bonus tokens not caught, or the lengths or payload written first."""
    fm = gather_map(debug=True, spec=True)
    fm.publish(t([1, 2]), t([5, 6]))
    fm.stash(t([1, 2]), draft([11, 22]))
    fm.resolve(spec_decode([1, 2]))
    fm.publish(t([1, 2]), t([6, 7]))  # the lengths again: only bonus token 2 is read twice
    fm.stash(t([1]), draft([12]))
    batch = spec_decode([1, 2])
    before, before_batch = snapshot(fm), batch_snapshot(batch)
    with pytest.raises(InvariantViolation, match="consume") as err:
        fm.resolve(batch)
    assert err.value.slots == [2]
    assert snapshot(fm) == before
    assert batch_snapshot(batch) == before_batch


def test_debug_spec_non_positive_gathered_length_is_caught():
    """Pins: a spec length never published (still 0) gathered without complaint, or a
    padding row's length checked."""
    fm = gather_map(debug=True, spec=True)
    fm.publish(t([1]), t([5]))
    fm.stash(t([1, 2]), draft([11, 22]))
    batch = ScheduleBatch(
        ForwardMode.DECODE, t([1, 2, 0]), None, t([0, 0, 0]), DraftInput(t([1, 2, 0]))
    )
    before, before_batch = snapshot(fm), batch_snapshot(batch)
    with pytest.raises(InvariantViolation, match="seq_lens > 0") as err:
        fm.resolve(batch)
    assert err.value.slots == [2]
    assert snapshot(fm) == before
    assert batch_snapshot(batch) == before_batch


def test_debug_spec_mixed_slot_gathered_twice_is_caught():
    """A spec MIXED batch with a draft reads output_tokens twice: the running rows, then the
    bonus tokens. A slot in both is read twice with no write between (RR), as in SGLang's
    sequence. Pins: the second read seeing the value the first consumed."""
    fm = gather_map(debug=True, spec=True)
    fm.publish(t([1, 2]), t([5, 6]))
    fm.stash(t([1, 2]), draft([11, 22]))
    batch = ScheduleBatch(
        ForwardMode.MIXED,
        t([1, 2]),
        t([7]),
        t([3, 3]),
        DraftInput(t([1, 2])),
        mix_running_indices=t([2]),
    )
    before, before_batch = snapshot(fm), batch_snapshot(batch)
    with pytest.raises(InvariantViolation, match="consume") as err:
        fm.resolve(batch)
    assert err.value.slots == [2]
    assert snapshot(fm) == before
    assert batch_snapshot(batch) == before_batch


def test_debug_gather_loop_passes_the_legal_order():
    """A few overlap steps in the gather protocol's host order (resolve, forward, publish,
    stash; no invalidate), with debug on. Pins: a false positive on the legal order."""
    fm = gather_map(debug=True)
    slots, lens = [1, 2], [3, 4]
    fm.publish(t(slots), t(lens))  # the prefill
    fm.stash(t(slots), t([5, 6]))
    expect = [5, 6]
    for _ in range(4):
        batch = decode(slots, lens)
        fm.resolve(batch)
        assert batch.input_ids is not None and batch.input_ids.tolist() == expect
        lens = [n + 1 for n in lens]
        expect = [(x * 7 + 1) % 50 for x in expect]
        fm.publish(t(slots), t(lens))
        fm.stash(t(slots), t(expect))
    assert fm.new_seq_lens[slots].tolist() == [7, 8]


# ------------------------------------------------------------------------------ refusals
def spec_ready() -> FutureMap:
    fm = gather_map(spec=True)
    fm.publish(t([1, 2]), t([5, 6]))
    fm.stash(t([1, 2]), draft([11, 22]))
    return fm


def plain_ready() -> FutureMap:
    fm = gather_map()
    fm.publish(t([1, 2, 3]), t([5, 6, 7]))
    fm.stash(t([1, 2, 3]), t([11, 22, 33]))
    return fm


def with_mix(mode: ForwardMode, mix: torch.Tensor | None, ids: list[int] | None = None):
    ids_t = t([7] if ids is None else ids)
    return ScheduleBatch(mode, t([1, 2]), ids_t, t([3, 3]), mix_running_indices=mix)


REFUSALS: dict[str, tuple[Callable[[], FutureMap], Callable[[], ScheduleBatch], str]] = {
    "mixed without mix_running_indices": (
        plain_ready,
        lambda: with_mix(ForwardMode.MIXED, None),
        "mix_running_indices is required",
    ),
    "mix_running_indices on DECODE": (
        plain_ready,
        lambda: ScheduleBatch(
            ForwardMode.DECODE, t([1, 2]), None, t([3, 3]), mix_running_indices=t([2])
        ),
        "mix_running_indices given with forward_mode DECODE",
    ),
    "mix_running_indices on EXTEND": (
        plain_ready,
        lambda: with_mix(ForwardMode.EXTEND, t([2])),
        "mix_running_indices given with forward_mode EXTEND",
    ),
    "mix_running_indices on IDLE": (
        plain_ready,
        lambda: ScheduleBatch(ForwardMode.IDLE, t([]), t([]), t([]), mix_running_indices=t([])),
        "mix_running_indices given with forward_mode IDLE",
    ),
    "mix_running_indices 2-D": (
        plain_ready,
        lambda: with_mix(ForwardMode.MIXED, t([[2]])),
        "mix_running_indices must be 1-D",
    ),
    "mix_running_indices float": (
        plain_ready,
        lambda: with_mix(ForwardMode.MIXED, torch.tensor([2.0])),
        "mix_running_indices must have an integer dtype",
    ),
    "mix_running_indices a list": (
        plain_ready,
        lambda: with_mix(ForwardMode.MIXED, [2]),  # type: ignore[arg-type]
        "mix_running_indices must be a torch.Tensor",
    ),
    "mix_running_indices slot R": (
        plain_ready,
        lambda: with_mix(ForwardMode.MIXED, t([2, R])),
        "mix_running_indices holds slots",
    ),
    "mix_running_indices slot -1": (
        plain_ready,
        lambda: with_mix(ForwardMode.MIXED, t([-1])),
        "mix_running_indices holds slots",
    ),
    "mix_running_indices live slot twice": (
        plain_ready,
        lambda: with_mix(ForwardMode.MIXED, t([2, 2], torch.int32)),
        "mix_running_indices holds live slots",
    ),
    "negative id on EXTEND": (
        plain_ready,
        lambda: ScheduleBatch(ForwardMode.EXTEND, t([1]), t([5, -2, 6]), t([3])),
        "input_ids holds negative ids.*gather protocol has no sentinels",
    ),
    "negative id on MIXED": (
        plain_ready,
        lambda: with_mix(ForwardMode.MIXED, t([2]), ids=[-1]),
        "input_ids holds negative ids.*gather protocol has no sentinels",
    ),
    "sentinels brought by a DECODE": (
        plain_ready,
        lambda: ScheduleBatch(ForwardMode.DECODE, t([1, 2]), t([-1, -2]), t([3, 3])),
        "input_ids given for a DECODE batch",
    ),
    "negative id on a spec DECODE": (
        spec_ready,
        lambda: spec_decode([1, 2], t([-1, 4])),
        "input_ids holds negative ids.*gather protocol has no sentinels",
    ),
    "no ids on EXTEND": (
        plain_ready,
        lambda: ScheduleBatch(ForwardMode.EXTEND, t([1]), None, t([3])),
        "input_ids is None with forward_mode EXTEND",
    ),
    "no ids on MIXED": (
        plain_ready,
        lambda: ScheduleBatch(
            ForwardMode.MIXED, t([1, 2]), None, t([3, 3]), mix_running_indices=t([2])
        ),
        "input_ids is None with forward_mode MIXED",
    ),
    "ids 2-D": (
        plain_ready,
        lambda: ScheduleBatch(ForwardMode.EXTEND, t([1]), t([[5]]), t([3])),
        "input_ids must be 1-D",
    ),
    "ids overflow int32": (
        lambda: FutureMap(R, dtype=torch.int32, protocol="gather"),
        lambda: ScheduleBatch(ForwardMode.EXTEND, t([1]), t([2**31]), t([3])),
        "input_ids holds values that do not fit",
    ),
    "req_pool_indices live slot twice": (
        plain_ready,
        lambda: ScheduleBatch(ForwardMode.DECODE, t([2, 2]), None, t([3, 3])),
        "req_pool_indices holds live slots",
    ),
    "req_pool_indices slot R": (
        plain_ready,
        lambda: ScheduleBatch(ForwardMode.DECODE, t([1, R]), None, t([3, 3])),
        "req_pool_indices holds slots",
    ),
    "seq_lens rows": (
        plain_ready,
        lambda: ScheduleBatch(ForwardMode.DECODE, t([1, 2]), None, t([3])),
        "seq_lens has 1 rows",
    ),
    "forward mode": (
        plain_ready,
        lambda: ScheduleBatch(7, t([1]), None, t([3])),  # type: ignore[arg-type]
        "forward_mode",
    ),
    "draft on a non-spec map": (
        plain_ready,
        lambda: spec_decode([1, 2]),
        "spec=False",
    ),
    "draft rows differ from the batch's": (
        spec_ready,
        lambda: ScheduleBatch(ForwardMode.DECODE, t([1, 2]), None, t([0, 0]), DraftInput(t([1]))),
        "draft.indices has 1 rows",
    ),
    "draft slot R": (
        spec_ready,
        lambda: ScheduleBatch(
            ForwardMode.DECODE, t([1, 2]), None, t([0, 0]), DraftInput(t([1, R]))
        ),
        "draft.indices holds slots",
    ),
    "draft before any stash": (
        lambda: gather_map(spec=True),
        lambda: spec_decode([1]),
        "before any draft was stashed",
    ),
}


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_resolve_input_is_refused_and_changes_nothing(case: str, debug: bool):
    """Pins: a bad gather-protocol batch accepted, refused with another error or without
    naming its field, or refused after a buffer or the batch was written."""
    make_map, make_batch, message = REFUSALS[case]
    fm = make_map()
    fm.debug = debug  # the poison fill differs, the refusals do not
    batch = make_batch()
    before, before_batch = snapshot(fm), batch_snapshot(batch)
    with pytest.raises(FutureMapError, match=message):
        fm.resolve(batch)
    assert snapshot(fm) == before
    assert batch_snapshot(batch) == before_batch


def test_refused_map_keeps_working():
    """Pins: a refusal leaving the map in a state where the next good batch fails."""
    fm = plain_ready()
    with pytest.raises(FutureMapError):
        fm.resolve(with_mix(ForwardMode.MIXED, t([2, 2])))
    batch = with_mix(ForwardMode.MIXED, t([2]))
    fm.resolve(batch)
    assert batch.input_ids is not None and batch.input_ids.tolist() == [7, 22]


def test_zero_id_is_a_token_not_a_sentinel():
    """Pins: the negative-id refusal also refusing token 0."""
    fm = plain_ready()
    batch = with_mix(ForwardMode.MIXED, t([2]), ids=[0, 0])
    fm.resolve(batch)
    assert batch.input_ids is not None and batch.input_ids.tolist() == [0, 0, 22]


@pytest.mark.parametrize("debug", [False, True])
def test_invalidate_is_refused(debug: bool):
    """Pins: the gather protocol leaving sentinels behind (its resolve would refuse them)."""
    fm = gather_map(debug=debug)
    fm.stash(t([1, 2]), t([3, 4]))
    batch = ScheduleBatch(ForwardMode.EXTEND, t([1, 2]), t([5, 6]), t([1, 1]))
    before, before_batch = snapshot(fm), batch_snapshot(batch)
    with pytest.raises(FutureMapError, match="gather protocol leaves no sentinels"):
        fm.invalidate(batch, t([1, 2]))
    assert snapshot(fm) == before
    assert batch_snapshot(batch) == before_batch


# -------------------------------------------------------------------- the other protocol
def test_sentinel_protocol_is_the_default_behaviour():
    """Pins: the default map (or an explicit 'sentinel') behaving like the gather protocol:
    sentinels not read, lengths not restored, or invalidate refused."""
    for fm in (FutureMap(R), FutureMap(R, protocol="sentinel")):
        fm.publish(t([1, 2]), t([5, 6]))
        fm.stash(t([1, 2]), t([11, 22]))
        batch = ScheduleBatch(ForwardMode.DECODE, t([2, 1]), t([-2, -1]), t([-2, -1]))
        fm.resolve(batch)
        assert batch.input_ids is not None and batch.input_ids.tolist() == [22, 11]
        assert batch.seq_lens.tolist() == [6, 5]
        fm.invalidate(batch, t([2, 1]))
        assert batch.input_ids.tolist() == [-2, -1]
        assert batch.seq_lens.tolist() == [-2, -1]


def test_sentinel_protocol_refuses_a_batch_without_ids():
    """Pins: a None input_ids reaching the sentinel protocol's select (a raw TypeError)."""
    fm = FutureMap(R)
    fm.stash(t([1]), t([3]))
    batch = ScheduleBatch(ForwardMode.DECODE, t([1]), None, t([-1]))
    before, before_batch = snapshot(fm), batch_snapshot(batch)
    with pytest.raises(FutureMapError, match="input_ids is None"):
        fm.resolve(batch)
    assert snapshot(fm) == before
    assert batch_snapshot(batch) == before_batch


def test_sentinel_protocol_refuses_running_indices():
    """Running rows' slots belong to the gather protocol: a sentinel map refuses them (as
    fm_jax refuses token_slots there) instead of ignoring them, and writes nothing."""
    fm = FutureMap(R)
    fm.stash(t([1]), t([3]))
    batch = ScheduleBatch(ForwardMode.MIXED, t([2, 1]), t([9, -1]), t([1, 2]), None, t([1]))
    before, before_batch = snapshot(fm), batch_snapshot(batch)
    with pytest.raises(FutureMapError, match="mix_running_indices is for the gather protocol"):
        fm.resolve(batch)
    assert snapshot(fm) == before
    assert batch_snapshot(batch) == before_batch


@pytest.mark.parametrize("spec", [False, True])
def test_writes_are_the_same_bytes_in_both_protocols(spec: bool):
    """Pins: publish, stash or resolve_seq_lens_cpu depending on the protocol."""
    maps = [FutureMap(R, spec=spec, debug=True, protocol=p) for p in ("sentinel", "gather")]
    for fm in maps:
        fm.publish(t([1, 3]), t([4, 8]))
        fm.stash(t([1, 3]), draft([5, 9]) if spec else t([5, 9]))
        fm.publish(t([3, 0]), t([9, 1], torch.int32))
    assert snapshot(maps[0]) == snapshot(maps[1])
    lens = [fm.resolve_seq_lens_cpu(t([3, 1])) for fm in maps]
    assert raw(lens[0]) == raw(lens[1])
    assert lens[0].tolist() == [9, 4]


# --------------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_gather_resolve_and_poison():
    """The gather protocol on CUDA: the same ids and poisoned bytes as on CPU (the consume
    check is a device assert there). Pins: a CPU-only code path (a host sync, a tensor on
    the wrong device) in the gather resolve."""
    dev = torch.device("cuda", torch.cuda.current_device())
    fm = FutureMap(R, device=dev, debug=True, protocol="gather")
    fm.stash(t([2, 4]).to(dev), t([20, 40]).to(dev))
    batch = ScheduleBatch(
        ForwardMode.MIXED,
        t([1, 4, 2]).to(dev),
        t([100, 101]).to(dev),
        t([4, 4, 4]).to(dev),
        mix_running_indices=t([4, 2]).to(dev),
    )
    fm.resolve(batch)
    assert batch.input_ids is not None and batch.input_ids.tolist() == [100, 101, 40, 20]
    assert fm.output_tokens.tolist() == [POISON] * R
    fm.stash(t([4]).to(dev), t([41]).to(dev))
    batch = ScheduleBatch(ForwardMode.DECODE, t([4, 0]).to(dev), None, t([5, 1]).to(dev))
    fm.resolve(batch)
    assert batch.input_ids is not None and batch.input_ids.tolist() == [41, POISON]
