"""fm_torch's confidence relay (docs/CONTRACT.md, 'The confidence relay'), modelled on
SGLang 0.5.23's `ConfidenceRelay`, on CPU: the same ring as fm_jax's (lag 2, depth 3, a
generation snapshot per entry), the same refusals."""

from __future__ import annotations

import pytest
import torch

from fm_torch import FutureMap, FutureMapError, ResolvedConfidence

R, GAMMA = 6, 3
SLOTS = torch.tensor([1, 2])


@pytest.fixture
def fm() -> FutureMap:
    return FutureMap(R, spec=True, needs_confidence_relay=True)


def _rows(step: int) -> torch.Tensor:
    """Two confidence rows of one step, with -0.0 and a NaN whose payload names the step."""
    bits = torch.full((2, GAMMA), 0, dtype=torch.int32)
    bits[:] = torch.tensor(0.25 * step, dtype=torch.float32).view(torch.int32)
    bits[0, 0] = -(2**31)  # -0.0
    bits[1, 2] = 0x7FC00000 | step
    return bits.view(torch.float32)


def _bits(x: torch.Tensor) -> list[int]:
    return x.contiguous().view(torch.int32).reshape(-1).tolist()


def test_a_read_takes_the_rows_of_two_publishes_back_bit_for_bit(fm):
    gen = torch.zeros(R, dtype=torch.int64)
    assert fm.resolve_confidence_cpu(SLOTS) is None
    fm.publish(SLOTS, torch.tensor([4, 5]), confidence=_rows(0), generation=gen)
    assert fm.resolve_confidence_cpu(SLOTS) is None
    for step in range(1, 5):
        fm.publish(SLOTS, torch.tensor([4, 5]), confidence=_rows(step), generation=gen)
        got = fm.resolve_confidence_cpu(SLOTS)
        assert isinstance(got, ResolvedConfidence)
        assert _bits(got.confidence) == _bits(_rows(step - 1))


def test_each_entry_keeps_the_generations_of_its_own_publish(fm):
    gen = torch.ones(R, dtype=torch.int64)
    fm.publish(SLOTS, torch.tensor([4, 5]), confidence=_rows(0), generation=gen)
    gen[2] += 1  # slot 2 taken by a new request: the host's counters move in place
    fm.publish(SLOTS, torch.tensor([4, 1]), confidence=_rows(1), generation=gen)
    got = fm.resolve_confidence_cpu(SLOTS)
    assert got is not None and got.generation.tolist() == [1, 1]
    fm.publish(SLOTS, torch.tensor([5, 2]), confidence=_rows(2), generation=gen)
    got = fm.resolve_confidence_cpu(torch.tensor([2, 1]))
    assert got is not None and got.generation.tolist() == [2, 1]


def test_publishes_without_confidence_keep_the_rows_and_the_ring(fm):
    gen = torch.zeros(R, dtype=torch.int64)
    fm.publish(SLOTS, torch.tensor([4, 5]), confidence=_rows(0), generation=gen)
    fm.publish(SLOTS, torch.tensor([6, 7]))
    none = torch.zeros(0, dtype=torch.int64)
    fm.publish(none, none, confidence=torch.zeros(0, GAMMA), generation=gen)  # idle
    assert fm.resolve_confidence_cpu(SLOTS) is None
    fm.publish(SLOTS, torch.tensor([8, 9]), confidence=_rows(1), generation=gen)
    got = fm.resolve_confidence_cpu(SLOTS)
    assert got is not None and _bits(got.confidence) == _bits(_rows(0))
    assert fm.resolve_confidence_cpu(none) is None


def test_bad_confidence_is_refused_before_anything_is_written(fm):
    gen = torch.zeros(R, dtype=torch.int64)
    bad = [
        (dict(confidence=_rows(0).double(), generation=gen), "confidence"),
        (dict(confidence=_rows(0).to(torch.bfloat16), generation=gen), "confidence"),
        (dict(confidence=_rows(0)[:, :2], generation=gen), None),
        (dict(confidence=_rows(0)), "generation is required"),
        (dict(confidence=_rows(0), generation=gen[:3]), "generation"),
    ]
    fm.publish(SLOTS, torch.tensor([4, 5]), confidence=_rows(0), generation=gen)  # gamma 3
    for kw, words in bad:
        with pytest.raises(FutureMapError, match=words or "confidence"):
            fm.publish(SLOTS, torch.tensor([6, 7]), **kw)
    assert fm.new_seq_lens[SLOTS].tolist() == [4, 5]
    assert fm.confidence_relay.ring_pos == 1
    with pytest.raises(FutureMapError, match="outside"):
        fm.resolve_confidence_cpu(torch.tensor([1, R]))
    with pytest.raises(FutureMapError, match="more than once"):
        fm.resolve_confidence_cpu(torch.tensor([1, 1]))


def test_a_map_without_the_relay_refuses_confidence():
    fm = FutureMap(R, spec=True)
    with pytest.raises(FutureMapError, match="relays none"):
        fm.publish(SLOTS, torch.tensor([4, 5]), confidence=_rows(0), generation=torch.zeros(R))
    with pytest.raises(FutureMapError, match="relays no confidence"):
        fm.resolve_confidence_cpu(SLOTS)
    with pytest.raises(FutureMapError, match="spec"):
        FutureMap(R, needs_confidence_relay=True)
