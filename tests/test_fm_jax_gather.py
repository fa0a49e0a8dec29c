"""fm_jax's gather protocol (docs/CONTRACT.md, 'Two protocols'): resolve builds the forward's
inputs at its entry; no sentinels, no invalidate; spec lengths gathered on the device."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import fm_jax as fj
from fm_parity.transfers import no_device_to_host

R = 8
E, D, M = fj.ForwardMode.EXTEND, fj.ForwardMode.DECODE, fj.ForwardMode.MIXED


def gather_map(**kw: Any) -> fj.FutureMap:
    kw.setdefault("batch_buckets", (1, 2, 4))
    kw.setdefault("token_buckets", (1, 2, 4, 8))
    return fj.FutureMap(R, protocol="gather", **kw)


def a(*x: int) -> np.ndarray:
    return np.array(x, np.int32)


def host(x: Any) -> list[Any]:
    return np.asarray(x).tolist()  # type: ignore[no-any-return]


def buffers(fm: fj.FutureMap) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}


def primed(**kw: Any) -> fj.FutureMap:
    """A map whose slots 3 and 5 hold lengths 4, 6 and tokens 30, 50."""
    fm = gather_map(**kw)
    fm.publish(a(3, 5), a(4, 6))
    fm.stash(a(3, 5), a(30, 50))
    return fm


@pytest.mark.parametrize("debug", [False, True])
def test_each_batch_kind_builds_its_ids(debug: bool) -> None:
    """EXTEND keeps the host's ids and lengths; DECODE gathers its ids at its slots (lengths
    the host's); MIXED puts the running rows' tokens at their positions after the prefill
    ids; IDLE changes nothing."""
    fm = primed(debug=debug)
    r = fm.resolve(fj.Batch(E, a(2), a(7, 8, 9), a(3)))
    assert host(r.input_ids)[:3] == [7, 8, 9] and host(r.seq_lens)[:1] == [3]
    r = fm.resolve(fj.Batch(D, a(3, 5), None, a(5, 7)))
    assert host(r.input_ids)[:2] == [30, 50] and host(r.seq_lens)[:2] == [5, 7]
    fm.stash(a(3, 5), a(31, 51))
    mixed = fj.Batch(M, a(2, 5, 3), a(7, 8, 0, 0), a(3, 7, 5), token_slots=a(0, 0, 5, 3))
    r = fm.resolve(mixed)
    assert host(r.input_ids)[:4] == [7, 8, 51, 31] and host(r.seq_lens)[:3] == [3, 7, 5]
    r = fm.resolve(fj.Batch(fj.ForwardMode.IDLE, a(), a(), a()))
    assert host(r.input_ids) == [0]
    fm.check()


def test_a_decode_batch_brings_no_ids() -> None:
    """A non-spec DECODE batch known on the host brings no ids (None: all are gathered, so
    none is placed or transferred); ids given, host or device, are refused, as fm_torch
    refuses them, rather than dropped."""
    fm = primed()
    assert host(fm.resolve(fj.Batch(D, a(3, 5), None, a(5, 7))).input_ids) == [30, 50]
    for ids in (a(9, 9), jax.device_put(a(1, 1))):
        with pytest.raises(fj.FutureMapError, match="input_ids given for a DECODE batch"):
            fm.resolve(fj.Batch(D, a(3, 5), ids, a(5, 7)))


@pytest.mark.parametrize("debug", [False, True])
def test_a_traced_mode_resolves_like_a_host_mode(debug: bool) -> None:
    """One executable with the mode traced gives each kind what its fixed-mode executable
    gives, and (debug) poisons the same slots."""
    batches = [
        fj.Batch(E, a(2, 0), a(7, 8, 9, 0), a(3, 0), token_slots=a(0, 0, 0, 0)),
        fj.Batch(D, a(3, 5, 0, 0), a(0, 0, 0, 0), a(5, 7, 0, 0)),
        fj.Batch(M, a(2, 5), a(7, 0, 0, 0), a(3, 7), token_slots=a(0, 5, 0, 0)),
    ]
    for b in batches:
        fixed, traced = primed(debug=debug), primed(debug=debug)
        # A host-known DECODE brings no ids; a traced one the array every kind shares.
        want = fixed.resolve(b._replace(input_ids=None) if b.forward_mode == D else b)
        got = traced.resolve(b._replace(forward_mode=jnp.int32(int(b.forward_mode))))
        n = len(b.req_pool_indices)
        assert host(got.input_ids)[: len(b.input_ids)] == host(want.input_ids)[: len(b.input_ids)]
        assert host(got.seq_lens)[:n] == host(want.seq_lens)[:n]
        if debug:
            assert buffers(traced) == buffers(fixed), b.forward_mode


def test_pure_ops_gather_under_jit() -> None:
    """The pure ops, inlined in a jitted step: DECODE gathers, MIXED places the running
    rows' tokens, and invalidate is refused (no sentinels in this protocol)."""
    ops = fj.future_map(R, protocol="gather")
    st = ops.publish(ops.init(), a(3, 5), a(4, 6))
    st = ops.stash(st, a(3, 5), a(30, 50))

    @jax.jit
    def step(st: fj.FutureMapState, mode: jax.Array, ids: jax.Array, slots: jax.Array) -> Any:
        return ops.resolve(st, fj.Batch(mode, a(3, 5), ids, a(5, 7), token_slots=slots))[1]

    out = step(st, jnp.int32(D), a(0, 0, 0), a(0, 0, 0))
    assert host(out.input_ids) == [30, 50, 0]
    out = step(st, jnp.int32(M), a(4, 0, 0), a(0, 5, 3))
    assert host(out.input_ids) == [4, 50, 30]
    with pytest.raises(fj.FutureMapError, match="no sentinels"):
        ops.invalidate(fj.Batch(D, a(3), a(0), a(0)), a(3))


def test_spec_lengths_are_gathered_at_the_draft_indices() -> None:
    """A spec batch with a draft gets `new_seq_lens[draft_indices]` as its lengths (not the
    host's) with the draft extras; its input ids are the host's."""
    fm = gather_map(spec=fj.SpecConfig(topk=2), debug=True)
    fm.publish(a(3, 5), a(9, 4))
    p = np.array([[0.5, 0.25], [1.0, -0.0]], np.float32)
    fm.stash(a(3, 5), fj.DraftPayload(a(30, 50), p, a(1, 2, 3, 4).reshape(2, 2)))
    r = fm.resolve(fj.Batch(D, a(5, 3), a(1, 1), a(0, 0), draft_indices=a(5, 3)))
    assert host(r.seq_lens)[:2] == [4, 9] and host(r.input_ids)[:2] == [1, 1]
    assert r.draft is not None
    assert host(r.draft.bonus_tokens)[:2] == [50, 30]
    assert np.asarray(r.draft.topk_p)[:2].tobytes() == p[::-1].tobytes()
    fm.check()


def spec_step(fm: fj.FutureMap, lens: np.ndarray) -> None:
    slots = a(3, 5)
    draft = fj.DraftPayload(a(30, 50), np.ones((2, 2), np.float32), a(0, 0, 0, 0).reshape(2, 2))
    fm.resolve(fj.Batch(D, slots, a(0, 0), a(0, 0), draft_indices=slots))
    fm.publish(slots, lens)
    fm.stash(slots, draft)


def test_a_spec_step_without_the_host_copy_moves_nothing_to_the_host() -> None:
    """With the host length copy off (`needs_cpu_seq_lens=False`), a gather-protocol spec
    step (resolve, publish, stash) does no device-to-host transfer; asking for the lengths
    then gathers them, one transfer (so the detector is live)."""
    fm = gather_map(spec=fj.SpecConfig(topk=2), needs_cpu_seq_lens=False)
    fm.publish(a(3, 5), a(4, 6))
    spec_step(fm, a(5, 7))  # compile outside the guard
    with no_device_to_host():
        for n in range(3):
            spec_step(fm, a(6 + n, 8 + n))
        with pytest.raises(Exception, match="transfer"):
            fm.resolve_seq_lens_cpu(a(3, 5))
    assert host(fm.resolve_seq_lens_cpu(a(3, 5))) == [8, 10]


def test_the_detector_catches_a_step_that_still_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mistake the host-copy switch invites: lengths not asked for, yet read back (here
    a resolve that hands its lengths to the host). The detector of the zero-transfer test
    catches it, so that test can fail."""
    fm = gather_map(spec=fj.SpecConfig(topk=2))
    fm.publish(a(3, 5), a(4, 6))
    spec_step(fm, a(5, 7))
    real = fj.FutureMap.resolve

    def syncing(self: fj.FutureMap, *args: Any, **kw: Any) -> fj.Resolved:
        out = real(self, *args, **kw)
        jax.device_get(out.seq_lens)  # the sync a skipped host copy must not do
        return out

    monkeypatch.setattr(fj.FutureMap, "resolve", syncing)
    with no_device_to_host(), pytest.raises(Exception, match="transfer"):
        spec_step(fm, a(6, 8))


@pytest.mark.parametrize("kind", ["decode", "mixed", "spec"])
def test_debug_reports_a_second_read_and_poisons_exactly_the_slots_read(kind: str) -> None:
    """Every gather from output_tokens is consume-checked: the first read passes and writes
    -1 at exactly the slots it read (slot 7, never read, keeps its token); a second read
    with no stash between is reported."""
    spec = fj.SpecConfig(topk=1) if kind == "spec" else None
    fm = gather_map(debug=True, spec=spec)
    fm.publish(a(3, 5, 7), a(4, 6, 8))
    if spec is None:
        fm.stash(a(3, 5, 7), a(30, 50, 70))
        b = (
            fj.Batch(D, a(3, 5), None, a(5, 7))
            if kind == "decode"
            else fj.Batch(M, a(2, 3, 5), a(9, 0, 0), a(1, 5, 7), token_slots=a(0, 3, 5))
        )
    else:
        p = np.zeros((3, 1), np.float32)
        fm.stash(a(3, 5, 7), fj.DraftPayload(a(30, 50, 70), p, a(0, 0, 0).reshape(3, 1)))
        b = fj.Batch(D, a(3, 5), a(0, 0), a(0, 0), draft_indices=a(3, 5))
    fm.resolve(b)
    fm.check()
    tokens = host(fm.state.output_tokens)
    assert tokens[3] == tokens[5] == -1 and tokens[7] == 70
    if spec is not None:  # a spec DECODE consumed its lengths too: only the tokens read twice
        fm.publish(a(3, 5), a(4, 6))
    fm.resolve(b)
    with pytest.raises(fj.InvariantViolation, match=r"consume \(WRWR\)"):
        fm.check()


def test_debug_reports_a_spec_length_never_published() -> None:
    """A gathered spec length must be > 0: a draft slot never published is reported."""
    fm = gather_map(debug=True, spec=fj.SpecConfig(topk=1))
    fm.stash(a(3), fj.DraftPayload(a(30), np.zeros((1, 1), np.float32), a(0).reshape(1, 1)))
    fm.resolve(fj.Batch(D, a(3), a(0), a(0), draft_indices=a(3)))
    with pytest.raises(fj.InvariantViolation, match=r"seq_lens > 0"):
        fm.check()


REFUSED = {
    "invalidate": (lambda fm: fm.invalidate(fj.Batch(D, a(3), None, a(1)), a(3)), "no sentinels"),
    "negative id": (
        lambda fm: fm.resolve(fj.Batch(E, a(3), a(-3, 4), a(2))),
        r"input_ids holds negative ids \[-3\]",
    ),
    "MIXED without slots": (
        lambda fm: fm.resolve(fj.Batch(M, a(2, 3), a(9, 0), a(1, 5))),
        "MIXED batch in the gather protocol needs token_slots",
    ),
    "slots on DECODE": (
        lambda fm: fm.resolve(fj.Batch(D, a(3), None, a(5), token_slots=a(3))),
        "token_slots given for a DECODE batch",
    ),
    "slot out of range": (
        lambda fm: fm.resolve(fj.Batch(M, a(2, 3), a(9, 0), a(1, 5), token_slots=a(0, R))),
        "token_slots",
    ),
    "slot twice": (
        lambda fm: fm.resolve(fj.Batch(M, a(2, 3), a(9, 0, 0), a(1, 5), token_slots=a(0, 3, 3))),
        "token_slots",
    ),
    "slots not aligned": (
        lambda fm: fm.resolve(fj.Batch(M, a(2, 3), a(9, 0), a(1, 5), token_slots=a(0, 0, 3))),
        "token_slots has",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_gather_input_is_refused_and_changes_nothing(case: str) -> None:
    """Each bad gather-protocol input is refused with a FutureMapError naming it, every
    buffer byte-identical afterwards, the step count unchanged, and the map still works."""
    call, message = REFUSED[case]
    fm = primed(debug=True)
    before, step = buffers(fm), fm.step
    with pytest.raises(fj.FutureMapError, match=message):
        call(fm)
    assert buffers(fm) == before and fm.step == step
    assert host(fm.resolve(fj.Batch(D, a(3, 5), None, a(5, 7))).input_ids) == [30, 50]
    fm.check()


def test_protocol_is_validated_and_token_slots_need_the_gather_protocol() -> None:
    """An unknown protocol is refused by name; a sentinel map refuses token slots and a
    batch without ids, the latter with the whole message (it names the field and why)."""
    with pytest.raises(fj.FutureMapError, match="protocol must be one of"):
        fj.FutureMap(R, protocol="sentinels")
    with pytest.raises(fj.FutureMapError, match="protocol must be one of"):
        fj.future_map(R, protocol=None)  # type: ignore[arg-type]
    fm = fj.FutureMap(R)
    with pytest.raises(fj.FutureMapError, match="token_slots is for the gather protocol"):
        fm.resolve(fj.Batch(M, a(2, 3), a(9, -3), a(1, 5), token_slots=a(0, 3)))
    ops = fj.future_map(R)
    whole = r"^batch\.input_ids is None: a sentinel-protocol batch has ids$"
    with pytest.raises(fj.FutureMapError, match=whole):
        ops.resolve(ops.init(), fj.Batch(E, a(3), None, a(1)))


def test_finish_is_publish_and_stash_and_returns_the_batch() -> None:
    """finish writes what publish + stash write, and leaves the batch as given."""
    one, three = gather_map(), gather_map()
    b = fj.Batch(D, a(3, 5), None, a(5, 7))
    assert one.finish(b, a(3, 5), a(5, 7), a(31, 51)) is b
    three.publish(a(3, 5), a(5, 7))
    three.stash(a(3, 5), a(31, 51))
    assert buffers(one) == buffers(three)
    assert one.finish(b, a(), a(), a()) is b  # an idle rank


def test_a_gather_loop_serves_from_warmed_executables_only() -> None:
    """After warm_up(guard=True), a loop of every batch kind (host and traced modes) runs
    without a compile: the plan covers MIXED's token slots and has no sentinels."""
    fm = gather_map(debug=True)
    report = fm.warm_up(guard=True)
    assert "sentinels" not in report.by_op
    fm.publish(a(3, 5), a(4, 6))
    for step in range(3):
        fm.stash(a(3, 5), a(30 + step, 50 + step))
        if step == 1:
            b = fj.Batch(M, a(2, 3, 5), a(9, 0, 0), a(1, 5, 7), token_slots=a(0, 3, 5))
        else:
            b = fj.Batch(D, a(3, 5), None, a(5, 7))
        # A traced DECODE brings ids (placeholders: its kind is known only on the device).
        fm.resolve(b if step < 2 else b._replace(forward_mode=jnp.int32(D), input_ids=a(0, 0)))
    fm.check()


def test_a_resolve_refused_when_traced_takes_no_step() -> None:
    """Pins a resolve refused while its executable was traced still counting a step: the
    step count (what debug reports name) stays where it was."""
    fm = primed(debug=True)
    slots = jax.device_put(a(3, 5))
    with pytest.raises(fj.FutureMapError, match="fewer than the 2 rows"):
        mode = jnp.int32(D)  # traced: ids of one token for two rows reach the trace
        fm.resolve(fj.Batch(mode, slots, jax.device_put(a(0)), jax.device_put(a(5, 7))))
    assert fm.step == 0
    fm.resolve(fj.Batch(D, a(3, 5), None, a(5, 7)))
    assert fm.step == 1
    fm.check()


def test_a_negative_id_refusal_lists_the_negative_ones_only() -> None:
    """The gather protocol's negative-id refusal lists the negative ids (not 0), at most
    eight of them."""
    fm = primed()
    with pytest.raises(fj.FutureMapError) as err:
        fm.resolve(fj.Batch(E, a(3), a(0, 7, -3), a(2)))
    assert str(err.value).startswith("input_ids holds negative ids [-3]:"), str(err.value)
    wide = fj.FutureMap(R, protocol="gather")  # token buckets up to 8192
    with pytest.raises(fj.FutureMapError) as err:
        wide.resolve(fj.Batch(E, a(3), a(*range(-1, -11, -1)), a(2)))
    assert str(err.value).startswith(
        "input_ids holds negative ids [-1, -2, -3, -4, -5, -6, -7, -8]:"
    )


def test_token_slots_are_placed_at_the_ids_size() -> None:
    """Token slots take the size the ids were placed at (a `tokens=` bucket larger than
    their own), and per-rank slots given as a mapping are checked against the ids' counts."""
    fm = primed()
    b = fj.Batch(M, a(2, 5), a(7, 0), a(3, 7), token_slots=a(0, 5))
    r = fm.resolve(b, tokens=8)
    assert host(r.input_ids) == [7, 50, 0, 0, 0, 0, 0, 0]
    fm.stash(a(5), a(51))
    r = fm.resolve({0: b})
    assert host(r.input_ids)[:2] == [7, 51]
    fm.stash(a(5), a(52))
    with pytest.raises(fj.FutureMapError, match=r"token_slots has \(3,\) entries per rank"):
        fm.resolve({0: b._replace(token_slots=a(0, 5, 0))})
    with pytest.raises(fj.FutureMapError, match=r"token_slots has \(-1,\) entries per rank"):
        fm.resolve(b._replace(token_slots=np.int32(5)))


def test_host_token_slots_beside_device_ids_and_ragged_ones() -> None:
    """Host token slots beside ids already on the device (a bucket's size: no per-rank
    counts to match them against) are placed at the ids' size and gathered; token slots
    that are no array (ragged rows) are refused naming token_slots, given whole or per
    rank."""
    fm = primed()
    ids = jax.device_put(a(7, 0))
    r = fm.resolve(fj.Batch(M, a(2, 5), ids, a(3, 7), token_slots=a(0, 5)))
    assert host(r.input_ids) == [7, 50]
    fm.stash(a(5), a(51))
    before = buffers(fm)
    bad = fj.Batch(M, a(2, 5), a(7, 0), a(3, 7), token_slots=[[0], [5, 5]])
    for x in (bad, {0: bad}):
        with pytest.raises(fj.FutureMapError, match="^token_slots is not an array"):
            fm.resolve(x)
    assert buffers(fm) == before


def test_a_rank_left_out_of_per_rank_token_slots_counts_no_entries() -> None:
    """A rank missing from every per-rank mapping is idle: its token slots count 0 entries,
    matching its ids, and the resolve moves nothing (here the one rank of one device)."""
    fm = primed()
    before = buffers(fm)
    r = fm.resolve(fj.Batch(M, {}, {}, {}, token_slots={}))
    assert host(r.input_ids) == [0]
    assert buffers(fm) == before


# -------------------------------------------------- which fields a batch brings
def test_a_traced_mixed_batch_without_token_slots_is_reported() -> None:
    """Defect (reliability round two, 1): a gather MIXED batch without token_slots whose kind
    is known only on the device was accepted silently, its running rows keeping the host's
    placeholder ids. Debug now reports it as a batch-fields violation; on the host (a host
    mode, or a mesh rank's) it is refused before anything runs."""
    fm = primed(debug=True)
    fm.resolve(fj.Batch(jnp.int32(M), a(2, 5), a(7, 0), a(3, 7)))
    with pytest.raises(fj.InvariantViolation, match=r"\[batch fields\] a MIXED batch"):
        fm.check()
    before = buffers(fm)
    with pytest.raises(fj.FutureMapError, match="MIXED batch in the gather protocol needs"):
        fm.resolve(fj.Batch(M, a(2, 5), a(7, 0), a(3, 7)))
    assert buffers(fm) == before
    fm.resolve(fj.Batch(jnp.int32(E), a(2), a(7), a(3)))  # not MIXED: nothing to report
    fm.check()


def test_token_slots_of_a_batch_that_is_not_mixed() -> None:
    """Defect (reliability round two, 2): a gather batch that was not MIXED but carried
    nonzero token_slots gathered into its prefill ids, and in debug consumed the slot, so
    the slot's next legitimate read was reported against the wrong op. On the host (a host
    mode, or a mesh rank's) nonzero token slots outside MIXED are refused, buffers
    untouched; with a traced mode they are reported, not gathered, and the slot is not
    consumed. All-zero token slots gather nothing and are accepted."""
    fm = primed(debug=True)
    before = buffers(fm)
    for mode in (E, fj.ForwardMode.IDLE):
        with pytest.raises(fj.FutureMapError, match="only a MIXED batch has running rows"):
            fm.resolve(fj.Batch(mode, a(2, 3), a(7, 8), a(3, 3), token_slots=a(0, 5)))
    with pytest.raises(fj.FutureMapError, match=r"batch\[rank 0\].token_slots of a batch"):
        fm.resolve({0: fj.Batch(E, a(2, 3), a(7, 8), a(3, 3), token_slots=a(0, 5))})
    assert buffers(fm) == before and fm.step == 0
    r = fm.resolve(fj.Batch(E, a(2), a(7, 8), a(3), token_slots=a(0, 0)))
    assert host(r.input_ids)[:2] == [7, 8]
    r = fm.resolve(fj.Batch(jnp.int32(E), a(2, 3), a(7, 8), a(3, 3), token_slots=a(0, 5)))
    assert host(r.input_ids)[:2] == [7, 8]  # the host's ids: slot 5 was not gathered
    with pytest.raises(fj.InvariantViolation, match=r"\[batch fields\] token_slots name slot 5"):
        fm.check()
    r = fm.resolve(fj.Batch(D, a(5), None, a(7)))  # slot 5's one legitimate read
    assert host(r.input_ids)[:1] == [50]
    fm.check()
    fm.resolve(fj.Batch(jnp.int32(E), a(2, 3), a(7, 8), a(3, 3), token_slots=a(0, 1)))
    with pytest.raises(fj.InvariantViolation, match=r"token_slots name slot 1 "):
        fm.check()  # slot 1, the first live slot, is a slot like any other


def test_a_mesh_rank_follows_the_one_batch_token_slot_rule() -> None:
    """A batch given per DP rank is held to the one-batch rule for token slots, rank by
    rank, with the rank named: in the sentinel protocol any token slots are refused (all 0
    on a rank that is not MIXED were once dropped silently), in the gather protocol a
    DECODE rank's are refused and a MIXED rank without them is."""
    plain = fj.FutureMap(R)
    with pytest.raises(fj.FutureMapError, match=r"batch\[rank 0\].token_slots is for the gather"):
        plain.resolve({0: fj.Batch(E, a(2), a(7), a(3), token_slots=a(0))})
    with pytest.raises(fj.FutureMapError, match=r"batch.token_slots is for the gather"):
        plain.resolve(fj.Batch(E, a(2), a(7), a(3), token_slots=a(0)))
    fm = primed()
    before = buffers(fm)
    with pytest.raises(fj.FutureMapError, match=r"batch\[rank 0\].token_slots given for a DECODE"):
        fm.resolve({0: fj.Batch(D, a(3), None, a(5), token_slots=a(3))})
    with pytest.raises(fj.FutureMapError, match=r"batch\[rank 0\].token_slots missing"):
        fm.resolve({0: fj.Batch(M, a(2, 3), a(9, 0), a(1, 5))})
    assert buffers(fm) == before and fm.step == 0
    r = fm.resolve({0: fj.Batch(M, a(2, 3), a(9, 0), a(1, 5), token_slots=a(0, 3))})
    assert host(r.input_ids)[:2] == [9, 30]


def test_a_gather_batch_without_ids_is_refused_unless_decode() -> None:
    """Defect (reliability round two, 3): a gather EXTEND or MIXED batch with
    input_ids=None resolved to zeros. Only a DECODE batch known on the host comes without
    ids (as fm_torch rules); EXTEND, MIXED, IDLE and a traced mode (whose kind the host
    does not know) are refused by name, in the class and in the pure ops."""
    fm = primed()
    before = buffers(fm)
    batches = [
        fj.Batch(E, a(2), None, a(3)),
        fj.Batch(M, a(2, 5), None, a(3, 7), token_slots=a(0, 5)),
        fj.Batch(fj.ForwardMode.IDLE, a(), None, a()),
    ]
    for b in batches:
        with pytest.raises(fj.FutureMapError, match="only a DECODE batch comes without ids"):
            fm.resolve(b)
    with pytest.raises(fj.FutureMapError, match="input_ids is None with a traced"):
        fm.resolve(fj.Batch(jnp.int32(D), a(3, 5), None, a(5, 7)))
    with pytest.raises(fj.FutureMapError, match=r"batch\[rank 0\].input_ids is None"):
        fm.resolve({0: fj.Batch(E, a(2), None, a(3))})
    assert buffers(fm) == before and fm.step == 0
    ops = fj.future_map(R, protocol="gather")
    for mode, why in ((E, "forward_mode EXTEND"), (jnp.int32(E), "a traced forward_mode")):
        with pytest.raises(fj.FutureMapError, match=f"^batch.input_ids is None with {why}"):
            ops.resolve(ops.init(), fj.Batch(mode, a(2), None, a(3)))
    assert host(ops.resolve(ops.init(), fj.Batch(D, a(2), None, a(3)))[1].input_ids) == [0]


@pytest.mark.parametrize("protocol", ["gather", "sentinel"])
def test_draft_indices_shorter_than_the_batch_are_refused(protocol: str) -> None:
    """Defect (reliability round two, 4): a spec DECODE whose draft_indices were shorter
    than the batch was padded with slot 0, whose rows got slot 0's length and draft with no
    report. One draft slot per row, refused by name otherwise (fm_torch's rule)."""
    fm = fj.FutureMap(
        R, protocol=protocol, spec=fj.SpecConfig(topk=1), batch_buckets=(2, 4), token_buckets=(2, 4)
    )
    fm.publish(a(3, 5), a(4, 6))
    fm.stash(a(3, 5), fj.DraftPayload(a(30, 50), np.ones((2, 1), np.float32), a(1, 1)[:, None]))
    before = buffers(fm)
    ids = a(30, 50) if protocol == "gather" else a(-3, -5)
    with pytest.raises(fj.FutureMapError, match="draft_indices has .* rows per rank"):
        fm.resolve(fj.Batch(D, a(3, 5), ids, ids, draft_indices=a(3)))
    assert buffers(fm) == before and fm.step == 0
    r = fm.resolve(fj.Batch(D, a(3, 5), ids, ids, draft_indices=a(3, 5)))
    assert host(r.seq_lens)[:2] == [4, 6]


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_the_pure_ops_refuse_draft_indices_not_one_per_row(protocol: str) -> None:
    """Defect (reliability round two, 4, the pure ops): a sentinel-protocol spec resolve took
    draft_indices of another length than the batch and returned a draft of other rows than
    its lengths; the gather protocol refused it. One draft slot per row in both, by name,
    while tracing (nothing runs)."""
    ops = fj.future_map(R, protocol=protocol, spec=fj.SpecConfig(topk=1))
    ids = a(30, 50) if protocol == "gather" else a(-3, -5)
    for didx in (a(3), a(3, 5, 5)):
        with pytest.raises(fj.FutureMapError, match="draft_indices has .* rows, indices have 2"):
            jax.jit(ops.resolve)(ops.init(), fj.Batch(D, a(3, 5), ids, ids, draft_indices=didx))
    _, r = jax.jit(ops.resolve)(ops.init(), fj.Batch(D, a(3, 5), ids, ids, draft_indices=a(3, 5)))
    assert r.draft is not None and np.shape(r.draft.bonus_tokens) == (2,)


def test_debug_reports_negative_device_ids() -> None:
    """Defect (reliability round two): gather debug did not report negative device
    input_ids (fm_torch refuses them; host ids are refused on the host). Reported now as a
    batch-fields violation naming the id."""
    fm = primed(debug=True)
    ids = jax.device_put(a(7, -3))
    fm.resolve(fj.Batch(E, jax.device_put(a(2, 0)), ids, jax.device_put(a(3, 0))))
    with pytest.raises(
        fj.InvariantViolation, match=r"\[batch fields\] input_ids holds a negative id -3"
    ):
        fm.check()
    with pytest.raises(fj.FutureMapError, match="negative ids"):
        fm.resolve(fj.Batch(E, a(2), a(7, -3), a(3)))
    ops = fj.future_map(R, protocol="gather", debug=True)  # one token: checked too
    err, _ = jax.jit(checkify.checkify(ops.resolve))(
        ops.init(), fj.Batch(E, jnp.array([2]), jnp.array([-4]), jnp.array([3]))
    )
    with pytest.raises(checkify.JaxRuntimeError, match="negative id -4"):
        err.throw()
