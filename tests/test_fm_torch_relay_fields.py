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
    fm.new_seq_lens[torch.tensor([3, 5])] = t(4, 6)  # and the lengths the resolve consumed
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
            lambda d: d.__class__(**{**d.__dict__, "extras": {"score": SCORES}}),
            r"consume-tracked fields \['steps'\] missing from the draft",
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
    """The first draft fixes the consume-tracked fields and each field's dtype: a later
    one that drops a tracked field or changes a dtype is refused, nothing written."""
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


def ngram(rows: int, step: int) -> Any:
    """An n-gram draft as SGLang relays it: accepted tokens and accept lengths only."""
    toks = torch.arange(rows * 3, dtype=torch.int64).reshape(rows, 3) + 100 * step
    return DraftPayload(extras={"accept_tokens": toks, "accept_lens": t(*range(1, rows + 1))})


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_an_ngram_first_draft_fixes_a_relay_without_bonus_tokens(
    protocol: str, debug: bool
) -> None:
    """A first draft without bonus tokens and top-k (SGLang's n-gram payload) keeps no
    buffers for them and never writes output_tokens; resolve gives None for them, the
    accepted tokens and lengths as stashed, and 0 for a slot never stashed; a later draft
    that brings a bonus token is refused."""
    fm = FutureMap(R, spec=True, debug=debug, protocol=protocol)
    tokens_before = fm.output_tokens.clone()
    fm.publish(t(3, 5, 6), t(4, 6, 2))
    fm.stash(t(3, 5), ngram(2, 1))
    assert fm.topk_p is None and fm.topk_index is None and not fm.bonus_tokens
    assert torch.equal(fm.output_tokens, tokens_before)
    for _ in range(2):  # nothing is consume-tracked: a second read gives the same
        fm.publish(t(3, 5, 6), t(4, 6, 2))  # (debug consumes the lengths a read takes)
        b = batch(protocol, t(5, 3, 6))
        fm.resolve(b)
        assert b.draft is not None and b.draft.payload is not None
        got = b.draft.payload
        assert got.bonus_tokens is None and got.topk_p is None and got.extras is not None
        assert got.extras["accept_lens"].tolist() == [2, 1, 0]
        assert got.extras["accept_tokens"].tolist() == [[103, 104, 105], [100, 101, 102], [0] * 3]
        assert b.seq_lens.tolist() == [6, 4, 2]
    with pytest.raises(FutureMapError, match="bonus_tokens"):
        fm.stash(t(3), DraftPayload(bonus_tokens=t(1), extras=ngram(1, 2).extras))
    with pytest.raises(FutureMapError, match="relays no field"):
        fm.stash(t(3), DraftPayload())


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_both_twins_relay_an_ngram_payload_to_the_same_bytes(protocol: str, debug: bool) -> None:
    """fm_jax declaring SGLang's n-gram payload and fm_torch taking it from its first draft:
    the same gathered fields and buffer bytes over publish, stash and resolve."""
    spec = fj.SpecConfig(
        topk=0,
        bonus_tokens=False,
        extra=(fj.RelayField("accept_tokens", (3,)), fj.RelayField("accept_lens")),
    )
    jm = fj.FutureMap(R, spec=spec, debug=debug, dtype=np.int32, protocol=protocol)
    tm = FutureMap(R, spec=True, debug=debug, dtype=torch.int32, protocol=protocol)
    live = np.arange(2, 7, dtype=np.int32)  # every slot read has a length
    jm.publish(live, live)
    tm.publish(torch.from_numpy(live), torch.from_numpy(live))
    for step in range(3):
        s = np.array([3, 5], np.int32) if step % 2 else np.array([5, 6, 2], np.int32)
        ts = torch.from_numpy(s)
        td = ngram(len(s), step)
        td.extras = {k: v.to(torch.int32) for k, v in (td.extras or {}).items()}
        jd = fj.DraftPayload(extras={k: v.numpy() for k, v in (td.extras or {}).items()})
        jm.publish(live, live)  # debug: a spec DECODE consumes the lengths it reads
        tm.publish(torch.from_numpy(live), torch.from_numpy(live))
        jm.publish(s, s + step)
        tm.publish(ts, ts + step)
        jm.stash(s, jd)
        tm.stash(ts, td)
        r_slots = np.array([2, 3, 4], np.int32)  # slot 4 never stashed
        ids = np.zeros(3, np.int32) if protocol == "gather" else -r_slots
        r = jm.resolve(fj.Batch(ForwardMode.DECODE, r_slots, ids, ids, draft_indices=r_slots))
        tb = batch(protocol, torch.from_numpy(r_slots))
        tm.resolve(tb)
        assert r.draft is not None and r.draft.extras is not None
        assert tb.draft is not None and tb.draft.payload is not None
        for k, v in (tb.draft.payload.extras or {}).items():
            assert np.asarray(r.draft.extras[k])[:3].tobytes() == v.numpy().tobytes(), k
        for k, buf in tm.extras.items():
            assert np.asarray((jm.state.extras or {})[k]).tobytes() == buf.numpy().tobytes(), k
    jm.check()


def test_a_draft_without_what_the_first_relayed_is_named_and_top_k_comes_whole() -> None:
    """A later draft that lacks the bonus tokens the first draft relayed (a consume-tracked
    field, in every draft) is refused naming them (and one that brings them where the
    first did not, naming their absence); top-k probabilities without top-k ids are
    refused; a draft relaying nothing too, first or later."""
    fm = FutureMap(R, spec=True)
    fm.stash(t(3), DraftPayload(t(30), torch.ones(1, 2), t(0, 1).reshape(1, 2)))
    with pytest.raises(FutureMapError, match="expected bonus_tokens$"):
        fm.stash(t(3), DraftPayload(None, torch.ones(1, 2), t(0, 1).reshape(1, 2)))
    ng = FutureMap(R, spec=True)
    ng.stash(t(3), ngram(1, 0))
    with pytest.raises(FutureMapError, match="expected no bonus_tokens$"):
        ng.stash(t(3), DraftPayload(bonus_tokens=t(1), extras=ngram(1, 1).extras))
    half = FutureMap(R, spec=True)
    with pytest.raises(FutureMapError, match="topk_index"):
        half.stash(t(3), DraftPayload(t(30), torch.ones(1, 2), None))
    assert half.topk_p is None and not half._spec_shaped
    with pytest.raises(FutureMapError, match="^the draft stashed relays no field$"):
        FutureMap(R, spec=True).stash(t(3), DraftPayload())
    with pytest.raises(FutureMapError, match="^the draft stashed relays no field$"):
        ng.stash(t(3), DraftPayload())


def test_an_int_field_takes_rows_of_any_int_dtype_whose_values_fit() -> None:
    """An int field the first draft fixed at int32 takes later rows of another int dtype
    (int64, as torch.tensor of a list makes them; int16), cast where every value fits; a
    value beyond int32 and float rows are refused naming the field, nothing written
    (docs/CONTRACT.md, 'Relay fields': fm_jax judges them alike)."""
    fm = FutureMap(R, dtype=torch.int32, spec=True, consumed=("steps",))
    first = {"steps": torch.tensor([1, 2], dtype=torch.int32), "score": SCORES}
    fm.stash(t(3, 5), DraftPayload(extras=first))
    for rows in (torch.tensor([7, 8]), torch.tensor([7, 8], dtype=torch.int16)):
        fm.stash(t(3, 5), DraftPayload(extras={"steps": rows, "score": SCORES}))
        assert fm.extras["steps"].dtype == torch.int32
        assert fm.extras["steps"][[3, 5]].tolist() == [7, 8]
    before = snapshot(fm)
    for rows, match in (
        (torch.tensor([1, 2**31]), "draft.steps holds values that do not fit"),
        (torch.tensor([1.0, 2.0]), "draft.steps must have dtype in"),
    ):
        with pytest.raises(FutureMapError, match=match):
            fm.stash(t(3, 5), DraftPayload(extras={"steps": rows, "score": SCORES}))
        assert snapshot(fm) == before
    with pytest.raises(FutureMapError, match="draft.score must have dtype in"):
        fm.stash(t(3, 5), DraftPayload(extras={"steps": t(1, 2), "score": SCORES.float()}))
    assert snapshot(fm) == before
