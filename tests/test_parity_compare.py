"""The bitwise comparator: raw bytes decide, and the first divergence names where (rank,
step, op, field, slot). What parity compares: docs/CONTRACT.md, 'What parity compares'."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fm_parity.compare import compare_traces, first_difference
from fm_parity.trace import Field, OpRecord, RunResult, merge


def _run(*records: OpRecord, error: str | None = None) -> RunResult:
    return RunResult(records=list(records), error=error)


def _rec(step: int, op: str, rank: int = 0, **fields: np.ndarray) -> OpRecord:
    slots = {k: Field(v, np.arange(1, 1 + len(v))) for k, v in fields.items()}
    return OpRecord(step, op, slots, rank)


def test_equal_arrays_have_no_difference():
    """A comparator that reports equal arrays as different would drown real divergences."""
    a = np.array([1, 2, 3], np.int32)
    assert first_difference(a, a.copy()) is None


def test_flipped_byte_is_found_with_its_entry():
    """One flipped byte in one entry must be caught and located (not just 'arrays differ')."""
    a = np.arange(8, dtype=np.int64)
    b = a.copy()
    b.view(np.uint8)[5 * 8 + 3] ^= 0x10
    index, va, vb = first_difference(a, b)
    assert index == (5,)
    assert va.startswith("5 ") and vb != va


def test_nan_equals_nan_with_the_same_payload():
    """Value comparison says NaN != NaN; bitwise comparison must call identical NaNs equal."""
    a = np.array([0x7FC01234], np.int32).view(np.float32)
    assert first_difference(a, a.copy()) is None


def test_nan_payload_difference_is_a_divergence():
    """Two NaNs with different payloads are different bytes (a canonicalising copy is a bug)."""
    a = np.array([0x7FC01234], np.int32).view(np.float32)
    b = np.array([0x7FC00000], np.int32).view(np.float32)
    diff = first_difference(a, b)
    assert diff is not None and "0x7fc01234" in diff[1] and "0x7fc00000" in diff[2]


def test_negative_zero_differs_from_zero():
    """-0.0 == 0.0 by value; a relay that loses the sign bit must still be caught."""
    a = np.array([0.0, -0.0], np.float32)
    b = np.array([0.0, 0.0], np.float32)
    assert first_difference(a, b)[0] == (1,)


def test_bf16_nan_payload_difference_is_a_divergence():
    """bf16 hidden states are compared by their 16-bit patterns, payload included."""
    a = np.array([[0x7FC1, 0]], np.int16).view(ml_dtypes.bfloat16)
    b = np.array([[0x7FC0, 0]], np.int16).view(ml_dtypes.bfloat16)
    assert first_difference(a, b)[0] == (0, 0)


def test_dtype_and_shape_mismatches_are_divergences():
    """Same values in another dtype or shape are not the same bytes (int32 vs int64 buffers)."""
    a = np.array([1, 2], np.int32)
    assert first_difference(a, a.astype(np.int64)) == (None, "int32[2]", "int64[2]")
    assert first_difference(a, np.array([1, 2, 0], np.int32))[0] is None


def test_trace_comparison_reports_step_op_field_slot_and_values():
    """The report must say where: scenario, step, op, field, slot and both values."""
    same = np.array([7, 8, 9], np.int32)
    a = _run(_rec(1, "stash", output_tokens=same), _rec(2, "publish", new_seq_lens=same))
    b = _run(
        _rec(1, "stash", output_tokens=same),
        _rec(2, "publish", new_seq_lens=np.array([7, 5, 9], np.int32)),
    )
    cmp = compare_traces("demo", a, b)
    assert cmp.ops_compared == 2 and cmp.divergences == 1
    d = cmp.first
    assert (d.scenario, d.rank, d.step, d.op, d.field, d.slot) == (
        "demo",
        0,
        2,
        "publish",
        "new_seq_lens",
        2,
    )
    assert d.a.startswith("8 ") and d.b.startswith("5 ")
    assert "rank 0, step 2, op publish, field new_seq_lens, slot 2" in str(d)


def test_missing_field_and_op_sequence_mismatch_are_divergences():
    """A field one twin records and the other lacks, or ops in another order, must not pass."""
    x = np.array([1], np.int32)
    cmp = compare_traces("demo", _run(_rec(1, "resolve", a=x, b=x)), _run(_rec(1, "resolve", a=x)))
    assert cmp.divergences == 1 and cmp.first.field == "b"
    cmp = compare_traces("demo", _run(_rec(1, "stash", a=x)), _run(_rec(1, "publish", a=x)))
    assert cmp.divergences == 1 and cmp.first.field == "<op sequence>"


def test_a_run_that_stopped_early_is_a_divergence():
    """A twin that raised mid-run leaves a shorter trace; that alone must fail the comparison."""
    x = np.array([1], np.int32)
    a = _run(_rec(1, "stash", a=x), _rec(2, "stash", a=x))
    b = _run(_rec(1, "stash", a=x), error="InvariantViolation: consume")
    cmp = compare_traces("demo", a, b)
    assert cmp.field_divergences == 0 and cmp.length_mismatch and cmp.divergences == 1
    assert "consume" in cmp.first.b


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32])
def test_comparison_goes_through_torch_for_device_values(dtype):
    """The DLPack path (used for device arrays) must agree with the host path, bit for bit."""
    torch = pytest.importorskip("torch")
    a = np.array([1, 2, 3], dtype)
    b = a.copy()
    b.view(np.uint8)[0] ^= 1
    assert first_difference(torch.from_numpy(a), a.copy()) is None
    assert first_difference(torch.from_numpy(a), b)[0] == (0,)


def test_tensors_of_at_most_one_element_with_stride_zero_are_compared_by_their_bytes():
    """DLPack gives JAX's empty and one-element CUDA arrays stride 0 (torch still calls them
    contiguous); their bytes are compared, not refused by the dtype view."""
    torch = pytest.importorskip("torch")
    one = torch.tensor([7], dtype=torch.int32).as_strided((1,), (0,))
    empty = torch.zeros(0, dtype=torch.int32).as_strided((0,), (0,))
    for t in (one, empty):
        assert t.stride() == (0,) and t.is_contiguous()
    assert first_difference(one, torch.tensor([7], dtype=torch.int32)) is None
    assert first_difference(one, torch.tensor([6], dtype=torch.int32))[0] == (0,)
    assert first_difference(empty, torch.zeros(0, dtype=torch.int32)) is None


def test_ranks_are_compared_apart_and_the_earliest_step_is_first():
    """Records of DP ranks interleave differently in each run (two processes recorded
    them); each rank's own records are matched in order, and the report names the rank."""
    x, y = np.array([1, 2], np.int32), np.array([1, 3], np.int32)
    a = _run(_rec(1, "stash", 0, t=x), _rec(1, "stash", 1, t=x), _rec(2, "stash", 1, t=x))
    b = _run(_rec(1, "stash", 1, t=x), _rec(2, "stash", 1, t=y), _rec(1, "stash", 0, t=x))
    cmp = compare_traces("demo", a, b)
    assert cmp.ops_compared == 3 and cmp.divergences == 1
    assert (cmp.first.rank, cmp.first.step, cmp.first.slot) == (1, 2, 2)
    assert "rank 1, step 2, op stash, field t, slot 2" in str(cmp.first)
    # Rank 0 diverges at step 2, rank 1 at step 1: the earliest step is reported first.
    a2 = _run(_rec(1, "s", 0, t=x), _rec(2, "s", 0, t=y), _rec(1, "s", 1, t=y))
    b2 = _run(_rec(1, "s", 0, t=x), _rec(2, "s", 0, t=x), _rec(1, "s", 1, t=x))
    cmp = compare_traces("demo", a2, b2)
    assert cmp.divergences == 2 and (cmp.first.rank, cmp.first.step) == (1, 1)


def test_a_rank_missing_from_one_run_is_a_divergence():
    """A rank no process recorded (a worker that died before saving) must not pass."""
    x = np.array([1], np.int32)
    cmp = compare_traces(
        "demo",
        _run(_rec(1, "stash", 0, t=x), _rec(1, "stash", 1, t=x)),
        _run(_rec(1, "stash", 0, t=x)),
    )
    assert cmp.length_mismatch and cmp.first.rank == 1 and cmp.first.field == "<trace end>"


def test_merging_runs_of_processes_keeps_each_rank_once():
    """Per-process parts merge into one run; two parts claiming one rank is an error."""
    x = np.array([1], np.int32)
    p0 = RunResult([_rec(1, "stash", 0, t=x)], {(0, 5): [1]}, steps=3)
    p1 = RunResult([_rec(1, "stash", 1, t=x)], {(1, 5): [2]}, steps=4, error="boom")
    run = merge([p0, p1])
    assert run.ranks() == [0, 1] and run.steps == 4 and run.error == "boom"
    assert run.streams == {(0, 5): [1], (1, 5): [2]}
    with pytest.raises(ValueError, match="rank 0"):
        merge([p0, p0])
