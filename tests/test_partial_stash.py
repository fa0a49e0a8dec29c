"""Partial draft stashes, buffers made on first use and which fields a resolve has
(docs/CONTRACT.md, 'Partial stashes'), in both twins.

A draft stash writes the fields it carries and keeps the others' rows as they were
(SGLang's `stash`: "staging transitions refresh only the bonus token"); a draft of bonus
tokens alone is SGLang's `stash_bonus_tokens`. The consume-tracked fields are carried by
every draft. A field no stash has written is gathered as None (SGLang's DSA availability
flag): fm_torch has no buffer for it yet, the fm_jax class tracks it on the host.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import fm_jax as fj
import fm_torch as ft
from fm_jax import ForwardMode

R, K, H = 6, 2, 3
SPEC = fj.SpecConfig(
    topk=K,
    hidden=H,
    hidden_dtype=jnp.bfloat16,
    verified_id=True,
    extra=(fj.RelayField("draft_probs", (K,), np.float32), fj.RelayField("dsa", (2,))),
)
SLOTS = np.array([2, 4], np.int32)
# Everything but the consume-tracked fields (bonus tokens, verified ids) may be left out.
BONUS_ONLY = ("bonus_tokens", "verified_id")
NO_HIDDEN = ("bonus_tokens", "verified_id", "topk_p", "topk_index", "draft_probs")


def full(seed: int) -> dict[str, np.ndarray]:
    """Every field of a two-row draft, distinct per seed (float rows with NaN and -0.0)."""
    rng = np.random.default_rng(seed)
    probs = rng.random((2, K), np.float32)
    probs[0, 0] = -0.0
    hidden = rng.random((2, H), np.float32).astype(ml_dtypes.bfloat16)
    hidden[1, 2] = np.nan
    return {
        "bonus_tokens": np.array([10 + seed, 20 + seed], np.int32),
        "verified_id": np.array([30 + seed, 40 + seed], np.int32),
        "topk_p": probs,
        "topk_index": rng.integers(0, 99, (2, K), np.int32),
        "hidden_states": hidden,
        "draft_probs": rng.random((2, K), np.float32),
        "dsa": rng.integers(0, 99, (2, 2), np.int32),
    }


def jax_draft(values: dict[str, np.ndarray], names: tuple[str, ...] | None = None) -> Any:
    names = tuple(values) if names is None else names
    own = {k: values[k] for k in ("draft_probs", "dsa") if k in names}
    std = {k: values[k] for k in names if k not in own}
    return fj.DraftPayload(**std, extras=own or None)


def torch_draft(values: dict[str, np.ndarray], names: tuple[str, ...] | None = None) -> Any:
    def tt(x: np.ndarray) -> torch.Tensor:
        if x.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)

    d = jax_draft(values, names)
    conv = {k: None if (v := getattr(d, k)) is None else tt(v) for k in d._fields if k != "extras"}
    return ft.DraftPayload(**conv, extras={k: tt(v) for k, v in (d.extras or {}).items()} or None)


def jax_bytes(fm: fj.FutureMap) -> dict[str, bytes]:
    st = fm.state
    out = {
        k: np.asarray(v).tobytes()
        for k, v in st._asdict().items()
        if k != "extras" and v is not None
    }
    out.update({k: np.asarray(v).tobytes() for k, v in (st.extras or {}).items()})
    return out


def torch_bytes(fm: ft.FutureMap) -> dict[str, bytes]:
    bufs = {
        "output_tokens": fm.output_tokens,
        "new_seq_lens": fm.new_seq_lens,
        "topk_p": fm.topk_p,
        "topk_index": fm.topk_index,
        "hidden_states": fm.hidden_states,
        "verified_id": fm.verified_id,
        **fm.extras,
    }
    return {
        k: v.contiguous().view(torch.uint8).numpy().tobytes()
        for k, v in bufs.items()
        if v is not None
    }


def gathered_bytes(draft: Any) -> dict[str, bytes | None]:
    """A gathered draft's fields as raw bytes (the twins' rows), None where absent."""
    out: dict[str, bytes | None] = {}
    for k in ("bonus_tokens", "verified_id", "topk_p", "topk_index", "hidden_states"):
        v = getattr(draft, k)
        out[k] = None if v is None else _raw(v)
    for k in ("draft_probs", "dsa"):
        v = (draft.extras or {}).get(k)
        out[k] = None if v is None else _raw(v)
    return out


def _raw(v: Any) -> bytes:
    if isinstance(v, torch.Tensor):
        return v[:2].contiguous().view(torch.uint8).numpy().tobytes()
    return np.asarray(v)[:2].tobytes()


@pytest.fixture(scope="module")
def jmap() -> fj.FutureMap:
    return fj.FutureMap(R, spec=SPEC, debug=True, batch_buckets=(2,), token_buckets=(2,))


def fresh_torch() -> ft.FutureMap:
    return ft.FutureMap(R, spec=True, debug=True, dtype=torch.int32)


def resolve_both(jm: fj.FutureMap, tm: ft.FutureMap) -> tuple[Any, Any]:
    """A spec DECODE resolve at SLOTS in both twins (sentinel protocol)."""
    ids = -SLOTS
    out = jm.resolve(fj.Batch(ForwardMode.DECODE, SLOTS, ids, ids, draft_indices=SLOTS))
    s = torch.from_numpy(SLOTS)
    b = ft.ScheduleBatch(ft.ForwardMode.DECODE, s, -s, -s, ft.DraftInput(s.clone()))
    tm.resolve(b)
    assert b.draft is not None
    return out.draft, b.draft.payload


def test_partial_stashes_keep_the_rows_they_leave_out_in_both_twins(jmap: fj.FutureMap) -> None:
    """Full, bonus-only, then without hidden states: each stash writes what it carries and
    keeps the rest, the two twins byte for byte (buffers and gathered rows); a field no
    stash has written (`dsa`, never carried here) is gathered as None by both."""
    jm, tm = jmap, fresh_torch()
    jm.reset()
    first = full(1)
    no_dsa = tuple(k for k in first if k != "dsa")
    for values, names in ((first, no_dsa), (full(2), BONUS_ONLY), (full(3), NO_HIDDEN)):
        # each step publishes before it resolves: a spec resolve consumes the lengths
        jm.publish(SLOTS, SLOTS + 3)
        tm.publish(torch.from_numpy(SLOTS), torch.from_numpy(SLOTS + 3))
        jm.stash(SLOTS, jax_draft(values, names))
        tm.stash(torch.from_numpy(SLOTS), torch_draft(values, names))
        tb = torch_bytes(tm)
        assert "dsa" not in tb  # made by the first draft that carries it: none has
        assert {k: v for k, v in jax_bytes(jm).items() if k != "dsa"} == tb
        jd, td = resolve_both(jm, tm)
        got = gathered_bytes(jd)
        assert got == gathered_bytes(td)
        assert got["dsa"] is None
        assert got["bonus_tokens"] == values["bonus_tokens"].tobytes()
        # Kept: top-k from the first draft after the bonus-only stash; hidden states from
        # the first draft after both partial stashes.
        topk_from = first if names == BONUS_ONLY else values
        assert got["topk_p"] == topk_from["topk_p"].tobytes()
        assert got["hidden_states"] == first["hidden_states"].tobytes()
    jm.check()


def test_a_field_first_stashed_late_is_gathered_from_then_on_and_reset_forgets(
    jmap: fj.FutureMap,
) -> None:
    """The DSA flag generalised: `relayed_fields` and the gathered draft name a field once
    a stash wrote it (fm_torch: once its buffer exists), in both twins; `reset` forgets."""
    jm, tm = jmap, fresh_torch()
    jm.reset()
    jm.publish(SLOTS, SLOTS + 3)
    tm.publish(torch.from_numpy(SLOTS), torch.from_numpy(SLOTS + 3))
    assert jm.relayed_fields() == BONUS_ONLY
    jm.stash(SLOTS, jax_draft(full(1), BONUS_ONLY))
    tm.stash(torch.from_numpy(SLOTS), torch_draft(full(1), BONUS_ONLY))
    jd, td = resolve_both(jm, tm)
    assert jd.topk_p is None and jd.extras is None and td.topk_p is None and td.extras is None
    with_dsa = (*BONUS_ONLY, "dsa")
    jm.publish(SLOTS, SLOTS + 3)  # a spec resolve consumed the lengths: publish again
    tm.publish(torch.from_numpy(SLOTS), torch.from_numpy(SLOTS + 3))
    jm.stash(SLOTS, jax_draft(full(2), with_dsa))
    tm.stash(torch.from_numpy(SLOTS), torch_draft(full(2), with_dsa))
    assert jm.relayed_fields() == with_dsa
    jd, td = resolve_both(jm, tm)
    assert gathered_bytes(jd) == gathered_bytes(td)
    assert gathered_bytes(jd)["dsa"] == full(2)["dsa"].tobytes()
    assert jd.topk_p is None and jd.hidden_states is None
    jm.reset()
    assert jm.relayed_fields() == BONUS_ONLY
    jm.check()


def test_the_pure_ops_stash_only_what_a_draft_carries_under_jit() -> None:
    """The pure ops: a partial draft is its own trace (its fields are its pytree); the
    rows it leaves out are kept, and they gather every declared field (the state has
    every buffer: a field never stashed reads its zeros)."""
    ops = fj.future_map(R, spec=SPEC)
    stash = jax.jit(ops.stash)
    st = stash(ops.init(), SLOTS, jax_draft(full(1)))
    st = stash(st, SLOTS, jax_draft(full(2), BONUS_ONLY))
    assert np.asarray(st.output_tokens)[SLOTS].tolist() == full(2)["bonus_tokens"].tolist()
    assert np.asarray(st.topk_index)[SLOTS].tobytes() == full(1)["topk_index"].tobytes()
    ids = -SLOTS
    _, res = ops.resolve(st, fj.Batch(ForwardMode.DECODE, SLOTS, ids, ids, draft_indices=SLOTS))
    assert res.draft is not None and res.draft.extras is not None
    assert np.asarray(res.draft.extras["dsa"]).tobytes() == full(1)["dsa"].tobytes()


def test_warm_up_covers_the_partial_stashes_an_engine_declares() -> None:
    """A partial stash is an executable of its own: under the serving guard it is refused
    unless `warm_up(partial_stashes=...)` named it, then served with no compile."""
    fm = fj.FutureMap(R, spec=SPEC, batch_buckets=(2,), token_buckets=(2,))
    fm.warm_up(guard=True, traced_modes=False)
    fm.stash(SLOTS, jax_draft(full(1)))
    with pytest.raises(fj.FutureMapError, match="without topk_p, topk_index, hidden_states"):
        fm.stash(SLOTS, jax_draft(full(2), BONUS_ONLY))
    fm.warm_up(guard=True, traced_modes=False, partial_stashes=[BONUS_ONLY])
    fm.stash(SLOTS, jax_draft(full(2), BONUS_ONLY))
    fm.finish(fj.Batch(None, SLOTS, SLOTS, SLOTS), SLOTS, SLOTS, jax_draft(full(3), BONUS_ONLY))
    assert (
        np.asarray(fm.state.topk_p)[SLOTS].tobytes() == full(1)["topk_p"].view(np.uint32).tobytes()
    )
    with pytest.raises(fj.FutureMapError, match="verified_id is missing"):
        fm.warm_up(partial_stashes=[("bonus_tokens",)])


def test_an_engine_forward_may_stash_part_of_its_draft() -> None:
    """An engine step whose forward returns a partial payload (bonus tokens for an EXTEND,
    a full draft for a DECODE) keeps the rows it leaves out and tells the map which fields
    it has relayed."""
    fm = fj.FutureMap(R, spec=SPEC, batch_buckets=(2,), token_buckets=(2,))
    values = {k: jnp.asarray(v) for k, v in full(5).items()}

    def forward(res: Any, batch: Any, inputs: Any) -> fj.StepOutput:
        tok = res.seq_lens.astype(jnp.int32) + 7
        if batch.forward_mode == ForwardMode.DECODE:
            draft = jax_draft({**values, "bonus_tokens": tok})
        else:
            draft = fj.DraftPayload(tok, verified_id=tok)
        return fj.StepOutput(res.seq_lens + 1, draft)

    step = fm.engine_step(forward)
    lens = np.array([3, 5], np.int32)
    step(fj.Batch(ForwardMode.EXTEND, SLOTS, SLOTS, lens))
    assert fm.relayed_fields() == BONUS_ONLY
    assert not np.asarray(fm.state.topk_index).any()
    ids = -SLOTS
    step(fj.Batch(ForwardMode.DECODE, SLOTS, ids, ids, draft_indices=SLOTS))
    assert fm.relayed_fields() == (
        "bonus_tokens",
        "verified_id",
        "topk_p",
        "topk_index",
        "hidden_states",
        "draft_probs",
        "dsa",
    )
    step(fj.Batch(ForwardMode.EXTEND, SLOTS, SLOTS, lens))
    assert np.asarray(fm.state.topk_index)[SLOTS].tobytes() == full(5)["topk_index"].tobytes()
    assert np.asarray(fm.state.output_tokens)[SLOTS].tolist() == (lens + 7).tolist()


def test_fm_torch_makes_an_engine_field_buffer_when_a_draft_first_carries_it() -> None:
    """As SGLang makes `draft_probs_buf` and `dsa_topk_indices_buf`: an untracked engine
    field first carried by a later draft gets its buffer then (zeros elsewhere), which
    fixes its shape and dtype; fm_jax declares every field up front instead."""
    tm = fresh_torch()
    s = torch.from_numpy(SLOTS)
    tm.stash(s, torch_draft(full(1), BONUS_ONLY))
    assert tm.extras == {}
    tm.stash(s, torch_draft(full(2), (*BONUS_ONLY, "dsa")))
    assert tm.extras["dsa"].shape == (R, 2) and tm.extras["dsa"].dtype == torch.int32
    assert tm.extras["dsa"][s].numpy().tobytes() == full(2)["dsa"].tobytes()
    assert not tm.extras["dsa"][torch.tensor([1, 3, 5])].any()
    wide = {**full(3), "dsa": np.zeros((2, 3), np.int32)}
    with pytest.raises(ft.FutureMapError, match="draft.dsa must have shape"):
        tm.stash(s, torch_draft(wide, (*BONUS_ONLY, "dsa")))
