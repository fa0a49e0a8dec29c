"""fm_torch.FutureMap op semantics against hand-worked expectations (docs/CONTRACT.md,
'Operations').

Every test runs on CPU; the `device` parameter also runs it on CUDA, skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from fm_torch import DraftInput, DraftPayload, ForwardMode, FutureMap, ScheduleBatch

NO_CUDA = "needs a CUDA device; torch.cuda.is_available() is False on this machine"
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)],
    ),
]
INT_DTYPES = [torch.int64, torch.int32]


def t(values: list[int], device: str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D int tensor on `device`."""
    return torch.tensor(values, dtype=dtype, device=device)


def decode_batch(slots: list[int], device: str, dtype: torch.dtype) -> ScheduleBatch:
    """A DECODE batch as invalidate leaves it: ids and lengths are -slot sentinels."""
    sentinel = [-s for s in slots]
    return ScheduleBatch(
        ForwardMode.DECODE, t(slots, device), t(sentinel, device, dtype), t(sentinel, device, dtype)
    )


def as_list(x: torch.Tensor) -> list[int]:
    return [int(v) for v in x.cpu().tolist()]


# ------------------------------------------------------------------------------ construction
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_initial_buffers_are_zero_and_of_the_requested_dtype(device: str, dtype: torch.dtype):
    """Pins: buffers starting undefined (torch.empty) or in int64 when int32 was asked for."""
    fm = FutureMap(6, device=device, dtype=dtype, debug=False)
    for buf in (fm.output_tokens, fm.new_seq_lens):
        assert buf.dtype == dtype
        assert buf.shape == (6,)
        assert buf.device.type == device
        assert as_list(buf) == [0] * 6
    assert fm.topk_p is None and fm.topk_index is None and fm.hidden_states is None


def test_default_dtype_is_int64_as_sglang():
    """Pins: a default int dtype other than SGLang's int64."""
    fm = FutureMap(3, debug=False)
    assert fm.dtype == torch.int64
    assert fm.output_tokens.dtype == torch.int64 and fm.new_seq_lens.dtype == torch.int64


def test_debug_mode_poisons_tokens_and_lengths():
    """Pins: debug mode not starting output_tokens and new_seq_lens at -1 (SGLang's
    poisoned init), or a map without debug starting anywhere but 0."""
    fm = FutureMap(4, debug=True)
    assert as_list(fm.output_tokens) == [-1, -1, -1, -1]
    assert as_list(fm.new_seq_lens) == [-1, -1, -1, -1]
    plain = FutureMap(4, debug=False)
    assert as_list(plain.output_tokens) == as_list(plain.new_seq_lens) == [0, 0, 0, 0]


# ---------------------------------------------------------------------------------- publish
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_publish_writes_lengths_at_slots_only(device: str, dtype: torch.dtype):
    """Pins: publish writing rows in batch order instead of at the slots, or touching tokens."""
    fm = FutureMap(5, device=device, dtype=dtype, debug=False)
    fm.publish(t([4, 2], device), t([9, 7], device))
    assert as_list(fm.new_seq_lens) == [0, 0, 7, 0, 9]
    assert fm.new_seq_lens.dtype == dtype
    assert as_list(fm.output_tokens) == [0] * 5
    # A later publish overwrites only its own slots.
    fm.publish(t([2], device, torch.int32), t([11], device, torch.int32))
    assert as_list(fm.new_seq_lens) == [0, 0, 11, 0, 9]


@pytest.mark.parametrize("device", DEVICES)
def test_publish_casts_lengths_to_the_buffer_dtype(device: str):
    """Pins: an int64 length written into an int32 buffer changing the buffer's dtype."""
    fm = FutureMap(3, device=device, dtype=torch.int32, debug=False)
    fm.publish(t([1], device, torch.int32), t([2**31 - 1], device, torch.int64))
    assert fm.new_seq_lens.dtype == torch.int32
    assert as_list(fm.new_seq_lens) == [0, 2**31 - 1, 0]


# ------------------------------------------------------------------------------------ stash
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_stash_writes_tokens_at_slots_only(device: str, dtype: torch.dtype):
    """Pins: stash writing rows in batch order, or writing lengths."""
    fm = FutureMap(5, device=device, dtype=dtype, debug=False)
    fm.stash(t([3, 1], device), t([42, 5], device, dtype))
    assert as_list(fm.output_tokens) == [0, 5, 0, 42, 0]
    assert fm.output_tokens.dtype == dtype
    assert as_list(fm.new_seq_lens) == [0] * 5


@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows_write_garbage_to_slot_zero_only(device: str):
    """Pins: padding rows (slot 0, possibly repeated) being rejected or landing on live slots."""
    fm = FutureMap(4, device=device, debug=False)
    fm.stash(t([0, 2, 0], device), t([77, 8, 77], device))
    fm.publish(t([0, 2, 0], device), t([5, 3, 5], device))
    assert as_list(fm.output_tokens) == [77, 0, 8, 0]
    assert as_list(fm.new_seq_lens) == [5, 0, 3, 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [False, True])
def test_idle_publish_and_stash_are_no_ops(device: str, spec: bool):
    """Pins: an idle DP rank (empty indices) writing, raising, or shaping the spec buffers."""
    fm = FutureMap(4, device=device, spec=spec, debug=False)
    before = [fm.output_tokens.clone(), fm.new_seq_lens.clone()]
    empty = t([], device)
    fm.publish(empty, empty)
    if spec:
        fm.stash(
            empty,
            DraftPayload(
                empty,
                torch.zeros((0, 3), device=device),
                torch.zeros((0, 3), dtype=torch.int64, device=device),
            ),
        )
        # An empty draft does not fix K or H: lazy shaping waits for a non-empty one.
        assert fm.topk_p is None and fm.topk_index is None and fm.hidden_states is None
    else:
        fm.stash(empty, empty)
    assert torch.equal(fm.output_tokens, before[0])
    assert torch.equal(fm.new_seq_lens, before[1])
    assert fm.publish_ready is None


@pytest.mark.parametrize("device", DEVICES)
def test_idle_batch_resolve_and_invalidate_leave_everything_unchanged(device: str):
    """Pins: an IDLE batch (no rows) failing in resolve or invalidate, or writing buffers."""
    fm = FutureMap(4, device=device, debug=True)
    fm.stash(t([1], device), t([3], device))
    before = fm.output_tokens.clone()
    batch = ScheduleBatch(ForwardMode.IDLE, t([], device), t([], device), t([], device))
    fm.resolve(batch)
    assert batch.input_ids.numel() == 0 and batch.seq_lens.numel() == 0
    fm.invalidate(batch, t([], device))
    assert batch.input_ids.numel() == 0 and batch.seq_lens.numel() == 0
    assert torch.equal(fm.output_tokens, before)


# ---------------------------------------------------------------------------------- resolve
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_resolve_decode_restores_lengths_and_tokens(device: str, dtype: torch.dtype):
    """Pins: DECODE not restoring seq_lens from new_seq_lens, or gathering by row not slot."""
    fm = FutureMap(5, device=device, dtype=dtype, debug=False)
    fm.publish(t([1, 3], device), t([10, 20], device))
    fm.stash(t([1, 3], device), t([6, 42], device))
    batch = decode_batch([3, 1, 0], device, dtype)
    fm.resolve(batch)
    assert as_list(batch.input_ids) == [42, 6, 0]
    assert as_list(batch.seq_lens) == [20, 10, 0]
    assert batch.input_ids.dtype == dtype and batch.seq_lens.dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
def test_resolve_extend_changes_nothing(device: str):
    """Pins: EXTEND rows' real ids or lengths being overwritten by resolve (no length restore)."""
    fm = FutureMap(4, device=device, debug=False)
    fm.publish(t([1, 2], device), t([50, 60], device))
    fm.stash(t([0, 1, 2], device), t([99, 98, 97], device))
    batch = ScheduleBatch(
        ForwardMode.EXTEND, t([2, 1], device), t([5, 0, 7, 3, 1], device), t([3, 2], device)
    )
    fm.resolve(batch)
    assert as_list(batch.input_ids) == [5, 0, 7, 3, 1]
    assert as_list(batch.seq_lens) == [3, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_resolve_mixed_resolves_tail_ids_and_keeps_host_lengths(device: str):
    """Pins: MIXED being treated as DECODE (lengths restored) or its tail sentinels not resolved."""
    fm = FutureMap(5, device=device, debug=False)
    fm.publish(t([1, 3], device), t([11, 12], device))
    fm.stash(t([1, 3], device), t([0, 8], device))
    # Prefill row for slot 2 (3 tokens), then running decode rows for slots 3 and 1.
    batch = ScheduleBatch(
        ForwardMode.MIXED,
        t([2, 3, 1], device),
        t([4, 4, 9, -3, -1], device),
        t([3, 12, 11], device),
    )
    fm.resolve(batch)
    assert as_list(batch.input_ids) == [4, 4, 9, 8, 0]
    assert as_list(batch.seq_lens) == [3, 12, 11]


@pytest.mark.parametrize("device", DEVICES)
def test_token_zero_passes_through_and_is_never_a_reference(device: str):
    """Pins: a real token 0 being read as the sentinel of slot 0 (test `< 0`, not `<= 0`)."""
    fm = FutureMap(3, device=device, debug=False)
    fm.stash(t([0, 1], device), t([55, 66], device))  # garbage in the padding row
    batch = ScheduleBatch(ForwardMode.EXTEND, t([1], device), t([0, 0, 3], device), t([3], device))
    fm.resolve(batch)
    assert as_list(batch.input_ids) == [0, 0, 3]
    # A stashed token 0 resolves to 0, not to a sentinel or to slot 0's content.
    fm.stash(t([2], device), t([0], device))
    batch = decode_batch([2, 0], device, torch.int64)
    fm.resolve(batch)
    assert as_list(batch.input_ids) == [0, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_resolved_tensors_do_not_alias_the_buffers(device: str):
    """Pins: resolve handing out views of the buffers, which a later stash would rewrite."""
    fm = FutureMap(3, device=device, debug=False)
    fm.publish(t([1], device), t([4], device))
    fm.stash(t([1], device), t([9], device))
    batch = decode_batch([1], device, torch.int64)
    fm.resolve(batch)
    fm.publish(t([1], device), t([5], device))
    fm.stash(t([1], device), t([10], device))
    assert as_list(batch.input_ids) == [9] and as_list(batch.seq_lens) == [4]
    batch.input_ids += 100
    batch.seq_lens += 100
    assert as_list(fm.output_tokens) == [0, 10, 0] and as_list(fm.new_seq_lens) == [0, 5, 0]


# ------------------------------------------------------------------------------- invalidate
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_invalidate_sets_minus_slot_sentinels(device: str, dtype: torch.dtype):
    """Pins: sentinels other than -slot, a nonzero padding sentinel, or a flat extend id left."""
    fm = FutureMap(5, device=device, dtype=dtype, debug=False)
    batch = ScheduleBatch(
        ForwardMode.EXTEND, t([3, 0, 1], device), t([7, 7, 7, 7, 7], device), t([2, 1, 2], device)
    )
    fm.invalidate(batch, t([3, 0, 1], device))
    assert as_list(batch.input_ids) == [-3, 0, -1]
    assert as_list(batch.seq_lens) == [-3, 0, -1]
    assert batch.input_ids.dtype == dtype and batch.seq_lens.dtype == dtype
    # input_ids and seq_lens are separate tensors: rewriting one leaves the other.
    batch.seq_lens[0] = 123
    assert as_list(batch.input_ids) == [-3, 0, -1]


@pytest.mark.parametrize("device", DEVICES)
def test_invalidate_then_resolve_round_trips(device: str):
    """Pins: invalidate's sentinels not naming the slots that the same step published/stashed."""
    fm = FutureMap(6, device=device, debug=True)
    batch = ScheduleBatch(
        ForwardMode.EXTEND, t([5, 2], device), t([1, 2, 3, 4], device), t([3, 1], device)
    )
    fm.resolve(batch)
    fm.publish(t([5, 2], device), t([4, 2], device))
    fm.stash(t([5, 2], device), t([31, 0], device))
    fm.invalidate(batch, t([5, 2], device))
    batch.forward_mode = ForwardMode.DECODE
    fm.resolve(batch)
    assert as_list(batch.input_ids) == [31, 0]
    assert as_list(batch.seq_lens) == [4, 2]


# ---------------------------------------------------------------------------- spec resolve
def spec_draft(rows: int, k: int, h: int | None, device: str, base: float = 0.0) -> DraftPayload:
    """A draft payload whose every value is distinct and traceable to (row, column)."""
    p = torch.arange(rows * k, dtype=torch.float32, device=device).reshape(rows, k) / 8 + base
    idx = torch.arange(rows * k, dtype=torch.int64, device=device).reshape(rows, k) + 100
    hid = None
    if h is not None:
        hid = torch.arange(rows * h, dtype=torch.float32, device=device).reshape(rows, h) - 3
    bonus = torch.arange(rows, dtype=torch.int64, device=device) + 1000
    return DraftPayload(bonus, p, idx, hid)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("hidden", [None, 4])
def test_spec_stash_then_resolve_gathers_extras_by_slot(
    device: str, dtype: torch.dtype, hidden: int | None
):
    """Pins: spec extras gathered by row instead of slot, or bonus tokens not from output_tokens."""
    fm = FutureMap(5, device=device, dtype=dtype, spec=True, debug=False)
    draft = spec_draft(2, 3, hidden, device)
    fm.stash(t([4, 1], device), draft)
    assert as_list(fm.output_tokens) == [0, 1001, 0, 0, 1000]
    assert fm.topk_p is not None and fm.topk_p.shape == (5, 3)
    assert fm.topk_index is not None and fm.topk_index.dtype == dtype
    fm.publish(t([4, 1], device), t([7, 3], device))
    batch = decode_batch([1, 4], device, dtype)
    batch.draft = DraftInput(t([1, 4], device))
    fm.resolve(batch)
    assert as_list(batch.seq_lens) == [3, 7]
    # Spec resolve leaves input_ids alone: the draft carries the next ids.
    assert as_list(batch.input_ids) == [-1, -4]
    got = batch.draft.payload
    assert got is not None
    assert as_list(got.bonus_tokens) == [1001, 1000]
    assert torch.equal(got.topk_p, draft.topk_p[[1, 0]])
    assert torch.equal(got.topk_index, draft.topk_index[[1, 0]].to(dtype))
    if hidden is None:
        assert got.hidden_states is None and fm.hidden_states is None
    else:
        assert draft.hidden_states is not None and got.hidden_states is not None
        assert torch.equal(got.hidden_states, draft.hidden_states[[1, 0]])


@pytest.mark.parametrize("device", DEVICES)
def test_spec_resolve_without_draft_input_is_a_no_op(device: str):
    """Pins: a spec prefill batch (no draft input) being rewritten by resolve."""
    fm = FutureMap(4, device=device, spec=True, debug=True)
    batch = ScheduleBatch(ForwardMode.EXTEND, t([2], device), t([3, 0, 5], device), t([3], device))
    fm.resolve(batch)
    assert as_list(batch.input_ids) == [3, 0, 5]
    assert as_list(batch.seq_lens) == [3]
    assert batch.draft is None
    # No gather happened: the poison is intact and nothing was consumed.
    assert as_list(fm.output_tokens) == [-1] * 4


@pytest.mark.parametrize("device", DEVICES)
def test_spec_decode_restores_lengths_after_variable_accepts(device: str):
    """Pins: spec DECODE lengths not coming from publish (the host cannot know accept lengths)."""
    fm = FutureMap(4, device=device, spec=True, debug=False)
    fm.publish(t([1, 2], device), t([10, 10], device))
    fm.stash(t([1, 2], device), spec_draft(2, 2, None, device))
    batch = decode_batch([1, 2], device, torch.int64)
    batch.draft = DraftInput(t([1, 2], device))
    fm.resolve(batch)
    assert as_list(batch.seq_lens) == [10, 10]
    # Verification accepted 3 drafts on slot 1, 1 on slot 2: seq_lens + accept_len.
    fm.publish(t([1, 2], device), batch.seq_lens + t([3, 1], device))
    fm.stash(t([1, 2], device), spec_draft(2, 2, None, device, base=1.0))
    fm.invalidate(batch, t([1, 2], device))
    batch.draft = DraftInput(t([1, 2], device))
    assert as_list(fm.resolve_seq_lens_cpu(t([1, 2], device))) == [13, 11]
    fm.resolve(batch)
    assert as_list(batch.seq_lens) == [13, 11]


# ---------------------------------------------------------------------- resolve_seq_lens_cpu
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_resolve_seq_lens_cpu_is_a_host_copy_in_index_order(device: str, dtype: torch.dtype):
    """Pins: resolve_seq_lens_cpu returning a device tensor, a view, or slots in the wrong order."""
    fm = FutureMap(5, device=device, dtype=dtype, spec=True, debug=False)
    fm.publish(t([2, 3, 4], device), t([20, 30, 40], device))
    got = fm.resolve_seq_lens_cpu(t([4, 0, 2], device))
    assert got.device.type == "cpu"
    assert got.dtype == dtype
    assert got.tolist() == [40, 0, 20]
    got[0] = -7
    assert as_list(fm.new_seq_lens) == [0, 0, 20, 30, 40]


# ------------------------------------------------------------------------------------- cuda
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_spec_publish_records_publish_ready_on_the_forward_stream():
    """Pins: resolve_seq_lens_cpu reading lengths before the forward stream's publish landed."""
    fm = FutureMap(8, device="cuda", spec=True, debug=False)
    idx = t([1, 2, 3], "cuda")
    with fm.forward_stream():
        # A long kernel queued before publish: without the event wait the host read races it.
        x = torch.randn(2048, 2048, device="cuda")
        for _ in range(20):
            x = x @ x / 2048
        # `depends` is 0 whatever x holds (inf and NaN included), but only once x is computed.
        depends = (x.sum() > float("inf")).to(torch.int64)
        fm.publish(idx, t([5, 6, 7], "cuda") + depends)
    assert fm.publish_ready is not None
    assert fm.resolve_seq_lens_cpu(idx).tolist() == [5, 6, 7]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_forward_stream_is_separate_and_waits_for_the_schedule_stream():
    """Pins: the forward running on the schedule stream, or not seeing the schedule's writes."""
    fm = FutureMap(4, device="cuda", debug=False)
    schedule = torch.cuda.current_stream()
    ids = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    fm.stash(t([1], "cuda"), t([9], "cuda"))
    with fm.forward_stream():
        assert torch.cuda.current_stream() != schedule
        batch = ScheduleBatch(ForwardMode.DECODE, t([1], "cuda"), ids, ids.clone())
        fm.resolve(batch)
    torch.cuda.synchronize()
    assert batch.input_ids.tolist() == [9]


def test_cpu_forward_stream_is_a_no_op_context():
    """Pins: the CPU path requiring CUDA streams or events."""
    fm = FutureMap(3, spec=True, debug=False)
    with fm.forward_stream():
        fm.publish(t([1], "cpu"), t([4], "cpu"))
    assert fm.publish_ready is None
    assert fm.resolve_seq_lens_cpu(t([1], "cpu")).tolist() == [4]
