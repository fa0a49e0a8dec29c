"""fm_torch.FutureMap against a pure-Python dict model, on random op sequences (hypothesis).

The model holds one int per slot for `output_tokens` and `new_seq_lens` and predicts, for every
publish / stash / resolve, either the new buffer contents and resolved batch, or the error:
FutureMapError for a bad slot (out of [0, R) or a live slot twice), InvariantViolation in debug
mode for a non-positive restored length or a consume (WRWR) failure. After every op, including
the failing ones, the live slots of both buffers must equal the model. Slot 0 is padding: its
content is garbage (repeated padding rows race on it), so it is never compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fm_torch import ForwardMode, FutureMap, FutureMapError, InvariantViolation, ScheduleBatch

R = 5
POISON = -1

slot = st.integers(-1, R)  # -1 and R are out of range: bad input
slots = st.lists(slot, min_size=0, max_size=4)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), slots, st.lists(st.integers(0, 40), min_size=4, max_size=4)),
        st.tuples(st.just("stash"), slots, st.lists(st.integers(0, 12), min_size=4, max_size=4)),
        st.tuples(st.just("decode"), slots, st.just([])),
        st.tuples(st.just("extend"), slots, st.lists(st.integers(0, 12), min_size=4, max_size=4)),
    ),
    min_size=1,
    max_size=14,
)


@dataclass
class Model:
    """What the buffers should hold, slot by slot."""

    tokens: dict[int, int]
    lens: dict[int, int]
    debug: bool

    @classmethod
    def fresh(cls, debug: bool) -> Model:
        start = POISON if debug else 0  # debug: tokens and lengths start poisoned
        return cls(dict.fromkeys(range(R), start), dict.fromkeys(range(R), start), debug)

    @staticmethod
    def bad_slots(xs: list[int]) -> bool:
        live = [x for x in xs if x != 0]
        return any(x < 0 or x >= R for x in xs) or len(set(live)) != len(live)


def check_equal(fm: FutureMap, model: Model) -> None:
    live = range(1, R)
    assert [int(fm.output_tokens[s]) for s in live] == [model.tokens[s] for s in live]
    assert [int(fm.new_seq_lens[s]) for s in live] == [model.lens[s] for s in live]


def apply(fm: FutureMap, model: Model, op: tuple[str, list[int], list[int]]) -> None:
    """Run one op on the map and the model; check the outcome the model predicts."""
    kind, xs, values = op
    idx = torch.tensor(xs, dtype=torch.int64)
    vals = torch.tensor(values[: len(xs)], dtype=torch.int64)
    if model.bad_slots(xs):
        batch = ScheduleBatch(ForwardMode.DECODE, idx, -idx, -idx)
        call = {
            "publish": lambda: fm.publish(idx, vals),
            "stash": lambda: fm.stash(idx, vals),
            "decode": lambda: fm.resolve(batch),
            "extend": lambda: fm.resolve(batch),
        }[kind]
        with pytest.raises(FutureMapError):
            call()
        return
    if kind == "publish":
        fm.publish(idx, vals)
        model.lens.update(zip(xs, values, strict=False))
    elif kind == "stash":
        fm.stash(idx, vals)
        model.tokens.update(zip(xs, values, strict=False))
    elif kind == "extend":
        # One token per row, real ids (>= 0): nothing is gathered, the rows' slots are re-armed.
        batch = ScheduleBatch(ForwardMode.EXTEND, idx, vals.clone(), torch.ones_like(idx))
        fm.resolve(batch)
        assert batch.input_ids.tolist() == values[: len(xs)]
        if model.debug:
            model.tokens.update(dict.fromkeys(xs, POISON))
    else:
        batch = ScheduleBatch(ForwardMode.DECODE, idx, -idx, -idx)
        want_lens = [model.lens[x] for x in xs]
        want_ids = [0 if x == 0 else model.tokens[x] for x in xs]
        bad_len = [x for x, n in zip(xs, want_lens, strict=True) if x != 0 and n <= 0]
        bad_read = [x for x, t in zip(xs, want_ids, strict=True) if x != 0 and t < 0]
        if model.debug and (bad_len or bad_read):
            invariant = "seq_lens > 0" if bad_len else "consume (WRWR)"
            with pytest.raises(InvariantViolation) as err:
                fm.resolve(batch)
            assert err.value.invariant == invariant
            assert sorted(err.value.slots) == sorted(bad_len or bad_read)
            return
        fm.resolve(batch)
        live_rows = [i for i, x in enumerate(xs) if x != 0]
        assert [int(batch.input_ids[i]) for i in range(len(xs))] == want_ids
        assert [int(batch.seq_lens[i]) for i in live_rows] == [want_lens[i] for i in live_rows]
        if model.debug:
            model.tokens.update(dict.fromkeys(xs, POISON))


@settings(max_examples=60, deadline=None)
@given(
    program=ops,
    debug=st.booleans(),
    dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_future_map_matches_dict_model(program, debug: bool, dtype: torch.dtype):
    """Pins: any divergence from docs/CONTRACT.md's per-slot semantics on a random op sequence:
    a write landing on the wrong slot, a failed call writing anything, an RR / read-before-write /
    unpublished length slipping through debug mode, or a false positive on a legal sequence."""
    fm = FutureMap(R, dtype=dtype, debug=debug)
    model = Model.fresh(debug)
    for op in program:
        apply(fm, model, op)
        check_equal(fm, model)
