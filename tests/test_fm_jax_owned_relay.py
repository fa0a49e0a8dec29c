"""Engine-owned relay buffers: an engine step whose forward writes `new_seq_lens` and
`output_tokens` itself (`StepInput(name, per="slot")`) costs no second scatter and leaves
the bytes of the step whose tail publishes and stashes (docs/CONTRACT.md, 'Engine-owned
relay buffers')."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fm_jax as fj

E, D = fj.ForwardMode.EXTEND, fj.ForwardMode.DECODE
OWN = (fj.StepInput("new_seq_lens", "slot"), fj.StepInput("output_tokens", "slot"))
i32 = lambda *x: np.array(x, np.int32)  # noqa: E731


def _bytes(x: Any) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def _tokens(res: fj.Resolved) -> jax.Array:
    b = res.seq_lens.shape[0]
    return (res.input_ids[:b] * 7 + res.seq_lens * 3) % 997


def _relayed(res: fj.Resolved) -> tuple[jax.Array, jax.Array]:
    """What a forward relays: each row's new length and token."""
    return res.seq_lens + 1, _tokens(res)


def _plain(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
    lens, toks = _relayed(res)
    return fj.StepOutput(lens, toks, toks)


def _writes_both(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
    """The forward scatters into the map's buffers itself, as a captured verify graph
    scatters into buffers the engine owns."""
    lens, toks = _relayed(res)
    i = batch.req_pool_indices
    new_lens = inputs["new_seq_lens"].at[i].set(lens, mode="drop")
    out = inputs["output_tokens"].at[i].set(toks, mode="drop")
    return fj.StepOutput(new_lens, out, toks)


def _keeps_lengths(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
    """The forward hands the map's own lengths buffer back untouched (a step that
    advances no length) and lets the tail stash the tokens."""
    return fj.StepOutput(inputs["new_seq_lens"], _tokens(res), None)


def _script(protocol: str) -> list[fj.Batch]:
    """Prefill two requests, decode twice, retire slot 1 and reuse it."""
    gather = protocol == "gather"
    out = [fj.Batch(E, i32(1, 2), i32(5, 9), i32(1, 1))]
    for live in (i32(1, 2), i32(2)):
        out.append(fj.Batch(D, live, None if gather else -live, i32(*[2] * len(live))))
    out.append(fj.Batch(E, i32(1), i32(40, 41), i32(2)))
    return out


def _run(forward: Any, inputs: tuple, protocol: str, debug: bool) -> tuple[Any, list[bytes]]:
    fm = fj.FutureMap(6, protocol=protocol, debug=debug, batch_buckets=[2], token_buckets=[2])
    step = fm.engine_step(forward, inputs=inputs)
    outs = []
    for batch in _script(protocol):
        outs.append(_bytes(step(batch).out))
    fm.check()
    return fm, outs


@pytest.mark.parametrize(("protocol", "debug"), [("sentinel", False), ("gather", True)])
def test_an_owned_relay_leaves_the_bytes_of_the_tail_s_scatter(protocol: str, debug: bool) -> None:
    fm_t, outs_t = _run(_plain, (), protocol, debug)
    fm_o, outs_o = _run(_writes_both, OWN, protocol, debug)
    assert outs_t == outs_o
    for name, buf in fm_t.buffers().items():  # slot 0: padding rows' garbage
        assert _bytes(fm_o.buffers()[name][1:]) == _bytes(buf[1:]), name
    assert fm_o.step == fm_t.step


def _scatters(fm: fj.FutureMap, forward: Any, inputs: tuple, batch: fj.Batch) -> int:
    """Scatters in the compiled step that serves `batch`."""
    step = fm.engine_step(forward, inputs=inputs)
    p = fm._placement.resolve(batch, None, None, step=step._placed, inputs={})
    fn = fm._registry.jitted(p.key, p.pack, 0, step._build)
    hlo = fn.lower(fm.state, *p.args).compile().as_text()
    return len(re.findall(r"\bscatter\(", hlo or ""))


def test_an_owned_relay_compiles_to_no_second_scatter() -> None:
    """The tail's publish and stash are a scatter each; a forward that writes both
    buffers itself has its two and the map adds none; one that hands the lengths buffer
    back untouched leaves only the stash's."""
    fm = fj.FutureMap(6, batch_buckets=[2], token_buckets=[2])
    batch = fj.Batch(E, i32(1, 2), i32(5, 9), i32(1, 1))
    assert _scatters(fm, _plain, (), batch) == 2
    assert _scatters(fm, _writes_both, OWN, batch) == 2
    assert _scatters(fm, _keeps_lengths, OWN[:1], batch) == 1


def test_handing_the_lengths_back_keeps_them_and_the_host_reads_them() -> None:
    fm = fj.FutureMap(6, batch_buckets=[2], token_buckets=[2])
    fm.publish(i32(1, 2), i32(4, 6))
    step = fm.engine_step(_keeps_lengths, inputs=OWN[:1])
    step(fj.Batch(E, i32(1, 2), i32(5, 9), i32(3, 3)))
    assert np.asarray(fm.buffers()["new_seq_lens"])[1:3].tolist() == [4, 6]
    assert np.asarray(fm.buffers()["output_tokens"])[1:3].tolist() == [(5 * 7 + 9) % 997, 72]
    assert fm.resolve_seq_lens_cpu(i32(1, 2)).tolist() == [4, 6]


def _spec_payload(res: fj.Resolved, bonus: Any) -> fj.DraftPayload:
    lens, toks = _relayed(res)
    b = toks.shape[0]
    topk = jnp.broadcast_to(toks[:, None], (b, 2))
    return fj.DraftPayload(bonus, topk.astype(jnp.float32) / 8, topk)


def _spec_plain(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
    lens, toks = _relayed(res)
    return fj.StepOutput(lens, _spec_payload(res, toks), toks)


def _spec_owned(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
    lens, toks = _relayed(res)
    out = inputs["output_tokens"].at[batch.req_pool_indices].set(toks, mode="drop")
    return fj.StepOutput(lens, _spec_payload(res, out), toks)


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_a_spec_step_owning_output_tokens_stashes_the_other_fields(kernel: str) -> None:
    bufs = []
    for forward, inputs in ((_spec_plain, ()), (_spec_owned, OWN[1:])):
        fm = fj.FutureMap(
            6, spec=fj.SpecConfig(2, kernel=kernel), batch_buckets=[2], token_buckets=[2]
        )
        step = fm.engine_step(forward, inputs=inputs)
        step(fj.Batch(E, i32(1, 2), i32(5, 9), i32(1, 1)))
        step(fj.Batch(D, i32(2, 1), i32(0, 0), i32(0, 0), draft_indices=i32(2, 1)))
        bufs.append({k: _bytes(v[1:]) for k, v in fm.buffers().items()})
    assert bufs[0] == bufs[1]


def test_owned_buffers_are_refused_by_name_when_misdeclared_or_misreturned() -> None:
    fm = fj.FutureMap(6, batch_buckets=[2], token_buckets=[2])
    with pytest.raises(fj.FutureMapError, match="relay buffers"):
        fm.engine_step(_plain, inputs=[fj.StepInput("topk_p", "slot")])
    with pytest.raises(fj.FutureMapError, match="declare shape"):
        fm.engine_step(_plain, inputs=[fj.StepInput("new_seq_lens", "slot", dtype=np.int8)])
    ngram = fj.FutureMap(
        6,
        spec=fj.SpecConfig(0, bonus_tokens=False, extra=(fj.RelayField("n", ()),)),
        batch_buckets=[2],
        token_buckets=[2],
    )
    with pytest.raises(fj.FutureMapError, match="no bonus tokens"):
        ngram.engine_step(_plain, inputs=OWN[1:])
    before = {k: _bytes(v) for k, v in fm.buffers().items()}
    step = fm.engine_step(_plain, inputs=OWN[:1])  # declared, yet rows come back
    with pytest.raises(fj.FutureMapError, match="owns the new_seq_lens buffer"):
        step(fj.Batch(E, i32(1, 2), i32(5, 9), i32(1, 1)))
    with pytest.raises(fj.FutureMapError, match="undeclared"):
        fm.engine_step(_writes_both, inputs=OWN)(
            fj.Batch(E, i32(1), i32(5), i32(1)), inputs={"new_seq_lens": i32(1)}
        )
    assert {k: _bytes(v) for k, v in fm.buffers().items()} == before and fm.step == 0


def test_debug_checks_the_rows_an_owned_relay_wrote() -> None:
    def negative(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
        lens = inputs["new_seq_lens"].at[batch.req_pool_indices].set(-3, mode="drop")
        return fj.StepOutput(lens, _tokens(res), None)

    fm = fj.FutureMap(6, debug=True, batch_buckets=[2], token_buckets=[2])
    fm.engine_step(negative, inputs=OWN[:1])(fj.Batch(E, i32(1, 2), i32(5, 9), i32(1, 1)))
    with pytest.raises(fj.InvariantViolation, match="published lengths"):
        fm.check()


def test_a_bonus_only_draft_with_owned_tokens_stashes_nothing_else() -> None:
    """A forward owning output_tokens that returns a bonus-only draft (a partial stash):
    nothing else is stashed, the top-k rows are kept, and the bytes are the tail's own."""

    def bonus_only(owned: bool) -> Any:
        def forward(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
            lens, toks = _relayed(res)
            if owned:
                toks = inputs["output_tokens"].at[batch.req_pool_indices].set(toks, mode="drop")
            return fj.StepOutput(lens, fj.DraftPayload(bonus_tokens=toks), None)

        return forward

    bufs = []
    for owned in (False, True):
        fm = fj.FutureMap(6, spec=fj.SpecConfig(2), batch_buckets=[2], token_buckets=[2])
        full = fm.engine_step(_spec_plain)
        full(fj.Batch(E, i32(1, 2), i32(5, 9), i32(1, 1)))
        part = fm.engine_step(bonus_only(owned), inputs=OWN[1:] if owned else ())
        part(fj.Batch(D, i32(2, 1), i32(0, 0), i32(0, 0), draft_indices=i32(2, 1)))
        bufs.append({k: _bytes(v[1:]) for k, v in fm.buffers().items()})
    assert bufs[0] == bufs[1]
