"""fm_torch bad inputs: each raises FutureMapError naming the problem, and nothing stored changes.

Every case compares the raw bytes of every buffer (and of the batch, for resolve) before and
after the failing call, so a check that runs after a partial write is caught.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fm_torch import DraftInput, DraftPayload, ForwardMode, FutureMap, FutureMapError, ScheduleBatch

NO_CUDA = "needs a CUDA device; torch.cuda.is_available() is False on this machine"
R = 5
I32_MAX = 2**31 - 1


def t(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def raw(x: torch.Tensor | None) -> tuple[str, tuple[int, ...], bytes] | None:
    """dtype, shape and raw bytes of a tensor (None stays None)."""
    if x is None:
        return None
    return (
        str(x.dtype),
        tuple(x.shape),
        x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(),
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
        "draft_payload": payload,
    }


def draft(
    rows: int,
    k: int = 2,
    h: int | None = 3,
    *,
    hidden_dtype: torch.dtype = torch.bfloat16,
    bonus: torch.Tensor | None = None,
    topk_p: torch.Tensor | None = None,
    topk_index: torch.Tensor | None = None,
    hidden: torch.Tensor | None | str = "default",
) -> DraftPayload:
    """A well-formed draft, with any field replaced by a (possibly bad) one."""
    return DraftPayload(
        bonus if bonus is not None else torch.arange(rows) + 10,
        topk_p if topk_p is not None else torch.full((rows, k), 0.5),
        topk_index if topk_index is not None else torch.ones((rows, k), dtype=torch.int64),
        (
            (None if h is None else torch.full((rows, h), 1.5, dtype=hidden_dtype))
            if isinstance(hidden, str)
            else hidden
        ),
    )


def populated(*, spec: bool = False, dtype: torch.dtype = torch.int64, debug: bool = False):
    """A FutureMap with distinct values in every buffer (spec extras shaped K=2, H=3, bf16)."""
    fm = FutureMap(R, dtype=dtype, spec=spec, debug=debug)
    fm.publish(t([1, 2, 3, 4]), t([11, 12, 13, 14]))
    if spec:
        fm.stash(t([1, 2, 3, 4]), draft(4))
    else:
        fm.stash(t([1, 2, 3, 4]), t([21, 22, 23, 24]))
    return fm


def assert_rejected(
    fm: FutureMap, call: Callable[[], object], match: str, batch: ScheduleBatch | None = None
) -> None:
    """`call` raises FutureMapError matching `match`; buffers (and batch) are byte-identical."""
    before = snapshot(fm)
    before_batch = None if batch is None else batch_snapshot(batch)
    with pytest.raises(FutureMapError, match=match):
        call()
    assert snapshot(fm) == before
    if batch is not None:
        assert batch_snapshot(batch) == before_batch


# ------------------------------------------------------------------------------- constructor
@pytest.mark.parametrize("pool_size", [1, 0, -3, 2.0, "4", None])
def test_pool_size_below_two_or_not_an_int_is_rejected(pool_size: object):
    """Pins: a pool with no live slot (slot 0 is padding) or a non-int size being accepted."""
    with pytest.raises(FutureMapError, match="pool_size must be an int >= 2"):
        FutureMap(pool_size)  # type: ignore[arg-type]


def test_pool_size_two_is_the_smallest_pool():
    """Pins: an off-by-one that rejects R=2 (one padding row, one live slot)."""
    fm = FutureMap(2, debug=False)
    fm.stash(t([1]), t([3]))
    assert fm.output_tokens.tolist() == [0, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool, "int64"])
def test_bad_int_dtype_is_rejected(dtype: object):
    """Pins: a buffer dtype other than int32/int64, which could not hold sentinels or ids."""
    with pytest.raises(FutureMapError, match="dtype must be torch.int32 or torch.int64"):
        FutureMap(4, dtype=dtype)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------- slot range
SLOT_CASES = [
    pytest.param([-1], "slots \\[-1\\] outside \\[0, 5\\)", id="negative"),
    pytest.param([2, R], "slots \\[5\\] outside \\[0, 5\\)", id="equal-R"),
    pytest.param([1, 99], "slots \\[99\\] outside", id="far-above"),
]


@pytest.mark.parametrize(("slots", "match"), SLOT_CASES)
@pytest.mark.parametrize("debug", [False, True])
def test_publish_with_slots_outside_the_pool_is_rejected(slots: list[int], match: str, debug: bool):
    """Pins: an out-of-range slot wrapping around (negative) or writing past the pool."""
    fm = populated(debug=debug)
    assert_rejected(fm, lambda: fm.publish(t(slots), t([7] * len(slots))), match)


@pytest.mark.parametrize(("slots", "match"), SLOT_CASES)
@pytest.mark.parametrize("spec", [False, True])
def test_stash_with_slots_outside_the_pool_is_rejected(slots: list[int], match: str, spec: bool):
    """Pins: a stash writing tokens (or extras) before noticing a bad slot."""
    fm = populated(spec=spec)
    payload = draft(len(slots)) if spec else t([7] * len(slots))
    assert_rejected(fm, lambda: fm.stash(t(slots), payload), match)


def test_first_spec_stash_with_bad_slots_does_not_shape_the_buffers():
    """Pins: lazy shaping committing K/H from a draft that is then rejected."""
    fm = FutureMap(R, spec=True, debug=False)
    assert_rejected(fm, lambda: fm.stash(t([R]), draft(1, k=4)), "outside")
    assert fm.topk_p is None
    fm.stash(t([1]), draft(1, k=2, h=None))  # a later, different draft is now the first
    assert fm.topk_p is not None and fm.topk_p.shape == (R, 2) and fm.hidden_states is None


@pytest.mark.parametrize(("slots", "match"), SLOT_CASES)
def test_resolve_with_slots_outside_the_pool_is_rejected(slots: list[int], match: str):
    """Pins: resolve gathering out of range (negative slots read from the end of the pool)."""
    fm = populated(debug=True)
    batch = ScheduleBatch(ForwardMode.DECODE, t(slots), t([-1] * len(slots)), t([-1] * len(slots)))
    assert_rejected(fm, lambda: fm.resolve(batch), match, batch)


@pytest.mark.parametrize(("slots", "match"), SLOT_CASES)
def test_spec_resolve_with_draft_slots_outside_the_pool_is_rejected(slots: list[int], match: str):
    """Pins: the draft indices checked only after the DECODE lengths were already restored."""
    fm = populated(spec=True)
    rows = list(range(1, len(slots) + 1))  # one draft slot per row
    sentinels = t([-r for r in rows])
    batch = ScheduleBatch(ForwardMode.DECODE, t(rows), sentinels, sentinels, DraftInput(t(slots)))
    assert_rejected(fm, lambda: fm.resolve(batch), "draft.indices holds " + match, batch)


@pytest.mark.parametrize(("slots", "match"), SLOT_CASES)
def test_resolve_seq_lens_cpu_and_invalidate_reject_slots_outside_the_pool(
    slots: list[int], match: str
):
    """Pins: a host length read, or sentinels, naming slots that do not exist."""
    fm = populated(spec=True)
    assert_rejected(fm, lambda: fm.resolve_seq_lens_cpu(t(slots)), match)
    batch = ScheduleBatch(ForwardMode.EXTEND, t([1]), t([3, 4]), t([2]))
    assert_rejected(fm, lambda: fm.invalidate(batch, t(slots)), match, batch)


@pytest.mark.parametrize("sentinel", [-R, -100])
def test_resolve_with_a_sentinel_naming_no_slot_is_rejected(sentinel: int):
    """Pins: a sentinel -s with s >= R gathering out of range instead of failing."""
    fm = populated()
    batch = ScheduleBatch(ForwardMode.MIXED, t([1, 2]), t([5, 6, sentinel]), t([2, 12]))
    assert_rejected(fm, lambda: fm.resolve(batch), "sentinels .* naming slots outside", batch)


# --------------------------------------------------------------------------- duplicate slots
def test_live_slot_twice_in_one_batch_is_rejected_everywhere():
    """Pins: a batch holding one request twice (last-writer-wins scatter) passing silently."""
    fm = populated(spec=False)
    dup = t([2, 3, 2])
    match = "live slots \\[2\\] more than once"
    assert_rejected(fm, lambda: fm.publish(dup, t([1, 2, 3])), match)
    assert_rejected(fm, lambda: fm.stash(dup, t([1, 2, 3])), match)
    batch = ScheduleBatch(ForwardMode.DECODE, dup, t([-2, -3, -2]), t([-2, -3, -2]))
    assert_rejected(fm, lambda: fm.resolve(batch), match, batch)
    spec = populated(spec=True)
    assert_rejected(spec, lambda: spec.stash(dup, draft(3)), match)


def test_padding_slot_zero_may_repeat():
    """Pins: the duplicate check counting padding rows (slot 0) as live."""
    fm = populated(debug=True)
    fm.publish(t([0, 1, 0, 0]), t([1, 2, 3, 4]))
    fm.stash(t([0, 1, 0, 0]), t([1, 2, 3, 4]))
    batch = ScheduleBatch(ForwardMode.DECODE, t([0, 1, 0]), t([0, -1, 0]), t([0, -1, 0]))
    fm.resolve(batch)
    assert batch.input_ids.tolist() == [0, 2, 0]


# --------------------------------------------------------------------- payload dtype / shape
def test_non_spec_payloads_of_wrong_type_rank_dtype_or_rows_are_rejected():
    """Pins: float tokens silently truncated, a [B, 1] tensor broadcast, or a short payload."""
    fm = populated()
    idx = t([1, 2])
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: fm.stash(idx, torch.tensor([1.0, 2.0])), "tokens must have an integer dtype"),
        (lambda: fm.stash(idx, t([[1], [2]])), "tokens must be 1-D"),
        (lambda: fm.stash(idx, t([1])), "tokens has 1 rows, indices have 2"),
        (lambda: fm.stash(idx, [1, 2]), "tokens must be a torch.Tensor"),  # type: ignore[arg-type]
        (lambda: fm.stash(idx, draft(2)), "DraftPayload but this FutureMap has spec=False"),
        (
            lambda: fm.publish(idx, torch.tensor([1.0, 2.0])),
            "new_seq_lens must have an integer dtype",
        ),
        (lambda: fm.publish(idx, t([1, 2, 3])), "new_seq_lens has 3 rows, indices have 2"),
        (lambda: fm.publish(idx, t([[1, 2]])), "new_seq_lens must be 1-D"),
        (lambda: fm.publish(torch.tensor([1.0]), t([1])), "indices must have an integer dtype"),
        (lambda: fm.publish(t([[1]]), t([1])), "indices must be 1-D"),
        (
            lambda: fm.publish(idx.bool(), t([1, 2])),
            "indices must have an integer dtype, got torch.bool",
        ),
    ]
    for call, match in cases:
        assert_rejected(fm, call, match)


def test_resolve_batch_fields_of_wrong_rank_or_dtype_are_rejected():
    """Pins: a malformed batch being half-resolved before the bad field is noticed."""
    fm = populated()
    bad = [
        (ScheduleBatch(ForwardMode.DECODE, t([[1]]), t([-1]), t([-1])), "req_pool_indices must"),
        (
            ScheduleBatch(ForwardMode.DECODE, t([1]), torch.tensor([-1.0]), t([-1])),
            "input_ids must",
        ),
        (ScheduleBatch(ForwardMode.DECODE, t([1, 2]), t([-1]), t([-1, -2])), "DECODE batch has 1"),
    ]
    for batch, match in bad:
        assert_rejected(fm, lambda b=batch: fm.resolve(b), match, batch)


SPEC_BAD = [
    pytest.param(lambda: t([1, 2]), "takes a DraftPayload, got Tensor", id="tensor-payload"),
    pytest.param(
        lambda: draft(2, bonus=torch.tensor([1.0, 2.0])),
        "bonus_tokens must have an integer dtype",
        id="bonus-f",
    ),
    pytest.param(lambda: draft(2, bonus=t([1])), "bonus_tokens has 1 rows", id="bonus-rows"),
    pytest.param(lambda: draft(2, topk_p=torch.ones(2)), "topk_p must be a 2-D", id="p-rank"),
    pytest.param(
        lambda: draft(2, topk_p=torch.ones((2, 2), dtype=torch.float64)),
        "topk_p must have dtype in \\(torch.float32\\)",
        id="p-f64",
    ),
    pytest.param(
        lambda: draft(2, topk_p=torch.ones((3, 2))), "topk_p must have shape \\(2, ", id="p-rows"
    ),
    pytest.param(
        lambda: draft(2, topk_index=torch.ones((2, 2))),
        "topk_index must have dtype in",
        id="index-float",
    ),
    pytest.param(
        lambda: draft(2, topk_index=t([1, 2])), "topk_index must have shape", id="index-rank"
    ),
    pytest.param(
        lambda: draft(2, hidden=torch.ones((2, 3), dtype=torch.int32)),
        "hidden_states must have dtype in",
        id="hidden-int",
    ),
    pytest.param(
        lambda: draft(2, hidden=torch.ones((2, 3), dtype=torch.float64)),
        "hidden_states must have dtype in",
        id="hidden-f64",
    ),
    pytest.param(
        lambda: draft(2, hidden=torch.ones(6, dtype=torch.bfloat16)),
        "hidden_states must",
        id="hidden-rank",
    ),
]


@pytest.mark.parametrize(("make", "match"), SPEC_BAD)
@pytest.mark.parametrize("shaped", [False, True])
def test_malformed_spec_payloads_are_rejected(make: Callable[[], object], match: str, shaped: bool):
    """Pins: a malformed draft being written (or fixing the lazy shapes) before it is rejected."""
    fm = populated(spec=True) if shaped else FutureMap(R, spec=True, debug=False)
    assert_rejected(fm, lambda: fm.stash(t([1, 2]), make()), match)  # type: ignore[arg-type]
    if not shaped:
        assert fm.topk_p is None and fm.topk_index is None and fm.hidden_states is None


# ------------------------------------------------------------------ mismatch after lazy init
MISMATCHED = [
    pytest.param(lambda: draft(2, k=3), "topk_p must have shape \\(2, 2\\)", id="other-K"),
    pytest.param(lambda: draft(2, h=4), "hidden_states must have shape \\(2, 3\\)", id="other-H"),
    pytest.param(
        lambda: draft(2, hidden_dtype=torch.float16),
        "hidden_states must have dtype in \\(torch.bfloat16\\)",
        id="other-hidden-dtype",
    ),
]


@pytest.mark.parametrize(("make", "match"), MISMATCHED)
def test_draft_mismatching_the_first_draft_is_rejected(make: Callable[[], DraftPayload], match):
    """Pins: a later draft with another K, H or hidden dtype being cast or truncated into place."""
    fm = populated(spec=True)
    assert_rejected(fm, lambda: fm.stash(t([1, 2]), make()), match)


def test_hidden_states_first_carried_by_a_later_draft_make_their_buffer_then():
    """Buffers made on first use (SGLang): hidden states a later draft first carries are
    relayed (not dropped because the first draft had none), and fix H from then on."""
    fm = FutureMap(R, spec=True, debug=False)
    fm.stash(t([1]), draft(1, h=None))
    assert fm.hidden_states is None
    later = draft(1, h=3)
    fm.stash(t([2]), later)
    assert fm.hidden_states is not None and fm.hidden_states.shape == (R, 3)
    assert later.hidden_states is not None
    assert torch.equal(fm.hidden_states[2], later.hidden_states[0])
    assert_rejected(fm, lambda: fm.stash(t([2]), draft(1, h=4)), "hidden_states must have shape")


def test_spec_resolve_before_any_draft_was_stashed_is_rejected():
    """Pins: a spec decode reading extras that have no shape yet (an AttributeError on None)."""
    fm = FutureMap(R, spec=True, debug=False)
    fm.publish(t([1]), t([3]))
    batch = ScheduleBatch(ForwardMode.DECODE, t([1]), t([-1]), t([-1]), DraftInput(t([1])))
    assert_rejected(fm, lambda: fm.resolve(batch), "before any draft was stashed", batch)


# ----------------------------------------------------------------------------- int32 fit
@pytest.mark.parametrize("debug", [False, True])
def test_int64_values_that_do_not_fit_an_int32_buffer_are_rejected(debug: bool):
    """Pins: int64 tokens, lengths or ids wrapping around when cast into an int32 buffer."""
    fm = populated(dtype=torch.int32, debug=debug)
    idx = t([1, 2])
    big, small = t([5, I32_MAX + 1]), t([-(2**31) - 1, 5])
    assert_rejected(fm, lambda: fm.stash(idx, big), "tokens holds values that do not fit")
    assert_rejected(fm, lambda: fm.stash(idx, small), "tokens holds values that do not fit")
    assert_rejected(fm, lambda: fm.publish(idx, big), "new_seq_lens holds values that do not fit")
    batch = ScheduleBatch(ForwardMode.EXTEND, t([1]), t([2**40, 3]), t([2]))
    assert_rejected(fm, lambda: fm.resolve(batch), "input_ids holds values that do not fit", batch)
    # The largest int32 values do fit.
    fm.stash(idx, t([I32_MAX, 0]))
    fm.publish(idx, t([I32_MAX, 1]))
    assert fm.output_tokens.tolist()[1:3] == [I32_MAX, 0]


def test_int64_topk_index_that_does_not_fit_an_int32_buffer_is_rejected():
    """Pins: draft top-k token ids wrapping around in an int32 topk_index buffer."""
    fm = populated(spec=True, dtype=torch.int32)
    bad = draft(2, topk_index=t([[1, 2], [3, 2**33]]))
    assert_rejected(fm, lambda: fm.stash(t([1, 2]), bad), "topk_index holds values that do not fit")
    bad_bonus = draft(2, bonus=t([2**31, 1]))
    assert_rejected(fm, lambda: fm.stash(t([1, 2]), bad_bonus), "tokens holds values")


# ---------------------------------------------------------------------------------- device
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_payload_on_another_device_is_rejected():
    """Pins: a CPU tensor fed to a CUDA map being silently copied (a hidden host sync)."""
    fm = FutureMap(R, device="cuda", debug=False)
    before = snapshot(fm)
    with pytest.raises(FutureMapError, match="is on cpu, the FutureMap is on cuda"):
        fm.stash(t([1]), t([3]))
    with pytest.raises(FutureMapError, match="is on cpu, the FutureMap is on cuda"):
        fm.publish(t([1]).cuda(), t([3]))
    assert snapshot(fm) == before


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"device": "nope"}, r"^device 'nope' is not one torch names"),
        ({"device": "cuda:7"}, r"^device 'cuda:7': this torch reaches"),
        ({"device": 3}, r"^device must be a torch.device or a string, got 3"),
        ({"debug": []}, r"^debug must be a bool or None, got \[\]"),
        ({"debug": 1}, r"^debug must be a bool or None, got 1"),
        ({"spec": 1}, r"^spec must be a bool, got 1"),
        ({"consumed": "steps"}, r"^consumed must be a tuple of field names, got 'steps'"),
        ({"consumed": None}, r"^consumed must be a tuple of field names, got None"),
        ({"consumed": (1,)}, r"^consumed must be a tuple of field names"),
    ],
    ids=lambda x: x if isinstance(x, str) else repr(x),
)
def test_a_bad_constructor_argument_is_refused_by_name(kw: dict[str, object], match: str) -> None:
    """Defect (reliability round two, fm_torch's constructor): torch's own errors for a
    device it cannot name or reach, a TypeError for consumed=None, and any debug or spec
    value taken for its truth. Each is a FutureMapError naming the argument."""
    if kw.get("device") == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a CUDA device 7")
    with pytest.raises(FutureMapError, match=match):
        FutureMap(R, **kw)  # type: ignore[arg-type]


_JUNK = st.sampled_from([None, "x", "", 1.5, -1, 0, True, [], (), {}, object(), b"b", [1, "a"]])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    pool=st.one_of(st.integers(-1, 12), _JUNK),
    dtype=st.one_of(st.sampled_from([torch.int32, torch.int64, torch.float32, torch.bool]), _JUNK),
    spec=st.one_of(st.booleans(), _JUNK),
    debug=st.one_of(st.none(), st.booleans(), _JUNK),
    protocol=st.one_of(st.sampled_from(["sentinel", "gather"]), _JUNK),
    device=st.one_of(st.sampled_from(["cpu", "nope", "cuda:7", torch.device("cpu")]), _JUNK),
    consumed=st.one_of(st.sampled_from([(), ("steps",), ["steps"], "steps"]), _JUNK),
)
def test_a_map_is_built_or_refused_clearly(
    pool: object,
    dtype: object,
    spec: object,
    debug: object,
    protocol: object,
    device: object,
    consumed: object,
) -> None:
    """Defect (reliability round two, fm_torch's constructor): a device torch cannot name or
    reach raised torch's own RuntimeError, AssertionError or TypeError, consumed=None a
    TypeError, and a debug or spec flag of any value was taken as its truth value. Every
    argument combination gives a working map (one publish and resolve) or a FutureMapError."""
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        device = "nope"  # a device this torch cannot reach, whatever the machine
    try:
        fm = FutureMap(
            pool,  # type: ignore[arg-type]
            dtype=dtype,  # type: ignore[arg-type]
            spec=spec,  # type: ignore[arg-type]
            debug=debug,  # type: ignore[arg-type]
            protocol=protocol,  # type: ignore[arg-type]
            device=device,  # type: ignore[arg-type]
            consumed=consumed,  # type: ignore[arg-type]
        )
    except FutureMapError:
        return
    one = torch.tensor([1], dtype=fm.dtype, device=fm.device)
    fm.publish(one, one)
    fm.resolve(ScheduleBatch(ForwardMode.EXTEND, one, one, one))
