"""SGLang 0.5.23's debug checks of the lengths, and the host side of a spec MIXED batch's
late binding, in both twins (docs/CONTRACT.md, 'Lengths: consumed once, read after a fresh
publish' and 'Two protocols').

- `new_seq_lens` starts poisoned in debug; a spec resolve that reads the verified lengths
  consumes them; `resolve_seq_lens_cpu` reports a poisoned length ('consume lengths
  (WRWR)') and, on a spec map, a read with no fresh publish behind it ('fresh publish').
- A spec MIXED batch's host fields: fm_torch rewrites the batch's `seq_lens_cpu`,
  `seq_lens_sum` and `prefix_lens`; fm_jax's `resolve_mixed_tails_cpu` returns them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from jax.experimental import checkify

import fm_jax as fj
import fm_torch as ft

R = 6
D, M, E = fj.ForwardMode.DECODE, fj.ForwardMode.MIXED, fj.ForwardMode.EXTEND
SPEC = fj.SpecConfig(topk=1)


def a(*x: int) -> np.ndarray:
    return np.array(x, np.int32)


def t(*x: int) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def jdraft(*bonus: int) -> fj.DraftPayload:
    n = len(bonus)
    return fj.DraftPayload(a(*bonus), np.ones((n, 1), np.float32), np.zeros((n, 1), np.int32))


def tdraft(*bonus: int) -> ft.DraftPayload:
    n = len(bonus)
    return ft.DraftPayload(t(*bonus), torch.ones(n, 1), torch.zeros(n, 1, dtype=torch.int64))


def jmap(protocol: str = "gather", spec: fj.SpecConfig | None = SPEC, **kw: object) -> fj.FutureMap:
    return fj.FutureMap(
        R, spec=spec, debug=True, protocol=protocol, batch_buckets=(4,), token_buckets=(8,), **kw
    )


def jdecode(protocol: str, *slots: int) -> fj.Batch:
    ids = a(*[0] * len(slots)) if protocol == "gather" else a(*[-s for s in slots])
    return fj.Batch(D, a(*slots), ids, ids, draft_indices=a(*slots))


def tdecode(protocol: str, *slots: int) -> ft.ScheduleBatch:
    ids = t(*[0] * len(slots)) if protocol == "gather" else t(*[-s for s in slots])
    return ft.ScheduleBatch(
        ft.ForwardMode.DECODE, t(*slots), ids, ids.clone(), ft.DraftInput(t(*slots))
    )


# ------------------------------------------------------------------ lengths: consumed once
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
@pytest.mark.parametrize("copy", [True, False])
def test_jax_spec_resolve_consumes_the_lengths_and_a_later_read_reports_them(
    protocol: str, copy: bool
) -> None:
    """fm_jax, spec, debug: a DECODE resolve writes -1 at the slots whose lengths it read
    (slot 4, not read, keeps its length); a read of them afterwards reports 'consume
    lengths (WRWR)', from the buffer even where the publish's host copy was kept."""
    fm = jmap(protocol, needs_cpu_seq_lens=copy)
    assert np.asarray(fm.buffers()["new_seq_lens"]).tolist() == [-1] * R
    fm.publish(a(1, 2, 4), a(5, 6, 7))
    fm.stash(a(1, 2), jdraft(8, 9))
    r = fm.resolve(jdecode(protocol, 1, 2))
    assert np.asarray(r.seq_lens)[:2].tolist() == [5, 6]
    assert np.asarray(fm.buffers()["new_seq_lens"])[1:5].tolist() == [-1, -1, -1, 7]
    # Exactly the slots last published (the copy's), the publish still fresh: only the
    # lengths are at fault.
    with pytest.raises(fj.InvariantViolation) as err:
        fm.resolve_seq_lens_cpu(a(1, 2, 4))
    assert err.value.invariant == "consume lengths (WRWR)" and err.value.slots == [2]


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_torch_spec_resolve_consumes_the_lengths_and_a_later_read_reports_them(
    protocol: str,
) -> None:
    """fm_torch, spec, debug: the same bytes and the same report as fm_jax's."""
    fm = ft.FutureMap(R, spec=True, debug=True, protocol=protocol)
    assert fm.new_seq_lens.tolist() == [-1] * R
    fm.publish(t(1, 2, 4), t(5, 6, 7))
    fm.stash(t(1, 2), tdraft(8, 9))
    assert fm.resolve_seq_lens_cpu(t(1, 2, 4)).tolist() == [5, 6, 7]
    b = tdecode(protocol, 1, 2)
    fm.resolve(b)
    assert b.seq_lens.tolist() == [5, 6]
    assert fm.new_seq_lens[1:5].tolist() == [-1, -1, -1, 7]
    fm.publish(t(4), t(8))
    with pytest.raises(ft.InvariantViolation) as err:
        fm.resolve_seq_lens_cpu(t(4, 2))
    assert err.value.invariant == "consume lengths (WRWR)" and err.value.slots == [2]


def test_a_second_spec_resolve_without_a_publish_is_caught_and_one_after_it_is_not() -> None:
    """Both twins: a spec DECODE resolving its lengths again with no publish between finds
    the poison ('seq_lens > 0'); with a publish between (and its tokens stashed), it is
    clean."""
    jm, tm = jmap("gather"), ft.FutureMap(R, spec=True, debug=True, protocol="gather")
    jm.publish(a(1), a(5))
    tm.publish(t(1), t(5))
    for _ in range(2):
        jm.stash(a(1), jdraft(3))
        tm.stash(t(1), tdraft(3))
        jm.resolve(jdecode("gather", 1))
        tm.resolve(tdecode("gather", 1))
        jm.check()
        jm.publish(a(1), a(6))
        tm.publish(t(1), t(6))
    jm.stash(a(1), jdraft(3))
    tm.stash(t(1), tdraft(3))
    jm.resolve(jdecode("gather", 1))
    tm.resolve(tdecode("gather", 1))
    jm.stash(a(1), jdraft(3))
    tm.stash(t(1), tdraft(3))
    jm.resolve(jdecode("gather", 1))
    with pytest.raises(fj.InvariantViolation, match=r"seq_lens > 0"):
        jm.check()
    with pytest.raises(ft.InvariantViolation, match=r"seq_lens > 0"):
        tm.resolve(tdecode("gather", 1))


def test_a_non_spec_restore_and_a_spec_mixed_binding_consume_no_length() -> None:
    """Only a spec resolve of verified lengths consumes them: a non-spec DECODE restore
    (SGLang's non-spec relay never reads lengths) and a spec MIXED batch's binding (its
    `resolve_mixed_spec_tails` does not poison) leave them, in both twins."""
    plain_j = fj.FutureMap(R, debug=True, batch_buckets=(4,), token_buckets=(8,))
    plain_t = ft.FutureMap(R, debug=True)
    plain_j.publish(a(1), a(5))
    plain_t.publish(t(1), t(5))
    plain_j.stash(a(1), a(3))
    plain_t.stash(t(1), t(3))
    plain_j.resolve(fj.Batch(D, a(1), a(-1), a(-1)))
    plain_t.resolve(ft.ScheduleBatch(ft.ForwardMode.DECODE, t(1), t(-1), t(-1)))
    plain_j.check()
    assert np.asarray(plain_j.buffers()["new_seq_lens"])[1] == plain_t.new_seq_lens[1] == 5
    jm, tm = jmap("gather"), ft.FutureMap(R, spec=True, debug=True, protocol="gather")
    jm.publish(a(2), a(6))
    tm.publish(t(2), t(6))
    jm.stash(a(2), jdraft(7))
    tm.stash(t(2), tdraft(7))
    jm.resolve(fj.Batch(M, a(3, 2), a(9, 9, 0), a(2, 1), token_slots=a(0, 0, 2)))
    tb = ft.ScheduleBatch(ft.ForwardMode.MIXED, t(3, 2), t(9, 9), t(2, 1), mix_running_indices=t(2))
    tm.resolve(tb)
    jm.check()
    assert np.asarray(jm.buffers()["new_seq_lens"])[2] == tm.new_seq_lens[2] == 6


def test_the_pure_ops_seq_lens_at_reports_a_poisoned_length() -> None:
    """The pure ops have no host read: `seq_lens_at` checks what it reads (a live slot
    never published is the poison; padding slot 0 is not checked)."""
    ops = fj.future_map(R, debug=True)
    at = checkify.checkify(ops.seq_lens_at, errors=checkify.user_checks)
    st = ops.publish(ops.init(), a(1), a(4))
    err, got = at(st, a(1, 0))
    fj.raise_if_violated(err)
    assert got.tolist()[0] == 4
    err, _ = at(st, a(1, 3))
    with pytest.raises(fj.InvariantViolation) as info:
        fj.raise_if_violated(err)
    assert info.value.invariant == "consume lengths (WRWR)" and info.value.slots == [3]


# ----------------------------------------------------------------------- fresh publish
@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_a_read_of_lengths_needs_a_fresh_publish_in_both_twins(protocol: str) -> None:
    """Spec, debug: each read with rows consumes the last publish (SGLang's consume-once
    wait): a second read with no publish between, or a read before any, is 'fresh
    publish' in both twins; a publish re-arms it; an empty read consumes nothing."""
    jm, tm = jmap(protocol), ft.FutureMap(R, spec=True, debug=True, protocol=protocol)
    with pytest.raises(fj.InvariantViolation, match="fresh publish"):
        jm.resolve_seq_lens_cpu(a(1))
    with pytest.raises(ft.InvariantViolation, match="fresh publish"):
        tm.resolve_seq_lens_cpu(t(1))
    jm.publish(a(1, 2), a(5, 6))
    tm.publish(t(1, 2), t(5, 6))
    assert jm.resolve_seq_lens_cpu(a(1, 2)).tolist() == [5, 6]
    assert tm.resolve_seq_lens_cpu(t(1, 2)).tolist() == [5, 6]
    assert jm.resolve_seq_lens_cpu(a()).tolist() == []  # no rows: nothing consumed
    assert tm.resolve_seq_lens_cpu(t()).tolist() == []
    with pytest.raises(fj.InvariantViolation) as jerr:
        jm.resolve_seq_lens_cpu(a(2))
    assert jerr.value.invariant == "fresh publish" and jerr.value.op == "resolve_seq_lens_cpu"
    with pytest.raises(ft.InvariantViolation, match="fresh publish"):
        tm.resolve_seq_lens_cpu(t(2))
    jm.publish(a(2), a(7))
    tm.publish(t(2), t(7))
    assert jm.resolve_seq_lens_cpu(a(2)).tolist() == tm.resolve_seq_lens_cpu(t(2)).tolist() == [7]


def test_fresh_publish_is_spec_and_debug_only_and_reset_disarms_it() -> None:
    """A map without spec, or without debug, reads lengths as often as it likes; reset()
    returns a debug spec map to 'no publish yet'."""
    for fm in (
        fj.FutureMap(R, debug=True, batch_buckets=(4,)),
        fj.FutureMap(R, spec=SPEC, batch_buckets=(4,)),
    ):
        fm.publish(a(1), a(5))
        for _ in range(2):
            assert fm.resolve_seq_lens_cpu(a(1)).tolist() == [5]
    for tm in (ft.FutureMap(R, debug=True), ft.FutureMap(R, spec=True)):
        tm.publish(t(1), t(5))
        for _ in range(2):
            assert tm.resolve_seq_lens_cpu(t(1)).tolist() == [5]
    fm = jmap()
    fm.publish(a(1), a(5))
    fm.reset()
    with pytest.raises(fj.InvariantViolation, match="fresh publish"):
        fm.resolve_seq_lens_cpu(a(1))


def test_an_engine_step_arms_the_fresh_publish_and_consumes_the_lengths() -> None:
    """fm_jax's engine step: its resolve consumes the lengths it reads and its publish arms
    the next read, which sees the step's lengths."""
    fm = jmap("gather")
    fm.publish(a(1), a(5))
    fm.stash(a(1), jdraft(3))

    def forward(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
        assert res.draft is not None
        return fj.StepOutput(res.seq_lens + 2, res.draft._replace(bonus_tokens=res.seq_lens))

    step = fm.engine_step(forward)
    assert fm.resolve_seq_lens_cpu(a(1)).tolist() == [5]
    step(jdecode("gather", 1))
    assert fm.resolve_seq_lens_cpu(a(1)).tolist() == [7]
    step(jdecode("gather", 1))
    assert fm.resolve_seq_lens_cpu(a(1)).tolist() == [9]


# ------------------------------------------------------------------ spec MIXED host tails
def _primed() -> tuple[fj.FutureMap, ft.FutureMap]:
    jm = jmap("gather")
    tm = ft.FutureMap(R, spec=True, debug=True, protocol="gather", dtype=torch.int32)
    jm.publish(a(1, 2, 3), a(5, 6, 9))
    tm.publish(t(1, 2, 3), torch.tensor([5, 6, 9], dtype=torch.int32))
    jm.stash(a(1, 2, 3), jdraft(7, 8, 9))
    tm.stash(t(1, 2, 3), tdraft(7, 8, 9))
    return jm, tm


def test_both_twins_rebind_a_spec_mixed_batchs_host_fields_alike() -> None:
    """Prefill slot 4 (3 tokens), then running slots 2 and 1, a padding row: the running
    rows' seq_lens_cpu become published + 1, their prefix_lens the published length, the
    sum is over the live rows; the prefill and padding rows keep the host's."""
    jm, tm = _primed()
    b = fj.Batch(M, a(4, 2, 1, 0), a(11, 12, 13, 0, 0), a(3, 2, 2, 9), token_slots=a(0, 0, 0, 2, 1))
    jm.resolve(b)
    got = jm.resolve_mixed_tails_cpu(b, prefix_lens=a(0, 1, 1, 0))
    assert isinstance(got, fj.MixedTails)
    assert got.seq_lens_cpu.tolist() == [3, 7, 6, 9] and got.seq_lens_sum == 16
    assert got.prefix_lens is not None and got.prefix_lens.tolist() == [0, 6, 5, 0]
    assert jm.resolve_mixed_tails_cpu(b).prefix_lens is None  # type: ignore[union-attr]
    tb = ft.ScheduleBatch(
        ft.ForwardMode.MIXED,
        t(4, 2, 1, 0),
        t(11, 12, 13),
        t(3, 2, 2, 9),
        mix_running_indices=t(2, 1),
        seq_lens_cpu=t(3, 2, 2, 9),
        prefix_lens=[0, 1, 1, 0],
    )
    tm.resolve(tb)
    assert tb.seq_lens_cpu is not None and tb.seq_lens_cpu.tolist() == [3, 7, 6, 9]
    assert tb.seq_lens_sum == 16 and tb.prefix_lens == [0, 6, 5, 0]
    jm.check()


def test_tails_come_from_the_publishs_host_copy_when_the_slots_are_among_its() -> None:
    """The running slots are among the last publish's: the tails take its host copy (no
    gather executable runs); slots it did not publish are gathered, with the same values."""
    jm, _ = _primed()
    b = fj.Batch(M, a(4, 3), a(11, 0), a(1, 1), token_slots=a(0, 3))
    calls: list[str] = []
    run = jm._run

    def counted(placed, op, **kw):  # type: ignore[no-untyped-def]
        calls.append(op)
        return run(placed, op, **kw)

    jm._run = counted  # type: ignore[method-assign]
    assert jm.resolve_mixed_tails_cpu(b).seq_lens_cpu.tolist() == [1, 10]  # type: ignore[union-attr]
    assert calls == []
    jm.publish(a(1), a(4))  # slot 3 is not among this publish's: gathered
    calls.clear()
    assert jm.resolve_mixed_tails_cpu(b).seq_lens_cpu.tolist() == [1, 10]  # type: ignore[union-attr]
    assert calls == ["resolve_seq_lens_cpu"]


def test_bad_tails_calls_are_refused_before_anything_is_read_or_written() -> None:
    """A map that has no spec MIXED batch, a batch that is not MIXED or not host arrays,
    running rows out of order, a prefix of another length: FutureMapError naming it; and
    fm_torch refuses malformed host fields before writing the batch or a buffer."""
    with pytest.raises(fj.FutureMapError, match="spec map of the gather protocol"):
        jmap("sentinel").resolve_mixed_tails_cpu(fj.Batch(M, a(1), a(1), a(1)))
    jm, tm = _primed()
    ok = fj.Batch(M, a(4, 2), a(11, 0), a(1, 1), token_slots=a(0, 2))
    for bad, word in [
        (ok._replace(forward_mode=E), "forward_mode must be MIXED"),
        (ok._replace(seq_lens=a(1)), "seq_lens has 1 rows"),
        (ok._replace(token_slots=np.asarray([0.0, 2.0])), "token_slots must be 1-D host ints"),
        (ok._replace(req_pool_indices=a(2, 4)), "lists its running rows last"),
    ]:
        with pytest.raises(fj.FutureMapError, match=word):
            jm.resolve_mixed_tails_cpu(bad)
    with pytest.raises(fj.FutureMapError, match="prefix_lens has 3 rows"):
        jm.resolve_mixed_tails_cpu(ok, prefix_lens=a(0, 0, 0))
    before = tm.new_seq_lens.clone()
    for fields, word in [
        ({"seq_lens_cpu": t(1)}, "seq_lens_cpu"),
        ({"seq_lens_cpu": t(1, 1).to(torch.float32)}, "seq_lens_cpu"),
        ({"prefix_lens": [0]}, "prefix_lens must be a list of 2 ints"),
        ({"seq_lens_cpu": t(-1, 1)}, r"seq_lens_cpu holds negative values \[-1\]"),
        ({"prefix_lens": [-1, 0]}, r"prefix_lens holds negative values \[-1\]"),
    ]:
        tb = ft.ScheduleBatch(
            ft.ForwardMode.MIXED, t(4, 2), t(11), t(1, 1), mix_running_indices=t(2), **fields
        )
        with pytest.raises(ft.FutureMapError, match=word):
            tm.resolve(tb)
        assert tb.input_ids.tolist() == [11] and torch.equal(tm.new_seq_lens, before)
