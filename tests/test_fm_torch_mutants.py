"""fm_torch behaviours that mutation testing (scripts/mutation.sh) found no test pinning.

Each test states one behaviour of the contract; docs/mutation.md lists what is left.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
import torch

from fm_torch import (
    DraftInput,
    DraftPayload,
    ForwardMode,
    FutureMap,
    FutureMapError,
    InvariantViolation,
    ScheduleBatch,
)

R = 5


def t(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device="cpu")


def decode(slots: list[int]) -> ScheduleBatch:
    """A DECODE batch carrying -slot sentinels, as invalidate leaves it."""
    s = [-x for x in slots]
    return ScheduleBatch(ForwardMode.DECODE, t(slots), t(s), t(s))


def draft(bonus: list[int], *, hidden: bool = False) -> DraftPayload:
    rows = len(bonus)
    return DraftPayload(
        t(bonus),
        torch.full((rows, 2), 0.25, dtype=torch.float32, device="cpu"),
        torch.ones((rows, 2), dtype=torch.int64, device="cpu"),
        torch.full((rows, 3), 1.5, dtype=torch.bfloat16, device="cpu") if hidden else None,
    )


def spec_decode(slots: list[int]) -> ScheduleBatch:
    batch = decode(slots)
    batch.draft = DraftInput(t(slots))
    return batch


def spec_map(**kw: object) -> FutureMap:
    """A spec map whose extras are shaped (K=2, no hidden states)."""
    fm = FutureMap(R, spec=True, **kw)  # type: ignore[arg-type]
    fm.stash(t([1]), draft([3]))
    return fm


def extend(slots: list[int], ids: list[int], lens: list[int]) -> ScheduleBatch:
    return ScheduleBatch(ForwardMode.EXTEND, t(slots), t(ids), t(lens))


def wide(values: list[int]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.int64)  # 2-D: refused by the rank check


# (call, the field its refusal must name first)
REFUSALS: dict[str, tuple[Callable[[], object], str]] = {
    "publish rank": (lambda: FutureMap(R).publish(wide([1]), t([4])), "indices"),
    "publish range": (lambda: FutureMap(R).publish(t([R]), t([4])), "indices"),
    "stash rank": (lambda: FutureMap(R).stash(wide([1]), t([4])), "indices"),
    "stash range": (lambda: FutureMap(R).stash(t([R]), t([4])), "indices"),
    "invalidate rank": (lambda: FutureMap(R).invalidate(decode([1]), wide([1])), "indices"),
    "invalidate range": (lambda: FutureMap(R).invalidate(decode([1]), t([-1])), "indices"),
    "seq_lens_cpu rank": (lambda: FutureMap(R).resolve_seq_lens_cpu(wide([1])), "indices"),
    "seq_lens_cpu range": (lambda: FutureMap(R).resolve_seq_lens_cpu(t([R])), "indices"),
    "resolve slot range": (
        lambda: FutureMap(R).resolve(extend([R], [5], [1])),
        "req_pool_indices",
    ),
    "resolve seq_lens rank": (
        lambda: FutureMap(R).resolve(ScheduleBatch(ForwardMode.EXTEND, t([1]), t([5]), wide([1]))),
        "seq_lens",
    ),
    "resolve seq_lens rows": (
        lambda: FutureMap(R).resolve(extend([1], [5], [1, 1])),
        "seq_lens",
    ),
    "resolve seq_lens fit": (
        lambda: FutureMap(R, dtype=torch.int32).resolve(extend([1], [5], [2**31])),
        "seq_lens",
    ),
    "resolve sentinel range": (
        lambda: FutureMap(R).resolve(extend([1], [-R], [1])),
        "input_ids",
    ),
    "resolve draft.indices rank": (
        lambda: spec_map().resolve(
            ScheduleBatch(ForwardMode.DECODE, t([1]), t([-1]), t([-1]), DraftInput(wide([1])))
        ),
        "draft.indices",
    ),
    "stash draft.topk_p rank": (
        lambda: FutureMap(R, spec=True).stash(
            t([1]), DraftPayload(t([3]), torch.ones(1), torch.ones((1, 2), dtype=torch.int64))
        ),
        "draft.topk_p",
    ),
    "stash draft.hidden_states rank": (
        lambda: FutureMap(R, spec=True).stash(
            t([1]),
            DraftPayload(
                t([3]),
                torch.ones((1, 2)),
                torch.ones((1, 2), dtype=torch.int64),
                torch.ones(1, dtype=torch.bfloat16),
            ),
        ),
        "draft.hidden_states",
    ),
    "resolve draft on a non-spec map": (
        lambda: FutureMap(R).resolve(spec_decode([1])),
        "batch.draft",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refusal_names_the_bad_field_as_its_subject(case: str) -> None:
    """A bad input is refused with a message whose subject is the field at fault, spelt as
    the caller knows it (req_pool_indices is not indices, nor seq_lens input_ids)."""
    call, name = REFUSALS[case]
    with pytest.raises(FutureMapError) as err:
        call()
    assert str(err.value).startswith(name + " "), str(err.value)


def test_refusals_of_the_wrong_payload_kind_name_the_setting_at_odds() -> None:
    """A draft given to a non-spec map, or spec extras read before any draft was stashed,
    is refused with a message that names the op and the `spec=False` setting it conflicts
    with, as written in the constructor."""
    with pytest.raises(FutureMapError) as err:
        FutureMap(R).stash(t([1]), draft([3]))
    assert re.match(r"stash\b.*\bspec=False\b", str(err.value)), str(err.value)
    with pytest.raises(FutureMapError) as err:
        FutureMap(R).resolve(spec_decode([1]))
    assert re.match(r"batch\.draft\b.*\bspec=False\b", str(err.value)), str(err.value)
    with pytest.raises(FutureMapError) as err:
        FutureMap(R, spec=True).resolve(spec_decode([1]))
    assert re.match(r"resolve\b.*\bdraft\b", str(err.value)), str(err.value)


def test_a_bad_draft_rank_names_the_expected_shape() -> None:
    """A 1-D topk_p or hidden_states is refused with the shape it must have."""
    with pytest.raises(FutureMapError, match=re.escape("[B, H]")):
        REFUSALS["stash draft.hidden_states rank"][0]()
    with pytest.raises(FutureMapError, match=re.escape("[B, K]")):
        REFUSALS["stash draft.topk_p rank"][0]()


# ---------------------------------------------------------------------- debug invariants
def test_a_restored_length_of_one_is_positive() -> None:
    """`seq_lens > 0` holds for a length of 1 (a one-token sequence): no false positive."""
    fm = FutureMap(R, debug=True)
    fm.publish(t([1, 2]), t([1, 7]))
    fm.stash(t([1, 2]), t([4, 5]))
    batch = decode([1, 2])
    fm.resolve(batch)
    assert batch.seq_lens.tolist() == [1, 7]
    assert batch.input_ids.tolist() == [4, 5]


def test_a_positive_length_violation_reports_the_lengths_restored() -> None:
    """The report of an unpublished slot names the slot and the non-positive length read
    there, not the lengths of the rows that were fine."""
    fm = FutureMap(R, debug=True)
    fm.publish(t([1]), t([6]))
    fm.stash(t([1, 2]), t([4, 5]))
    with pytest.raises(InvariantViolation) as err:
        fm.resolve(decode([1, 2]))
    assert err.value.invariant == "seq_lens > 0"
    assert err.value.slots == [2]
    assert "lengths [-1]" in str(err.value), str(err.value)  # the poison
    assert "never published" in str(err.value)


def test_a_consume_violation_explains_rr() -> None:
    """The consume report says what happened in the contract's words: a read with no write
    since the last read (RR), or before the first write."""
    fm = FutureMap(R, debug=True)
    fm.publish(t([2]), t([3]))
    with pytest.raises(InvariantViolation) as err:
        fm.resolve(decode([2]))
    assert str(err.value).endswith(
        ": read a slot with no write since its last read (RR) or before its first write"
    ), str(err.value)


def test_a_spec_resolve_consumes_only_the_slots_it_reads() -> None:
    """Debug spec: resolving slot 1's draft poisons slot 1 only; slot 2's unread bonus token
    is still there for its own resolve."""
    fm = FutureMap(R, spec=True, debug=True)
    fm.publish(t([1, 2]), t([4, 4]))
    fm.stash(t([1, 2]), draft([7, 8]))
    first = spec_decode([1])
    fm.resolve(first)
    assert first.draft is not None and first.draft.payload is not None
    assert first.draft.payload.bonus_tokens.tolist() == [7]
    second = spec_decode([2])
    fm.resolve(second)
    assert second.draft is not None and second.draft.payload is not None
    assert second.draft.payload.bonus_tokens.tolist() == [8]
    assert fm.output_tokens.tolist()[1:3] == [-1, -1]


def test_a_sentinel_naming_a_slot_outside_the_batch_consumes_that_slot() -> None:
    """Debug: a read consumes the slot it reads, even one outside the batch's slots, so a
    second read of it is an RR and is caught."""
    fm = FutureMap(R, debug=True)
    fm.stash(t([1, 2]), t([4, 5]))
    batch = extend([2], [-1], [3])
    fm.resolve(batch)
    assert batch.input_ids.tolist() == [4]
    assert fm.output_tokens.tolist()[1] == -1
    with pytest.raises(InvariantViolation) as err:
        fm.resolve(extend([3], [-1], [3]))
    assert err.value.slots == [1]


# ----------------------------------------------------------------- buffers: device, dtype
@pytest.fixture
def float64_default() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def test_buffers_live_on_the_map_device_whatever_the_default_device() -> None:
    """A map built for the CPU keeps every buffer on the CPU, spec extras included, while a
    caller's default device is another one (engines set one during model setup)."""
    payload = draft([7], hidden=True)
    with torch.device("meta"):
        fm = FutureMap(R, device="cpu", spec=True)
        fm.publish(t([1]), t([4]))
        fm.stash(t([1]), payload)
    for name in ("output_tokens", "new_seq_lens", "topk_p", "topk_index", "hidden_states"):
        assert getattr(fm, name).device == torch.device("cpu"), name
    batch = spec_decode([1])
    fm.resolve(batch)
    assert batch.draft is not None and batch.draft.payload is not None
    got = batch.draft.payload
    assert got.bonus_tokens.tolist() == [7]
    assert torch.equal(got.topk_p, payload.topk_p)
    assert got.hidden_states is not None and payload.hidden_states is not None
    assert torch.equal(got.hidden_states, payload.hidden_states)


@pytest.mark.usefixtures("float64_default")
def test_topk_p_is_float32_whatever_the_default_dtype() -> None:
    """topk_p is relayed as float32 (docs/CONTRACT.md's buffer table), also when the caller's
    default float dtype is float64: its bytes come back as stashed."""
    p = torch.tensor([[0.1, 0.7]], dtype=torch.float32)
    fm = FutureMap(R, spec=True)
    fm.stash(t([1]), DraftPayload(t([3]), p, torch.ones((1, 2), dtype=torch.int64)))
    assert fm.topk_p is not None and fm.topk_p.dtype == torch.float32
    batch = spec_decode([1])
    fm.resolve(batch)
    assert batch.draft is not None and batch.draft.payload is not None
    got = batch.draft.payload.topk_p
    assert got.dtype == torch.float32
    assert got.view(torch.int32).tolist() == p.view(torch.int32).tolist()


# ------------------------------------------------- gather protocol and declared draft fields
def gmap(**kw: object) -> FutureMap:
    return FutureMap(R, protocol="gather", **kw)  # type: ignore[arg-type]


def vdraft(bonus: list[int], vid: torch.Tensor, extras: object = None) -> DraftPayload:
    d = draft(bonus)
    d.verified_id = vid
    d.extras = extras  # type: ignore[assignment]
    return d


def vmap(**kw: object) -> FutureMap:
    """A spec map whose first draft brought verified ids (int32 buffers)."""
    fm = FutureMap(R, spec=True, dtype=torch.int32, **kw)  # type: ignore[arg-type]
    fm.stash(t([1]), vdraft([3], t([4])))
    return fm


def gbatch(mode: ForwardMode, **kw: object) -> ScheduleBatch:
    fields: dict[str, object] = {
        "req_pool_indices": t([1]),
        "input_ids": t([5]),
        "seq_lens": t([2]),
    }
    fields.update(kw)
    return ScheduleBatch(mode, **fields)  # type: ignore[arg-type]


# (call, the start of its refusal, exactly)
EXACT: dict[str, tuple[Callable[[], object], str]] = {
    "verified id too wide": (
        lambda: vmap().stash(t([1]), vdraft([3], t([2**31]))),
        "draft.verified_id holds values that do not fit",
    ),
    "verified id negative": (
        lambda: vmap().stash(t([1]), vdraft([3], t([-4]))),
        "draft.verified_id holds negative values",
    ),
    "verified id of another rank": (
        lambda: vmap().stash(t([1]), vdraft([3], wide([4]))),
        "draft.verified_id must be 1-D",
    ),
    "verified id of other rows": (
        lambda: vmap().stash(t([1]), vdraft([3], t([4, 4]))),
        "draft.verified_id has 2 rows",
    ),
    "verified ids dropped": (
        lambda: vmap().stash(t([1]), draft([3])),
        "draft does not match the first draft stashed: expected verified_id",
    ),
    "verified ids added": (
        lambda: spec_map().stash(t([1]), vdraft([3], t([4]))),
        "draft does not match the first draft stashed: expected no verified_id",
    ),
    "extras keyed by a non-name": (
        lambda: spec_map().stash(t([1]), vdraft([3], None, {1: t([2])})),
        "draft.extras must be a dict of name -> tensor",
    ),
    "running indices on a sentinel map": (
        lambda: FutureMap(R).resolve(gbatch(ForwardMode.MIXED, mix_running_indices=t([1]))),
        "mix_running_indices is for the gather protocol; this map relays by sentinels",
    ),
    "no ids on a sentinel map": (
        lambda: FutureMap(R).resolve(gbatch(ForwardMode.EXTEND, input_ids=None)),
        "input_ids is None: the sentinel protocol needs every batch's ids",
    ),
    "gather: slots of another rank": (
        lambda: gmap().resolve(gbatch(ForwardMode.EXTEND, req_pool_indices=wide([1]))),
        "req_pool_indices must be 1-D",
    ),
    "gather: lengths of another rank": (
        lambda: gmap().resolve(gbatch(ForwardMode.EXTEND, seq_lens=wide([1]))),
        "seq_lens must be 1-D",
    ),
    "gather: lengths too wide": (
        lambda: gmap(dtype=torch.int32).resolve(gbatch(ForwardMode.EXTEND, seq_lens=t([2**31]))),
        "seq_lens holds values that do not fit",
    ),
    "gather: ids given to a DECODE batch": (
        lambda: gmap().resolve(gbatch(ForwardMode.DECODE)),
        "input_ids given for a DECODE batch: in the gather protocol its ids are gathered",
    ),
    "gather: MIXED without running rows": (
        lambda: gmap().resolve(gbatch(ForwardMode.MIXED)),
        "mix_running_indices is required for a MIXED batch in the gather protocol",
    ),
    "gather: a draft on a non-spec map": (
        lambda: gmap().resolve(
            gbatch(ForwardMode.DECODE, input_ids=None, draft=DraftInput(t([1])))
        ),
        "batch.draft given but this FutureMap has spec=False",
    ),
    "gather: draft indices of another rank": (
        lambda: gmap(spec=True).resolve(gbatch(ForwardMode.DECODE, draft=DraftInput(wide([1])))),
        "draft.indices must be 1-D",
    ),
    "gather: a draft before any was stashed": (
        lambda: gmap(spec=True).resolve(gbatch(ForwardMode.DECODE, draft=DraftInput(t([1])))),
        "resolve of spec extras before any draft was stashed",
    ),
    "gather: invalidate": (
        lambda: gmap().invalidate(gbatch(ForwardMode.DECODE), t([1])),
        "invalidate: the gather protocol leaves no sentinels",
    ),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_a_gather_or_declared_field_refusal_says_exactly_what(case: str) -> None:
    """Each refusal of the gather protocol and of the declared draft fields starts with the
    field at fault and what is wrong with it, spelt exactly (case included)."""
    call, start = EXACT[case]
    with pytest.raises(FutureMapError) as err:
        call()
    assert str(err.value).startswith(start), str(err.value)


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_a_tracked_field_of_several_values_per_row_is_checked_whole(protocol: str) -> None:
    """A consume-tracked extra of two values per row: a row read back whole is fine, a row
    with one -1 left (the poison of a read, its second value restored) is an RR; a value 0
    is a value, not the poison; padding (slot 0) is never checked."""
    fm = FutureMap(R, spec=True, debug=True, consumed=("pair",), protocol=protocol)

    def batch(slots: list[int]) -> ScheduleBatch:
        ids = t([0] * len(slots)) if protocol == "gather" else t([-s for s in slots])
        return ScheduleBatch(ForwardMode.DECODE, t(slots), ids, ids.clone(), DraftInput(t(slots)))

    pair = torch.tensor([[0, 7], [5, 0]], dtype=torch.int64)
    fm.publish(t([1, 2]), t([3, 3]))
    fm.stash(t([1, 2]), vdraft([3, 4], None, {"pair": pair}))
    fm.resolve(batch([0, 1, 2]) if protocol == "sentinel" else batch([1, 2]))
    assert fm.extras["pair"][1].tolist() == [-1, -1]
    fm.stash(t([1]), vdraft([3], None, {"pair": torch.tensor([[0, 0]])}))
    fm.extras["pair"][1, 1] = -1  # one value of the row still the poison
    fm.publish(t([1]), t([4]))  # its length published again (a resolve consumed it)
    with pytest.raises(InvariantViolation, match=r"consume \(WRWR\)"):
        fm.resolve(batch([1]))
    fm.extras["pair"][1, 1] = 0
    fm.resolve(batch([0, 1]))  # padding slot 0 reads -1 everywhere: not checked
