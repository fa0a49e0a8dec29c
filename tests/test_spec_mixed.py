"""Spec MIXED batches (docs/CONTRACT.md, 'Two protocols'): a gather-protocol feature in
both twins. The host plans the batch before the last verify's accept lengths land, so
resolve binds its running rows' lengths (the last live rows, one per running token) to the
published length + 1, as SGLang's `resolve_mixed_spec_tails` does; a batch whose running
rows are out of order is refused (host arrays) or reported (debug); the sentinel protocol
refuses a spec MIXED batch; and a slot the running rows and the draft both read is a
consume violation in both twins."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import checkify

import fm_jax as fj
import fm_torch as ft

R = 8
MIXED = fj.ForwardMode.MIXED
SPEC = fj.SpecConfig(topk=2)


def a(*x: int) -> np.ndarray:
    return np.array(x, np.int32)


def jax_draft(bonus: list[int]) -> Any:
    n = len(bonus)
    return fj.DraftPayload(a(*bonus), np.ones((n, 2), np.float32), np.zeros((n, 2), np.int32))


def torch_draft(bonus: list[int]) -> Any:
    n = len(bonus)
    return ft.DraftPayload(
        torch.tensor(bonus, dtype=torch.int32),
        torch.ones(n, 2),
        torch.zeros(n, 2, dtype=torch.int32),
    )


# A prefill row (slot 5, three prompt tokens), then running rows at slots 3 and 2, whose
# published lengths (20, 10) the host has not seen: it plans them with stale lengths 1.
ROWS, IDS, LENS = a(5, 3, 2), a(100, 101, 102, 0, 0), a(3, 1, 1)
TOKEN_SLOTS = a(0, 0, 0, 3, 2)
BOUND = [3, 21, 11]  # prefill as given; running rows published + 1


def jax_map(debug: bool, protocol: str = "gather") -> Any:
    fm = fj.FutureMap(
        R, spec=SPEC, debug=debug, protocol=protocol, batch_buckets=(4,), token_buckets=(8,)
    )
    if protocol == "gather":
        fm.publish(a(2, 3), a(10, 20))
        fm.stash(a(2, 3), jax_draft([7, 8]))
    return fm


def torch_map(debug: bool, protocol: str = "gather") -> Any:
    fm = ft.FutureMap(R, spec=True, debug=debug, protocol=protocol, dtype=torch.int32)
    if protocol == "gather":
        fm.publish(torch.tensor([2, 3]), torch.tensor([10, 20]))
        fm.stash(torch.tensor([2, 3]), torch_draft([7, 8]))
    return fm


def torch_batch(rows: np.ndarray, ids: np.ndarray, lens: np.ndarray, mix: np.ndarray) -> Any:
    return ft.ScheduleBatch(
        ft.ForwardMode.MIXED,
        torch.from_numpy(rows),
        torch.from_numpy(ids),
        torch.from_numpy(lens),
        mix_running_indices=torch.from_numpy(mix),
    )


@pytest.mark.parametrize("debug", [False, True])
def test_both_twins_bind_the_running_rows_lengths_at_resolve(debug: bool) -> None:
    """The running rows get the published length + 1 (prefill rows keep the host's), and
    their ids are the bonus tokens gathered at their slots: the same bytes in both twins."""
    jm, tm = jax_map(debug), torch_map(debug)
    r = jm.resolve(fj.Batch(MIXED, ROWS, IDS, LENS, token_slots=TOKEN_SLOTS))
    tb = torch_batch(ROWS, IDS[:3], LENS, a(3, 2))
    tm.resolve(tb)
    assert np.asarray(r.seq_lens)[:3].tolist() == BOUND == tb.seq_lens.tolist()
    assert np.asarray(r.input_ids)[:5].tolist() == [100, 101, 102, 8, 7] == tb.input_ids.tolist()
    assert np.asarray(r.seq_lens)[:3].tobytes() == tb.seq_lens.numpy().tobytes()
    jm.check()


def test_padding_rows_after_the_running_rows_keep_their_lengths() -> None:
    """Padding rows (slot 0) come after the running rows: the running rows are the last
    live rows, not the last rows (fm_torch given a padded batch, fm_jax padding to its
    bucket)."""
    tm = torch_map(False)
    tb = torch_batch(a(5, 3, 2, 0), IDS[:3], a(3, 1, 1, 4), a(3, 2))
    tm.resolve(tb)
    assert tb.seq_lens.tolist() == [*BOUND, 4]
    jm = jax_map(False)
    r = jm.resolve(fj.Batch(MIXED, a(5, 3, 2, 0), IDS, a(3, 1, 1, 4), token_slots=TOKEN_SLOTS))
    assert np.asarray(r.seq_lens).tolist() == [*BOUND, 4]


def test_running_rows_out_of_token_order_are_refused_by_both_twins() -> None:
    """Lengths bound at the wrong rows would be another request's: a batch whose last live
    rows are not its running slots in order is refused before anything is written."""
    jm, tm = jax_map(False), torch_map(False)
    before = jax.tree.map(np.asarray, jm.state)
    with pytest.raises(fj.FutureMapError, match="running rows last"):
        jm.resolve(fj.Batch(MIXED, ROWS, IDS, LENS, token_slots=a(0, 0, 0, 2, 3)))
    with pytest.raises(ft.FutureMapError, match="running rows last"):
        tm.resolve(torch_batch(ROWS, IDS[:3], LENS, a(2, 3)))
    after = jax.tree.map(np.asarray, jm.state)
    assert jax.tree.all(jax.tree.map(np.array_equal, before, after))
    assert jm.step == 0


def test_the_pure_ops_report_running_rows_out_of_order_in_debug() -> None:
    """Where the arrays are on the device (the pure ops, traced), debug reports the order
    ('batch fields'); a batch in order passes and binds the lengths."""
    ops = fj.future_map(R, spec=SPEC, debug=True, protocol="gather")
    state = ops.publish(ops.init(), jnp.array([2, 3]), jnp.array([10, 20]))
    state = ops.stash(state, jnp.array([2, 3]), jax_draft([7, 8]))
    resolve = jax.jit(checkify.checkify(ops.resolve))

    def batch(ts: np.ndarray) -> Any:
        return fj.Batch(jnp.int32(MIXED), jnp.asarray(ROWS), jnp.asarray(IDS), LENS, None, ts)

    err, (_, r) = resolve(state, batch(TOKEN_SLOTS))
    err.throw()
    assert np.asarray(r.seq_lens).tolist() == BOUND
    err, _ = resolve(state, batch(a(0, 0, 0, 2, 3)))
    with pytest.raises(checkify.JaxRuntimeError, match="token-slot order"):
        err.throw()


def test_a_running_row_never_published_is_reported_by_both_twins() -> None:
    """Debug: a running row's bound length must come from a publish (> 0)."""
    jm, tm = jax_map(True), torch_map(True)
    rows, ts = a(5, 4), a(0, 0, 0, 4)
    jm.stash(a(4), jax_draft([9]))
    tm.stash(torch.tensor([4]), torch_draft([9]))
    jm.resolve(fj.Batch(MIXED, rows, a(1, 2, 3, 0), a(3, 1), token_slots=ts))
    with pytest.raises(fj.InvariantViolation, match="seq_lens > 0"):
        jm.check()
    with pytest.raises(ft.InvariantViolation, match="seq_lens > 0"):
        tm.resolve(torch_batch(rows, a(1, 2, 3), a(3, 1), a(4)))


def test_a_slot_the_running_rows_and_the_draft_both_read_is_read_twice() -> None:
    """Defect (reliability round two; the gather state machine's finding F1): one resolve
    reading a slot's bonus token for a running row and again for the draft reads it twice,
    and fm_jax did not report it where fm_torch did. In order, the draft's read finds the
    poison the first left; both twins report it (SGLang: its second consume assert fires)."""
    jm, tm = jax_map(True), torch_map(True)
    jm.resolve(fj.Batch(MIXED, ROWS, IDS, LENS, a(0, 3, 2), TOKEN_SLOTS))
    with pytest.raises(fj.InvariantViolation, match="consume"):
        jm.check()
    tb = torch_batch(ROWS, IDS[:3], LENS, a(3, 2))
    tb.draft = ft.DraftInput(torch.tensor([0, 3, 2]))
    with pytest.raises(ft.InvariantViolation, match="consume"):
        tm.resolve(tb)


def test_only_the_draft_rows_that_read_a_running_slot_read_it_twice() -> None:
    """The draft reads slot 5 (a prefill row's, stashed, no running row reads it) and slot 2
    (a running row's, read first by the token slots): only slot 2 is read twice, and both
    twins name slot 2 alone (a check that marked every draft row once any draft slot was a
    running one named slot 5)."""
    jm, tm = jax_map(True), torch_map(True)
    jm.publish(a(5), a(30))
    jm.stash(a(5), jax_draft([9]))
    tm.publish(torch.tensor([5]), torch.tensor([30]))
    tm.stash(torch.tensor([5]), torch_draft([9]))
    jm.resolve(fj.Batch(MIXED, ROWS, IDS, LENS, a(5, 0, 2), TOKEN_SLOTS))
    with pytest.raises(fj.InvariantViolation, match=r"\[consume \(WRWR\)\] slot 2 was read"):
        jm.check()
    tb = torch_batch(ROWS, IDS[:3], LENS, a(3, 2))
    tb.draft = ft.DraftInput(torch.tensor([5, 0, 2]))
    with pytest.raises(ft.InvariantViolation, match=r"\(slots \[2\]\)"):
        tm.resolve(tb)


def test_the_sentinel_protocol_refuses_a_spec_mixed_batch() -> None:
    """The sentinel protocol has no spec MIXED batch (its running rows' sentinels would
    never be filled): both twins refuse one whose kind is known on the host."""
    jm, tm = jax_map(False, "sentinel"), torch_map(False, "sentinel")
    with pytest.raises(fj.FutureMapError, match="gather-protocol feature"):
        jm.resolve(fj.Batch(MIXED, ROWS, a(100, 101, 102, -3, -2), LENS))
    with pytest.raises(ft.FutureMapError, match="gather-protocol feature"):
        tm.resolve(
            ft.ScheduleBatch(
                ft.ForwardMode.MIXED,
                torch.from_numpy(ROWS),
                torch.tensor([100, 101, 102, -3, -2]),
                torch.from_numpy(LENS),
            )
        )


def test_the_sentinel_protocol_reports_a_traced_spec_mixed_batch_in_debug() -> None:
    """Where the kind is known only on the device, a sentinel spec map's debug reports a
    MIXED batch ('batch fields') instead of handing the forward its unfilled sentinels."""
    ops = fj.future_map(R, spec=SPEC, debug=True)
    state = ops.publish(ops.init(), jnp.array([2, 3]), jnp.array([10, 20]))
    resolve = jax.jit(checkify.checkify(ops.resolve))
    ids = jnp.array([100, 101, 102, -3, -2], jnp.int32)
    for mode, bad in ((fj.ForwardMode.EXTEND, False), (MIXED, True)):
        err, _ = resolve(state, fj.Batch(jnp.int32(mode), jnp.asarray(ROWS), ids, LENS))
        if bad:
            # The message names the mode as the int it is.
            named = rf"spec MIXED batch \(forward_mode {int(MIXED)}\) in the sentinel protocol"
            with pytest.raises(checkify.JaxRuntimeError, match=named):
                err.throw()
        else:
            err.throw()


def test_fm_torch_spec_mixed_keeps_its_dtype_names_its_field_and_counts_slot_one() -> None:
    """fm_torch: the bound lengths are in the map's int dtype whatever the host's; a MIXED
    batch listing more running slots than rows is refused naming mix_running_indices; slot
    1 is a live slot like any other (a running row there is bound)."""
    tm = torch_map(False)
    tm.publish(torch.tensor([1]), torch.tensor([6]))
    tm.stash(torch.tensor([1]), torch_draft([5]))
    lens = torch.tensor([3, 1], dtype=torch.int64)
    tb = ft.ScheduleBatch(
        ft.ForwardMode.MIXED,
        torch.tensor([5, 1]),
        torch.tensor([100, 101, 102]),
        lens,
        mix_running_indices=torch.tensor([1]),
    )
    tm.resolve(tb)
    assert tb.seq_lens.dtype == torch.int32 and tb.seq_lens.tolist() == [3, 7]
    too_many = torch_batch(a(5, 3), IDS[:3], a(3, 1), a(3, 2, 1))
    with pytest.raises(ft.FutureMapError, match="^mix_running_indices has 3 entries"):
        tm.resolve(too_many)


def test_the_running_row_check_holds_at_edge_sizes_and_slot_one() -> None:
    """Debug's running-row order check (pure ops, traced): one row and one token (out of
    order: reported), a batch of running rows only (no prefill token), a running row at
    slot 1, the first live slot, and a batch of no token (in order: not reported; an empty
    token-slot check once read its padding as a slot named)."""
    ops = fj.future_map(R, spec=SPEC, debug=True, protocol="gather")
    state = ops.publish(ops.init(), jnp.array([1, 2, 3]), jnp.array([5, 10, 20]))
    state = ops.stash(state, jnp.array([1, 2, 3]), jax_draft([6, 7, 8]))
    resolve = jax.jit(checkify.checkify(ops.resolve))

    def run(rows: np.ndarray, ids: np.ndarray, ts: np.ndarray) -> Any:
        lens = jnp.ones(len(rows), jnp.int32)
        b = fj.Batch(jnp.int32(MIXED), jnp.asarray(rows), jnp.asarray(ids), lens, None, ts)
        err, (_, r) = resolve(state, b)
        return err, np.asarray(r.seq_lens).tolist()

    err, _ = run(a(3), a(0), a(2))  # one row, one token: the row is not the token's slot
    with pytest.raises(checkify.JaxRuntimeError, match="token-slot order"):
        err.throw()
    for rows, ids, ts, bound in (
        (a(3), a(0), a(3), [21]),
        (a(3, 2), a(0, 0), a(3, 2), [21, 11]),  # running rows only, in order
        (a(5, 1), a(100, 0), a(0, 1), [1, 6]),  # a running row at slot 1
        (a(5, 1), a(), a(), [1, 1]),  # no token: no running row
    ):
        err, lens = run(rows, ids, ts)
        err.throw()
        assert lens == bound


def test_the_host_order_check_counts_slot_one_and_names_the_batch() -> None:
    """The class's host check of a spec MIXED batch's running rows: slot 1, the first live
    slot, is a running row like any other (in order: taken and bound; out of order:
    refused), and the refusal names the batch's field and both lists."""
    jm = jax_map(False)
    jm.publish(a(1), a(30))
    jm.stash(a(1), jax_draft([9]))
    ok = jm.resolve(fj.Batch(MIXED, a(5, 1), a(100, 101, 0, 0), a(2, 1), token_slots=a(0, 0, 1, 0)))
    assert np.asarray(ok.seq_lens)[:2].tolist() == [2, 31]
    with pytest.raises(
        fj.FutureMapError,
        match=r"^batch\.token_slots name running slots \[2, 1\], but the batch's last live rows "
        r"hold \[1, 2\]",
    ):
        jm.resolve(fj.Batch(MIXED, a(5, 1, 2), IDS, a(3, 1, 1), token_slots=a(0, 0, 0, 2, 1)))


@pytest.mark.parametrize("on_device", ["req_pool_indices", "token_slots"])
def test_a_half_device_spec_mixed_batch_is_left_to_debug(on_device: str) -> None:
    """The host order check reads host arrays only: a spec MIXED batch whose slots or token
    slots are a jax array is taken without a host read of either (a read would wait on the
    device), and debug reports its running rows out of token order at check()."""
    jm = jax_map(True)
    fields = {"req_pool_indices": a(5, 3, 2, 0), "token_slots": a(0, 0, 0, 2, 3, 0, 0, 0)}
    fields[on_device] = jnp.asarray(fields[on_device])
    ids, lens = a(100, 101, 102, 0, 0, 0, 0, 0), a(3, 1, 1, 1)
    jm.resolve(fj.Batch(MIXED, fields["req_pool_indices"], ids, lens, None, fields["token_slots"]))
    with pytest.raises(fj.InvariantViolation, match="not in token-slot order"):
        jm.check()
