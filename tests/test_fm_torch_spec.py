"""fm_torch spec extras: bit-for-bit round trip through stash/resolve, and lazy shaping.

"Bit for bit" compares raw bytes (tensor.view(torch.uint8)), so NaN payloads, -0.0 and the
infinities must come back exactly as stashed; a float compare would hide a canonicalised NaN
or a -0.0 turned into +0.0.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fm_torch import DraftInput, DraftPayload, ForwardMode, FutureMap, FutureMapError, ScheduleBatch

R = 6
HIDDEN_DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# float32 bit patterns: quiet NaN, NaN with payload, negative NaN, signalling NaN, -0.0, +0.0,
# +inf, -inf, smallest subnormal, largest finite.
F32_SPECIAL = [
    0x7FC00000,
    0x7FC00123,
    -0x00400000,  # 0xFFC00000 as int32
    0x7F800001,
    -0x80000000,  # 0x80000000 (-0.0) as int32
    0x00000000,
    0x7F800000,
    -0x00800000,  # 0xFF800000 (-inf)
    0x00000001,
    0x7F7FFFFF,
]
# 16-bit patterns for bf16 and f16: NaN, NaN payload, -0.0, +inf, -inf, 1.0-ish, subnormal.
B16_SPECIAL = {
    torch.bfloat16: [0x7FC0, 0x7FC1, -0x8000, 0x7F80, -0x0080, 0x3F80, 0x0001, -0x0040],
    torch.float16: [0x7E00, 0x7E01, -0x8000, 0x7C00, -0x0400, 0x3C00, 0x0001, -0x0200],
}


def raw(x: torch.Tensor) -> bytes:
    return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def row_bytes(x: torch.Tensor, rows: list[int]) -> bytes:
    """Raw bytes of rows of `x`, gathered on the byte view (no float arithmetic involved)."""
    u8 = x.detach().cpu().contiguous().reshape(x.shape[0], -1).view(torch.uint8)
    return b"".join(u8[r].numpy().tobytes() for r in rows)


def special_f32(rows: int, k: int) -> torch.Tensor:
    n = rows * k
    bits = torch.tensor([F32_SPECIAL[i % len(F32_SPECIAL)] for i in range(n)], dtype=torch.int32)
    return bits.view(torch.float32).reshape(rows, k)


def special_hidden(rows: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return special_f32(rows, h)
    pats = B16_SPECIAL[dtype]
    bits = torch.tensor([pats[i % len(pats)] for i in range(rows * h)], dtype=torch.int16)
    return bits.view(dtype).reshape(rows, h)


def spec_decode(slots: list[int], draft_slots: list[int]) -> ScheduleBatch:
    s = [-x for x in slots]
    return ScheduleBatch(
        ForwardMode.DECODE,
        torch.tensor(slots),
        torch.tensor(s),
        torch.tensor(s),
        DraftInput(torch.tensor(draft_slots)),
    )


@pytest.mark.parametrize("hidden_dtype", [*HIDDEN_DTYPES, None])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("debug", [False, True])
def test_spec_extras_round_trip_bit_for_bit(
    hidden_dtype: torch.dtype | None, dtype: torch.dtype, debug: bool
):
    """Pins: NaN payloads, -0.0 or infinities altered on the way through the buffers, hidden
    states cast to another float type, or extras gathered from the wrong slot."""
    k, h = 5, 7
    fm = FutureMap(R, dtype=dtype, spec=True, debug=debug)
    slots = [3, 1, 5]
    info = torch.iinfo(dtype)
    draft = DraftPayload(
        bonus_tokens=torch.tensor([0, info.max, 17], dtype=dtype),
        topk_p=special_f32(3, k),
        topk_index=torch.tensor(
            [[info.min, -1, 0, 1, info.max]] * 3, dtype=dtype
        ),  # buffer content is opaque to the relay: any int round-trips
        hidden_states=None if hidden_dtype is None else special_hidden(3, h, hidden_dtype),
    )
    fm.publish(torch.tensor(slots), torch.tensor([4, 4, 4]))
    fm.stash(torch.tensor(slots), draft)

    # Stored rows are the stashed rows, byte for byte.
    assert fm.topk_p is not None and fm.topk_index is not None
    assert row_bytes(fm.topk_p, slots) == raw(draft.topk_p)
    assert row_bytes(fm.topk_index, slots) == raw(draft.topk_index)
    if hidden_dtype is None:
        assert fm.hidden_states is None
    else:
        assert fm.hidden_states is not None and draft.hidden_states is not None
        assert fm.hidden_states.dtype == hidden_dtype
        assert row_bytes(fm.hidden_states, slots) == raw(draft.hidden_states)

    # Resolve in another order: row i of the gather is the stash row of that slot.
    order = [5, 3, 1]
    perm = [slots.index(s) for s in order]
    batch = spec_decode(order, order)
    fm.resolve(batch)
    assert batch.draft is not None and batch.draft.payload is not None
    got = batch.draft.payload
    assert raw(got.bonus_tokens) == row_bytes(draft.bonus_tokens, perm)
    assert raw(got.topk_p) == row_bytes(draft.topk_p, perm)
    assert raw(got.topk_index) == row_bytes(draft.topk_index, perm)
    assert got.topk_p.dtype == torch.float32 and got.topk_index.dtype == dtype
    if draft.hidden_states is None:
        assert got.hidden_states is None
    else:
        assert got.hidden_states is not None
        assert got.hidden_states.dtype == hidden_dtype
        assert raw(got.hidden_states) == row_bytes(draft.hidden_states, perm)
    # The special values are really there (the comparison above is not vacuous).
    assert torch.isnan(got.topk_p).any() and torch.isinf(got.topk_p).any()
    assert torch.signbit(got.topk_p[got.topk_p == 0]).any()


def test_special_patterns_are_distinct_under_byte_compare():
    """Pins: the byte comparison itself treating -0.0 as 0.0 or NaN payloads as equal."""
    neg, pos = special_f32(1, 10)[0, 4:6]
    assert bool(neg == pos) and raw(neg) != raw(pos)
    a, b = special_f32(1, 10)[0, 0:2]
    assert raw(a) != raw(b)


@settings(max_examples=25, deadline=None)
@given(
    bits=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=4, max_size=4),
    hbits=st.lists(st.integers(-(2**15), 2**15 - 1), min_size=6, max_size=6),
    hidden_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_arbitrary_bit_patterns_round_trip(bits: list[int], hbits: list[int], hidden_dtype):
    """Pins: any float32 / 16-bit pattern (every NaN payload) changing in the relay."""
    fm = FutureMap(R, spec=True, debug=False)
    p = torch.tensor(bits, dtype=torch.int32).view(torch.float32).reshape(2, 2)
    hid = torch.tensor(hbits, dtype=torch.int16).view(hidden_dtype).reshape(2, 3)
    fm.stash(
        torch.tensor([2, 4]),
        DraftPayload(torch.tensor([1, 2]), p, torch.zeros((2, 2), dtype=torch.int64), hid),
    )
    batch = spec_decode([4, 2], [4, 2])
    fm.resolve(batch)
    assert batch.draft is not None and batch.draft.payload is not None
    got = batch.draft.payload
    assert got.hidden_states is not None
    assert raw(got.topk_p) == row_bytes(p, [1, 0])
    assert raw(got.hidden_states) == row_bytes(hid, [1, 0])


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_draft_indices_not_one_per_row_are_refused(protocol):
    """Defect (reliability round two, 4, fm_torch): the sentinel protocol took draft indices
    of another length than the batch (the gather protocol refused them), as fm_jax refuses
    them in both. One draft slot per row, refused by name before anything is written."""
    fm = FutureMap(R, spec=True, protocol=protocol)
    z = torch.zeros((2, 1))
    fm.stash(torch.tensor([2, 4]), DraftPayload(torch.tensor([1, 2]), z, z.long(), z))
    before = {k: raw(v) for k, v in vars(fm).items() if isinstance(v, torch.Tensor)}
    for draft in ([4], [4, 2, 2]):
        batch = spec_decode([4, 2], draft)
        if protocol == "gather":
            batch.input_ids = torch.tensor([1, 2])
            batch.seq_lens = torch.tensor([1, 1])
        with pytest.raises(FutureMapError, match="draft.indices has .* rows, indices have 2"):
            fm.resolve(batch)
        assert batch.draft is not None and batch.draft.payload is None
    assert {k: raw(v) for k, v in vars(fm).items() if isinstance(v, torch.Tensor)} == before


# ------------------------------------------------------------------------------ lazy shaping
def test_extras_are_shaped_by_the_first_non_empty_draft():
    """Pins: an idle rank's empty draft (or an up-front guess) fixing K, H or the hidden dtype."""
    fm = FutureMap(R, spec=True, debug=False)
    empty = DraftPayload(
        torch.zeros(0, dtype=torch.int64),
        torch.zeros((0, 9)),
        torch.zeros((0, 9), dtype=torch.int64),
        torch.zeros((0, 11), dtype=torch.float32),
    )
    fm.stash(torch.zeros(0, dtype=torch.int64), empty)
    assert fm.topk_p is None and fm.topk_index is None and fm.hidden_states is None
    first = DraftPayload(
        torch.tensor([5]),
        torch.full((1, 3), 0.25),
        torch.full((1, 3), 2, dtype=torch.int64),
        torch.full((1, 4), 1.0, dtype=torch.float16),
    )
    fm.stash(torch.tensor([2]), first)
    assert fm.topk_p is not None and fm.topk_index is not None and fm.hidden_states is not None
    assert fm.topk_p.shape == (R, 3) and fm.topk_p.dtype == torch.float32
    assert fm.topk_index.shape == (R, 3) and fm.topk_index.dtype == torch.int64
    assert fm.hidden_states.shape == (R, 4) and fm.hidden_states.dtype == torch.float16
    # Rows never stashed start at zero.
    assert raw(fm.topk_p[[0, 1, 3, 4, 5]]) == bytes(5 * 3 * 4)
    # A later draft with the same shapes (another batch size) is accepted.
    fm.stash(
        torch.tensor([1, 3]),
        DraftPayload(
            torch.tensor([6, 7]),
            torch.full((2, 3), 0.5),
            torch.full((2, 3), 1, dtype=torch.int32),
            torch.full((2, 4), 2.0, dtype=torch.float16),
        ),
    )
    assert fm.output_tokens.tolist() == [0, 6, 5, 7, 0, 0]


def test_empty_draft_after_lazy_init_is_a_no_op_even_if_shapes_differ():
    """Pins: an idle rank raising on an empty draft whose placeholder K or H differ."""
    fm = FutureMap(R, spec=True, debug=False)
    fm.stash(
        torch.tensor([1]),
        DraftPayload(torch.tensor([5]), torch.ones((1, 2)), torch.ones((1, 2), dtype=torch.int64)),
    )
    before = raw(fm.output_tokens)
    fm.stash(
        torch.zeros(0, dtype=torch.int64),
        DraftPayload(
            torch.zeros(0, dtype=torch.int64), torch.zeros((0, 8)), torch.zeros((0, 8)), None
        ),
    )
    assert raw(fm.output_tokens) == before
