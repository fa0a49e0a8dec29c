"""fm_torch's verified ids and engine-declared draft fields, and the two twins relaying the
same declared fields to the same bytes (docs/CONTRACT.md, 'Relay fields')."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import fm_jax as fj
from fm_torch import (
    DraftInput,
    DraftPayload,
    ForwardMode,
    FutureMap,
    FutureMapError,
    InvariantViolation,
    ScheduleBatch,
)

R = 8


def t(*x: int) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


SCORES = torch.tensor([[float("nan"), -0.0], [1.5, float("inf")]], dtype=torch.float16)


def draft(vid: tuple[int, ...] = (31, 51), steps: tuple[int, ...] = (1, 2), **kw: Any) -> Any:
    extras = kw.pop("extras", {"steps": t(*steps), "score": SCORES})
    return DraftPayload(
        t(30, 50), torch.ones(2, 2), t(0, 1, 2, 3).reshape(2, 2), verified_id=t(*vid), extras=extras
    )


def batch(protocol: str, slots: torch.Tensor) -> ScheduleBatch:
    ids = torch.zeros_like(slots) if protocol == "gather" else -slots
    return ScheduleBatch(ForwardMode.DECODE, slots, ids, ids.clone(), DraftInput(slots.clone()))


def snapshot(fm: FutureMap) -> list[Any]:
    bufs = [fm.output_tokens, fm.new_seq_lens, fm.verified_id, *fm.extras.values()]
    return [None if b is None else (b.dtype, bytes(b.view(torch.uint8).numpy())) for b in bufs]


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_verified_ids_and_own_fields_are_relayed(protocol: str) -> None:
    """The first draft's verified ids and extras are stashed and gathered back at the
    draft's slots, raw bits kept (NaN payload, -0.0)."""
    fm = FutureMap(R, spec=True, debug=True, consumed=("steps",), protocol=protocol)
    fm.publish(t(3, 5), t(4, 6))
    fm.stash(t(3, 5), draft())
    b = batch(protocol, t(5, 3))
    fm.resolve(b)
    assert b.draft is not None and b.draft.payload is not None
    p = b.draft.payload
    assert p.verified_id is not None and p.verified_id.tolist() == [51, 31]
    assert p.extras is not None and p.extras["steps"].tolist() == [2, 1]
    assert bytes(p.extras["score"].view(torch.int16).numpy()) == bytes(
        SCORES.flip(0).view(torch.int16).numpy()
    )


@pytest.mark.parametrize("field", ["verified_id", "steps"])
def test_tracked_fields_are_poisoned_and_a_second_read_is_caught(field: str) -> None:
    """Verified ids and a consume-tracked extra start at -1 (debug), are -1 again at the
    draft's slots after a resolve, and a read finding -1 in that field alone is caught,
    with nothing written by the refused resolve."""
    fm = FutureMap(R, spec=True, debug=True, consumed=("steps",))
    fm.publish(t(3, 5), t(4, 6))
    fm.stash(t(3, 5), draft())
    assert fm.verified_id is not None
    fm.resolve(batch("sentinel", t(3, 5)))
    buf = fm.verified_id if field == "verified_id" else fm.extras["steps"]
    assert buf[3].item() == buf[5].item() == -1
    assert fm.extras["score"][3, 0].isnan().item()  # not tracked: kept
    # Every other tracked buffer written again: only `field` still reads -1.
    fm.output_tokens[torch.tensor([3, 5])] = t(32, 52)
    other = fm.extras["steps"] if field == "verified_id" else fm.verified_id
    other[torch.tensor([3, 5])] = t(7, 7)
    before = snapshot(fm)
    with pytest.raises(InvariantViolation, match=r"consume \(WRWR\)"):
        fm.resolve(batch("sentinel", t(3, 5)))
    assert snapshot(fm) == before


BAD = {
    "a negative verified id": (lambda: draft(vid=(31, -1)), "draft.verified_id"),
    "a negative tracked extra": (lambda: draft(steps=(-2, 1)), "draft.steps"),
    "a tracked extra missing from the first draft": (
        lambda: draft(extras={"score": SCORES}),
        "consume-tracked fields",
    ),
    "a tracked extra that is not an int": (
        lambda: draft(extras={"steps": torch.ones(2), "score": SCORES}),
        "draft.steps is consume-tracked",
    ),
    "extras not a dict": (lambda: draft(extras=[SCORES]), "draft.extras must be a dict"),
    "an extra of the wrong rows": (
        lambda: draft(extras={"steps": t(1, 2), "score": SCORES[:1]}),
        "draft.score",
    ),
    "an extra that is a scalar": (
        lambda: draft(extras={"steps": t(1, 2), "score": SCORES[0, 0]}),
        "draft.score must be a tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_first_draft_is_refused_and_writes_nothing(case: str) -> None:
    """Bad declared fields are refused by name before anything is written."""
    make, message = BAD[case]
    fm = FutureMap(R, spec=True, consumed=("steps",))
    before = snapshot(fm)
    with pytest.raises(FutureMapError, match=message):
        fm.stash(t(3, 5), make())
    assert snapshot(fm) == before and fm.verified_id is None and not fm.extras


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.__class__(**{**d.__dict__, "verified_id": None}), "expected verified_id"),
        (
            lambda d: d.__class__(**{**d.__dict__, "extras": {"steps": t(1, 2)}}),
            "the first draft stashed",
        ),
        (
            lambda d: d.__class__(
                **{**d.__dict__, "extras": {"steps": t(1, 2), "score": SCORES.float()}}
            ),
            "draft.score",
        ),
    ],
)
def test_a_later_draft_must_match_the_first(change: Any, message: str) -> None:
    """The first draft fixes which fields are relayed and their dtypes: a later one that
    drops a field or changes a dtype is refused, nothing written."""
    fm = FutureMap(R, spec=True, consumed=("steps",))
    fm.stash(t(3, 5), draft())
    before = snapshot(fm)
    with pytest.raises(FutureMapError, match=message):
        fm.stash(t(3, 5), change(draft()))
    assert snapshot(fm) == before


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_both_twins_relay_declared_fields_to_the_same_bytes(protocol: str, debug: bool) -> None:
    """fm_jax (fields declared in its SpecConfig) and fm_torch (fields of its first draft)
    over the same ops: every gathered field and every buffer's bytes are the same, bits of
    the float16 field included; slot 7 is stashed but never read (its values must survive
    the consume poison), slots never written keep the buffers' initial values."""
    spec = fj.SpecConfig(
        topk=2,
        verified_id=True,
        extra=(
            fj.RelayField("steps", consumed=True),
            fj.RelayField("score", (2,), np.float16, bits=True),
        ),
    )
    jm = fj.FutureMap(R, spec=spec, debug=debug, dtype=np.int32, protocol=protocol)
    tm = FutureMap(
        R, spec=True, debug=debug, dtype=torch.int32, consumed=("steps",), protocol=protocol
    )
    slots = [np.array([3, 5], np.int32), np.array([5, 3], np.int32)]
    for step in range(4):
        s = slots[step % 2]
        ts = torch.from_numpy(s)
        w = np.append(s, 7).astype(np.int32)  # stashed; the draft reads s only
        tw = torch.from_numpy(w)
        vid, steps = w * 10 + step, w + step
        score = np.concatenate([SCORES.numpy()[:: 1 if step % 2 else -1], SCORES.numpy()[:1]])
        jm.publish(s, s + step)
        tm.publish(ts, ts + step)
        jd = fj.DraftPayload(
            w * 7,
            np.ones((3, 2), np.float32),
            np.zeros((3, 2), np.int32),
            None,
            vid,
            {"steps": steps, "score": score},
        )
        td = DraftPayload(
            tw * 7,
            torch.ones(3, 2),
            torch.zeros(3, 2, dtype=torch.int32),
            None,
            torch.from_numpy(vid),
            {"steps": torch.from_numpy(steps), "score": torch.from_numpy(score)},
        )
        jm.stash(w, jd)
        tm.stash(tw, td)
        ids = np.zeros(2, np.int32) if protocol == "gather" else -s
        r = jm.resolve(fj.Batch(ForwardMode.DECODE, s, ids, ids, draft_indices=s))
        b = ScheduleBatch(
            ForwardMode.DECODE,
            ts,
            torch.from_numpy(ids),
            torch.from_numpy(ids.copy()),
            DraftInput(ts.clone()),
        )
        tm.resolve(b)
        assert r.draft is not None and r.draft.extras is not None and b.draft is not None
        p = b.draft.payload
        assert p is not None and p.extras is not None and p.verified_id is not None
        assert np.asarray(r.draft.verified_id)[:2].tobytes() == p.verified_id.numpy().tobytes()
        assert np.asarray(r.seq_lens)[:2].tobytes() == b.seq_lens.numpy().tobytes()
        for name in ("steps", "score"):
            got = np.asarray(r.draft.extras[name])[:2]
            assert got.tobytes() == p.extras[name].numpy().tobytes(), (step, name)
        assert tm.verified_id is not None
        for jb, tb in [
            (jm.state.output_tokens, tm.output_tokens),
            (jm.state.verified_id, tm.verified_id),
            (jm.state.extras["steps"], tm.extras["steps"]),  # type: ignore[index]
            (jm.state.extras["score"], tm.extras["score"].view(torch.uint16)),  # type: ignore[index]
        ]:
            assert np.asarray(jb)[1:].tobytes() == tb.numpy()[1:].tobytes(), step
    if debug:
        jm.check()
