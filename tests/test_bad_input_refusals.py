"""Bad inputs fm_jax once took, and what it does with them now: a `FutureMapError` naming
what was wrong, raised before anything is stored (every buffer byte-identical after it,
the map working on), or, for the one good input that was refused, the step it runs.

Each test's docstring names the bug it pins. Public API only (`fm_jax`; `fm_torch` where
the twins are compared).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fm_jax as fj
import fm_torch as ft

R = 8
E, D, M = fj.ForwardMode.EXTEND, fj.ForwardMode.DECODE, fj.ForwardMode.MIXED


def a(*xs: int) -> np.ndarray:
    return np.array(xs, np.int32)


def snapshot(fm: fj.FutureMap) -> dict[str, bytes]:
    """Every buffer of the map, as bytes (a copy: valid whatever ops follow)."""
    leaves = jax.tree_util.tree_leaves_with_path(fm.buffers(copy=True))
    return {jax.tree_util.keystr(path): np.asarray(v).tobytes() for path, v in leaves}


# ---------------------------------------------------------- 1. owned buffer's dtype
def test_an_owned_buffer_declared_after_a_float_input_takes_the_maps_int_dtype() -> None:
    """Bug: `StepInput("new_seq_lens", "slot")` declared after a float32 row input was
    refused asking for float32: the owned buffer was checked against the dtype of the
    input declared before it, not the map's int dtype. Now the step runs, and its forward
    gets the map's own lengths buffer (int32, one per slot, as the last publish left it)."""
    fm = fj.FutureMap(R, batch_buckets=[2], token_buckets=[2])
    fm.publish(a(1, 2), a(5, 9))
    seen: dict[str, Any] = {}

    def forward(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
        seen["dtypes"] = {k: v.dtype for k, v in inputs.items()}
        lens = inputs["new_seq_lens"]
        written = lens.at[batch.req_pool_indices].set(res.seq_lens + 1, mode="drop")
        out = (lens, inputs["temperature"])
        return fj.StepOutput(written, res.input_ids[:2], out)

    declared = [
        fj.StepInput("temperature", "row", dtype=np.float32),
        fj.StepInput("new_seq_lens", "slot"),
    ]
    step = fm.engine_step(forward, inputs=declared)
    assert [(d.name, np.dtype(d.dtype)) for d in step.inputs] == [
        ("temperature", np.dtype(np.float32)),
        ("new_seq_lens", np.dtype(np.int32)),
    ]
    temps = np.array([0.5, 1.5], np.float32)
    batch = fj.Batch(E, a(3, 4), a(11, 12), a(1, 1))
    got = step(batch, inputs={"temperature": temps})
    handed, temperature = got.out
    assert seen["dtypes"] == {"temperature": jnp.float32, "new_seq_lens": jnp.int32}
    expected = np.zeros(R, np.int32)
    expected[[1, 2]] = [5, 9]
    np.testing.assert_array_equal(np.asarray(handed), expected)  # the map's buffer, as it was
    np.testing.assert_array_equal(np.asarray(temperature)[:2], temps)
    np.testing.assert_array_equal(fm.resolve_seq_lens_cpu(a(1, 2)), [5, 9])
    np.testing.assert_array_equal(fm.resolve_seq_lens_cpu(a(3, 4)), [2, 2])  # it wrote


def test_an_owned_buffer_of_another_dtype_than_the_maps_is_still_refused() -> None:
    """Bug (the same one, its other side): with the owned buffer judged against the input
    declared before it, a float32 `new_seq_lens` after a float32 input would have passed;
    the buffer is the map's int32 and a float32 declaration is refused naming it."""
    fm = fj.FutureMap(R, batch_buckets=[2], token_buckets=[2])
    declared = [
        fj.StepInput("temperature", "row", dtype=np.float32),
        fj.StepInput("new_seq_lens", "slot", dtype=np.float32),
    ]
    with pytest.raises(fj.FutureMapError, match=r"'new_seq_lens'.*dtype int32"):
        fm.engine_step(lambda res, batch, inputs: None, inputs=declared)


# ---------------------------------------------------------- 2. spec MIXED host tails
def _tails_map() -> fj.FutureMap:
    fm = fj.FutureMap(
        6,
        spec=fj.SpecConfig(topk=1),
        protocol="gather",
        debug=True,
        batch_buckets=(4,),
        token_buckets=(8,),
    )
    fm.publish(a(1, 2, 3), a(5, 6, 9))
    fm.stash(
        a(1, 2, 3),
        fj.DraftPayload(a(7, 8, 9), np.ones((3, 1), np.float32), np.zeros((3, 1), np.int32)),
    )
    return fm


GOOD_MIXED = fj.Batch(M, a(4, 2), a(11, 0), a(1, 1), token_slots=a(0, 2))
"""Prefill slot 4 (one token), then running slot 2."""

BAD_MIXED = {
    "slot out of range": (
        GOOD_MIXED._replace(req_pool_indices=a(7, 2)),
        r"req_pool_indices holds slots \[7\] outside \[0, 6\)",
    ),
    "negative prefill slot": (
        GOOD_MIXED._replace(req_pool_indices=a(-4, 2)),
        r"req_pool_indices holds slots \[-4\] outside \[0, 6\)",
    ),
    "live slot twice": (
        GOOD_MIXED._replace(req_pool_indices=a(2, 2)),
        r"req_pool_indices holds live slots \[2\] more than once",
    ),
    "token slots not one per id": (
        GOOD_MIXED._replace(token_slots=a(0, 0, 2)),
        r"token_slots has \(3,\) entries per rank, input_ids \(2,\)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_MIXED))
def test_mixed_tails_refuse_the_batches_resolve_refuses(case: str) -> None:
    """Bug: `resolve_mixed_tails_cpu` computed tails for spec MIXED batches `resolve` (and
    fm_torch) refuse: a prefill slot out of range or negative (a negative one counted as
    padding, left out of seq_lens_sum), a live slot twice, token_slots not one per input
    id. It now applies resolve's own batch checks: the same refusal, naming the field,
    before anything is read; the map's buffers unchanged and the good batch served."""
    bad, words = BAD_MIXED[case]
    fm = _tails_map()
    before = snapshot(fm)
    with pytest.raises(fj.FutureMapError, match=words):
        fm.resolve_mixed_tails_cpu(bad)
    with pytest.raises(fj.FutureMapError, match=words):
        fm.resolve_mixed_tails_cpu({0: bad})  # a mapping of DP ranks, judged alike
    with pytest.raises(fj.FutureMapError, match=words):
        fm.resolve(bad)  # one rule, one wording
    assert snapshot(fm) == before
    got = fm.resolve_mixed_tails_cpu(GOOD_MIXED, prefix_lens=a(0, 1))
    assert isinstance(got, fj.MixedTails)
    assert got.seq_lens_cpu.tolist() == [1, 7] and got.seq_lens_sum == 8
    assert got.prefix_lens is not None and got.prefix_lens.tolist() == [0, 6]
    fm.check()


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"batch": GOOD_MIXED._replace(seq_lens=a(-1, 1))}, r"batch\.seq_lens holds negative"),
        ({"prefix_lens": a(-1, 0)}, r"^prefix_lens holds negative"),
    ],
)
def test_mixed_tails_refuse_negative_host_lengths(change: dict[str, Any], words: str) -> None:
    """Bug: `resolve_mixed_tails_cpu` took negative `seq_lens` or `prefix_lens` and
    returned them (a negative length summed into seq_lens_sum). Host lengths it rebinds
    are lengths, >= 0 (the map's one rule for lengths): refused naming the field."""
    fm = _tails_map()
    before = snapshot(fm)
    kwargs = {"batch": GOOD_MIXED, "prefix_lens": a(0, 1), **change}
    with pytest.raises(fj.FutureMapError, match=words):
        fm.resolve_mixed_tails_cpu(kwargs.pop("batch"), **kwargs)
    assert snapshot(fm) == before
    assert fm.resolve_mixed_tails_cpu(GOOD_MIXED).seq_lens_sum == 8  # type: ignore[union-attr]


# ---------------------------------------------------------- 3. raw TypeErrors
@pytest.mark.parametrize("spec", [None, fj.SpecConfig(topk=1)])
@pytest.mark.parametrize("rank", ["0", 0.0, True, None, -1, 1])
def test_relayed_fields_refuses_a_rank_that_is_no_dp_rank(spec: Any, rank: Any) -> None:
    """Bug: `relayed_fields(rank="0")` raised a raw TypeError (and, without spec, any rank
    at all passed). A rank is an int in [0, DP): anything else is refused naming it."""
    fm = fj.FutureMap(R, spec=spec, batch_buckets=[2], token_buckets=[2])
    with pytest.raises(fj.FutureMapError, match=r"rank must be a DP rank, an int in \[0, 1\)"):
        fm.relayed_fields(rank=rank)
    expected = () if spec is None else ("bonus_tokens",)
    assert fm.relayed_fields(np.int64(0)) == fm.relayed_fields() == expected


@pytest.mark.parametrize("spec", [None, fj.SpecConfig(topk=1)])
@pytest.mark.parametrize(
    "partial", [None, 3, "bonus_tokens", ["bonus_tokens"], [3], [("bonus_tokens", 3)]]
)
def test_warm_up_refuses_partial_stashes_that_are_no_field_name_collections(
    spec: Any, partial: Any
) -> None:
    """Bug: `warm_up(partial_stashes=None)` and `warm_up(partial_stashes=3)` raised raw
    TypeErrors (on a map without spec, 3 was refused as if it named stashes). The
    parameter takes a sequence of collections of field names (() for none): anything else
    is refused naming it, before anything compiles."""
    fm = fj.FutureMap(R, spec=spec, batch_buckets=[2], token_buckets=[2])
    with pytest.raises(fj.FutureMapError, match="partial_stashes must be a sequence"):
        fm.warm_up(partial_stashes=partial)
    assert fm.executables()  # the map works on
    fm.publish(a(1), a(4))
    np.testing.assert_array_equal(fm.resolve_seq_lens_cpu(a(1)), [4])


# ---------------------------------------------------------- 4. generation alone
CONF = fj.SpecConfig(topk=1, confidence=2)


def _draft(n: int) -> fj.DraftPayload:
    ones = np.ones((n, 1), np.float32)
    return fj.DraftPayload(np.arange(n, dtype=np.int32), ones, ones.astype(np.int32))


@pytest.mark.parametrize("spec", [None, fj.SpecConfig(topk=1), CONF])
@pytest.mark.parametrize("op", ["publish", "finish"])
def test_generation_without_confidence_is_refused(spec: Any, op: str) -> None:
    """Bug: `publish(..., generation=...)` (and `finish`'s) without `confidence=` was
    silently ignored: the generations are only ever snapshotted with confidence rows.
    Refused naming `generation`, before anything is written."""
    fm = fj.FutureMap(R, spec=spec, batch_buckets=[2], token_buckets=[2])
    fm.publish(a(1, 2), a(5, 9))
    before = snapshot(fm)
    gen = np.zeros(R, np.int64)
    call: Any
    if op == "publish":
        call = lambda: fm.publish(a(1, 2), a(6, 10), generation=gen)  # noqa: E731
    else:
        payload = a(3, 4) if spec is None else _draft(2)
        batch = fj.Batch(E, a(1, 2), a(11, 12), a(1, 1))
        call = lambda: fm.finish(batch, a(1, 2), a(6, 10), payload, generation=gen)  # noqa: E731
    relay = "without confidence" if spec is CONF else "relays no confidence"
    with pytest.raises(fj.FutureMapError, match=rf"{op}: generation given .*{relay}"):
        call()
    assert snapshot(fm) == before
    np.testing.assert_array_equal(fm.resolve_seq_lens_cpu(a(1, 2)), [5, 9])


def test_an_engine_step_of_a_map_without_confidence_refuses_generation() -> None:
    """Bug: an engine step of a map with no confidence relay took `generation=` and
    ignored it. Refused naming `generation` before the step runs: the buffers unchanged,
    and the same step runs without it."""
    fm = fj.FutureMap(R, batch_buckets=[2], token_buckets=[2])

    def forward(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
        return fj.StepOutput(res.seq_lens + 1, res.input_ids[:2])

    step = fm.engine_step(forward)
    batch = fj.Batch(E, a(1, 2), a(11, 12), a(1, 1))
    step(batch)
    before = snapshot(fm)
    with pytest.raises(fj.FutureMapError, match="the engine step: generation given but the map"):
        step(batch, generation=np.zeros(R, np.int64))
    assert snapshot(fm) == before
    step(batch)
    np.testing.assert_array_equal(fm.resolve_seq_lens_cpu(a(1, 2)), [2, 2])


# ---------------------------------------------------------- 5. settings no call serves
@pytest.mark.parametrize(
    ("batch_buckets", "token_buckets"),
    [([4], [2]), ([1, 4], [2]), ([2, 8], [2, 4]), ([2, 8], [2])],
)
def test_a_largest_token_bucket_below_the_largest_batch_bucket_is_refused(
    batch_buckets: list[int], token_buckets: list[int]
) -> None:
    """Bug: `FutureMap(batch_buckets=[4], token_buckets=[2])` was built and failed later
    (warm_up: 'tokens of 4 exceeds the largest bucket'; a DECODE batch of B rows carries B
    ids). The rule: the largest token bucket >= the largest batch bucket (a batch has at
    least one token per row), checked at construction, naming token_buckets."""
    with pytest.raises(fj.FutureMapError, match=r"token_buckets .* largest batch bucket"):
        fj.FutureMap(R, batch_buckets=batch_buckets, token_buckets=token_buckets)


@pytest.mark.parametrize(
    ("batch_buckets", "token_buckets"), [([4], [4]), ([2, 4], [1, 4]), ([4], [2, 8])]
)
def test_token_buckets_reaching_the_largest_batch_bucket_serve_every_bucket(
    batch_buckets: list[int], token_buckets: list[int]
) -> None:
    """Bug (the rule's other side): the construction check must not refuse settings that
    serve: a largest token bucket equal to or above the largest batch bucket builds, and
    a DECODE of the largest batch bucket's rows resolves."""
    fm = fj.FutureMap(R, batch_buckets=batch_buckets, token_buckets=token_buckets)
    rows = batch_buckets[-1]
    slots = np.arange(1, rows + 1, dtype=np.int32)
    fm.publish(slots, slots + 2)
    fm.stash(slots, slots + 10)
    got = fm.resolve(fj.Batch(D, slots, -slots, -slots))
    np.testing.assert_array_equal(np.asarray(got.input_ids)[:rows], slots + 10)
    np.testing.assert_array_equal(np.asarray(got.seq_lens)[:rows], slots + 2)


def test_a_pool_whose_slots_do_not_fit_the_int_dtype_is_refused() -> None:
    """Bug: an int32 map with `pool_size=2**31 + 1` was accepted (slot 2**31 cannot be an
    int32 slot, nor its sentinel). Slots must fit the int dtype, pool_size - 1 <=
    iinfo(dtype).max: refused naming pool_size by the pure ops and the class alike, before
    any buffer is made; the largest pool that fits builds its ops."""
    for build in (fj.future_map, fj.FutureMap):
        with pytest.raises(fj.FutureMapError, match=r"pool_size 2147483649: slots .* int32"):
            build(2**31 + 1)
    assert fj.future_map(2**31).pool_size == 2**31  # slot 2**31 - 1 fits


# ---------------------------------------------------------- 6. partial stashes vs SGLang
def test_a_draft_field_stashed_before_any_top_k_resolves_as_stashed_in_both_twins() -> None:
    """Pins docs/CONTRACT.md 'Partial stashes': each optional field is tracked on its own.
    A draft carrying `draft_probs` on a map where no top-k was ever stashed resolves to the
    stashed rows in both twins (top-k None); SGLang 0.5.23 gathers `draft_probs` only
    beside top-k (None there), a difference the contract states."""
    spec = fj.SpecConfig(topk=2, extra=(fj.RelayField("draft_probs", (2,), np.float32),))
    jm = fj.FutureMap(R, spec=spec, debug=True, batch_buckets=[2], token_buckets=[2])
    tm = ft.FutureMap(R, spec=True, debug=True, dtype=torch.int32)
    slots = a(2, 4)
    probs = np.array([[0.25, -0.0], [np.nan, 1.5]], np.float32)
    bonus = a(7, 8)
    s = torch.from_numpy(slots)
    jm.publish(slots, slots + 3)
    tm.publish(s, torch.from_numpy(slots + 3))
    jm.stash(slots, fj.DraftPayload(bonus, extras={"draft_probs": probs}))
    tm.stash(
        s,
        ft.DraftPayload(torch.from_numpy(bonus), extras={"draft_probs": torch.from_numpy(probs)}),
    )
    jd = jm.resolve(fj.Batch(D, slots, -slots, -slots, draft_indices=slots)).draft
    tb = ft.ScheduleBatch(ft.ForwardMode.DECODE, s, -s, -s, ft.DraftInput(s.clone()))
    tm.resolve(tb)
    assert jd is not None and tb.draft is not None and tb.draft.payload is not None
    td = tb.draft.payload
    assert jd.topk_p is None and td.topk_p is None
    assert jd.extras is not None and td.extras is not None
    assert np.asarray(jd.extras["draft_probs"])[:2].tobytes() == probs.tobytes()
    assert td.extras["draft_probs"].numpy().tobytes() == probs.tobytes()
    assert jm.relayed_fields() == ("bonus_tokens", "draft_probs")
    jm.check()
