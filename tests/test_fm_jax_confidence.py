"""fm_jax's confidence relay (docs/CONTRACT.md, 'The confidence relay'): publish's rows reach
the host ring bit for bit, a read looks two publishes with confidence back and never
waits unless asked, each entry keeps the generations of its own publish, and bad input is
refused before anything is written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fm_jax
from fm_jax import (
    Batch,
    DraftPayload,
    ForwardMode,
    FutureMap,
    FutureMapError,
    SpecConfig,
    StepOutput,
)

R, GAMMA = 6, 3
SPEC = SpecConfig(topk=1, confidence=GAMMA)


@pytest.fixture
def fm() -> FutureMap:
    return FutureMap(R, spec=SPEC, batch_buckets=(2,), token_buckets=(2,))


def _rows(step: int) -> np.ndarray:
    """Two confidence rows of one step, with a NaN payload and -0.0 among them."""
    rows = np.full((2, GAMMA), 0.25 * step, np.float32)
    bits = rows.view(np.uint32)
    bits[0, 0] = 0x80000000  # -0.0
    bits[1, 2] = 0x7FC00000 | step  # a NaN whose payload names the step
    return rows


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


SLOTS = np.array([1, 2])


def test_a_read_takes_the_rows_of_two_publishes_back_bit_for_bit(fm):
    gen = np.zeros(R, np.int64)
    assert fm.resolve_confidence_cpu(SLOTS, wait=True) is None  # nothing published
    fm.publish(SLOTS, [4, 5], confidence=_rows(0), generation=gen)
    assert fm.resolve_confidence_cpu(SLOTS, wait=True) is None  # one publish: none yet
    for step in range(1, 5):
        fm.publish(SLOTS, [4, 5], confidence=_rows(step), generation=gen)
        got = fm.resolve_confidence_cpu(SLOTS, wait=True)
        assert isinstance(got, fm_jax.ResolvedConfidence)
        assert got.confidence.dtype == np.float32 and got.confidence.shape == (2, GAMMA)
        np.testing.assert_array_equal(_bits(got.confidence), _bits(_rows(step - 1)))
    # the rows in the map's own buffer are the last publish's (as raw bits)
    own = np.asarray(fm.buffers()["confidence"])[SLOTS]
    np.testing.assert_array_equal(own, _bits(_rows(4)))


def test_each_entry_keeps_the_generations_of_its_own_publish(fm):
    """Slot 2 goes to a new request between two publishes: the read of the earlier entry
    gives its old generation (the host tells the previous request's row apart), though
    the host's counters have moved on since."""
    gen = np.ones(R, np.int64)
    fm.publish(SLOTS, [4, 5], confidence=_rows(0), generation=gen)
    gen[2] += 1  # slot 2 retired, taken by a new request (the counters are the caller's)
    fm.publish(SLOTS, [4, 1], confidence=_rows(1), generation=gen)
    got = fm.resolve_confidence_cpu(SLOTS, wait=True)
    assert got is not None
    np.testing.assert_array_equal(got.generation, [1, 1])  # stale: slot 2 is now at 2
    fm.publish(SLOTS, [5, 2], confidence=_rows(2), generation=gen)
    got = fm.resolve_confidence_cpu(np.array([2, 1]), wait=True)
    assert got is not None
    np.testing.assert_array_equal(got.generation, [2, 1])
    np.testing.assert_array_equal(_bits(got.confidence), _bits(_rows(1))[::-1])


def test_publishes_without_confidence_keep_the_rows_and_the_ring(fm):
    """A publish without confidence (a prefill's) writes no row and moves no ring entry;
    neither does an idle one."""
    gen = np.zeros(R, np.int64)
    fm.publish(SLOTS, [4, 5], confidence=_rows(0), generation=gen)
    fm.publish(SLOTS, [6, 7])
    none = np.zeros(0, np.int32)
    fm.publish(none, none, confidence=np.zeros((0, GAMMA), np.float32), generation=gen)
    assert fm.resolve_confidence_cpu(SLOTS, wait=True) is None
    fm.publish(SLOTS, [8, 9], confidence=_rows(1), generation=gen)
    got = fm.resolve_confidence_cpu(SLOTS, wait=True)
    assert got is not None
    np.testing.assert_array_equal(_bits(got.confidence), _bits(_rows(0)))
    assert fm.resolve_confidence_cpu(np.zeros(0, np.int64)) is None  # no slots: nothing


def test_a_read_without_wait_is_none_or_the_waited_rows(fm):
    """Without `wait` a read never blocks on the device: it gives the entry's rows once its
    copy is done (here: after blocking on it), and the same rows as a waiting read."""
    gen = np.zeros(R, np.int64)
    for step in range(3):
        fm.publish(SLOTS, [4, 5], confidence=_rows(step), generation=gen)
    quick = fm.resolve_confidence_cpu(SLOTS)
    waited = fm.resolve_confidence_cpu(SLOTS, wait=True)
    assert waited is not None
    if quick is not None:
        np.testing.assert_array_equal(_bits(quick.confidence), _bits(waited.confidence))
    jax.block_until_ready(fm.state)
    again = fm.resolve_confidence_cpu(SLOTS)
    assert again is not None
    np.testing.assert_array_equal(_bits(again.confidence), _bits(_rows(1)))


def test_finish_publishes_confidence_like_publish(fm):
    gen = np.zeros(R, np.int64)
    batch = Batch(ForwardMode.DECODE, SLOTS, -SLOTS, -SLOTS)
    draft = DraftPayload(np.array([7, 8]), np.ones((2, 1), np.float32), np.ones((2, 1), np.int32))
    for step in range(2):
        fm.finish(batch, SLOTS, [4, 5], draft, confidence=_rows(step), generation=gen)
    got = fm.resolve_confidence_cpu(SLOTS, wait=True)
    assert got is not None
    np.testing.assert_array_equal(_bits(got.confidence), _bits(_rows(0)))


def test_the_engine_step_publishes_what_its_forward_returns():
    fm = FutureMap(R, spec=SPEC, batch_buckets=(2,), token_buckets=(2,), protocol="gather")

    def forward(res, batch, inputs, conf):
        ones = jnp.ones((2, 1), jnp.float32)
        draft = DraftPayload(res.input_ids, ones, ones.astype(jnp.int32))
        return StepOutput(res.seq_lens + 1, draft, None, confidence=conf)

    step = fm.engine_step(forward)
    gen = np.zeros(R, np.int64)
    batch = Batch(ForwardMode.EXTEND, SLOTS, np.array([3, 4]), np.array([1, 1]))
    with pytest.raises(FutureMapError, match="generation is required"):
        step(batch, jnp.asarray(_rows(0)))
    for s in range(3):
        step(batch, jnp.asarray(_rows(s)), generation=gen)
    got = fm.resolve_confidence_cpu(SLOTS, wait=True)
    assert got is not None
    np.testing.assert_array_equal(_bits(got.confidence), _bits(_rows(1)))


def test_bad_confidence_is_refused_before_anything_is_written(fm):
    gen = np.zeros(R, np.int64)
    before = np.asarray(fm.state.new_seq_lens).copy()
    bad = [
        (dict(confidence=_rows(0).astype(np.float64), generation=gen), "confidence"),
        (dict(confidence=_rows(0)[:, :2], generation=gen), "confidence"),
        (dict(confidence=_rows(0)), "generation is required"),
        (dict(confidence=_rows(0), generation=gen[:3]), "generation"),
        (dict(confidence=_rows(0), generation=gen.astype(np.float32)), "generation"),
    ]
    for kw, words in bad:
        with pytest.raises(FutureMapError, match=words):
            fm.publish(SLOTS, [4, 5], **kw)
    np.testing.assert_array_equal(np.asarray(fm.state.new_seq_lens), before)
    assert fm.resolve_confidence_cpu(SLOTS, wait=True) is None
    with pytest.raises(FutureMapError, match="outside"):
        fm.resolve_confidence_cpu([1, R])
    with pytest.raises(FutureMapError, match="more than once"):
        fm.resolve_confidence_cpu([1, 1])


def test_a_map_without_the_relay_refuses_confidence():
    fm = FutureMap(R, spec=SpecConfig(topk=1), batch_buckets=(2,), token_buckets=(2,))
    with pytest.raises(FutureMapError, match="relays none"):
        fm.publish(SLOTS, [4, 5], confidence=_rows(0), generation=np.zeros(R, np.int64))
    with pytest.raises(FutureMapError, match="relays no confidence"):
        fm.resolve_confidence_cpu(SLOTS)
    assert "confidence" not in fm.buffers()
    with pytest.raises(FutureMapError, match="spec.confidence"):
        fm_jax.future_map(R, spec=SpecConfig(topk=1, confidence=-1))


def test_the_pure_ops_scatter_confidence_as_bits():
    ops = fm_jax.future_map(R, spec=SPEC)
    state = ops.init()
    assert state.confidence.shape == (R, GAMMA) and state.confidence.dtype == np.uint32
    lens, rows = jnp.array([4, 5]), jnp.asarray(_rows(3))
    state = jax.jit(ops.publish)(state, jnp.asarray(SLOTS), lens, rows)
    np.testing.assert_array_equal(np.asarray(state.confidence)[SLOTS], _bits(_rows(3)))
    plain = fm_jax.future_map(R, spec=SpecConfig(topk=1))
    with pytest.raises(FutureMapError, match="relays none"):
        plain.publish(plain.init(), jnp.asarray(SLOTS), jnp.array([4, 5]), jnp.asarray(_rows(0)))


def test_reset_forgets_the_ring(fm):
    gen = np.zeros(R, np.int64)
    for step in range(2):
        fm.publish(SLOTS, [4, 5], confidence=_rows(step), generation=gen)
    assert fm.resolve_confidence_cpu(SLOTS, wait=True) is not None
    fm.reset()
    assert fm.resolve_confidence_cpu(SLOTS, wait=True) is None


def test_warm_up_compiles_the_publishes_with_confidence():
    """Under the serving guard a publish and a finish with confidence rows run what
    warm-up compiled (an unwarmed call would be refused)."""
    fm = FutureMap(R, spec=SPEC, batch_buckets=(2,), token_buckets=(2,), protocol="gather")
    names = fm.warm_up(guard=True, traced_modes=False).by_op
    assert {"publish_with_confidence", "finish_with_confidence"} <= set(names)
    gen = np.zeros(R, np.int64)
    draft = DraftPayload(np.array([7, 8]), np.ones((2, 1), np.float32), np.ones((2, 1), np.int32))
    fm.publish(SLOTS, [4, 5], confidence=_rows(0), generation=gen)
    batch = Batch(None, SLOTS, None, SLOTS)
    fm.finish(batch, SLOTS, [5, 6], draft, confidence=_rows(1), generation=gen)
    got = fm.resolve_confidence_cpu(SLOTS, wait=True)
    assert got is not None
    np.testing.assert_array_equal(_bits(got.confidence), _bits(_rows(0)))


@pytest.mark.parametrize("debug", [False, True])
def test_a_forward_owning_the_lengths_still_publishes_its_confidence(debug):
    """Owning `new_seq_lens` (StepInput per='slot') and publishing confidence rows in one
    step: the confidence rows reach the ring and the lengths are the forward's, the same
    bytes as the step whose tail publishes both."""

    def run(owned: bool):
        fm = FutureMap(R, spec=SPEC, batch_buckets=(2,), token_buckets=(2,), debug=debug)

        def forward(res, batch, inputs, conf):
            ones = jnp.ones((2, 1), jnp.float32)
            draft = DraftPayload(res.input_ids, ones, ones.astype(jnp.int32))
            lens = res.seq_lens + 1
            if owned:
                lens = inputs["new_seq_lens"].at[batch.req_pool_indices].set(lens)
            return StepOutput(lens, draft, None, confidence=conf)

        own = (fm_jax.StepInput("new_seq_lens", "slot"),) if owned else ()
        step = fm.engine_step(forward, inputs=own)
        gen = np.arange(R, dtype=np.int64)
        batch = Batch(ForwardMode.EXTEND, SLOTS, np.array([3, 4]), np.array([1, 1]))
        for s in range(3):
            step(batch, jnp.asarray(_rows(s)), generation=gen)
        got = fm.resolve_confidence_cpu(SLOTS, wait=True)
        fm.check()
        return got, np.asarray(fm.resolve_seq_lens_cpu(SLOTS))

    (conf_t, lens_t), (conf_o, lens_o) = run(False), run(True)
    assert conf_o is not None and conf_t is not None
    np.testing.assert_array_equal(_bits(conf_o.confidence), _bits(_rows(1)))
    np.testing.assert_array_equal(_bits(conf_o.confidence), _bits(conf_t.confidence))
    np.testing.assert_array_equal(conf_o.generation, conf_t.generation)
    np.testing.assert_array_equal(lens_o, lens_t)
    np.testing.assert_array_equal(lens_o, [2, 2])
