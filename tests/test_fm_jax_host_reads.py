"""The map's host reads (fm_jax/map/host_reads.py), through the class.

Lengths to the host without a stall (`needs_cpu_seq_lens`): a publish starts copying its
lengths to the host, and `resolve_seq_lens_cpu` at those slots takes the copy, waiting for
the publishing step only; anything else gathers from the buffer, with the same values.

The confidence relay (docs/CONTRACT.md, 'The confidence relay'): publish's rows reach the
host ring bit for bit, a read looks two publishes with confidence back and never waits
unless asked, each entry keeps the generations of its own publish, and bad input is
refused before anything is written."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fm_jax
import fm_jax as fj
from fm_jax import (
    Batch,
    DraftPayload,
    ForwardMode,
    FutureMap,
    FutureMapError,
    SpecConfig,
    StepOutput,
)

D = fj.ForwardMode.DECODE


def a(*x: int) -> np.ndarray:
    return np.array(x, np.int32)


def make(needs: bool, protocol: str = "sentinel") -> fj.FutureMap:
    return fj.FutureMap(
        32,
        batch_buckets=(4,),
        token_buckets=(4,),
        needs_cpu_seq_lens=needs,
        protocol=protocol,
    )


@jax.jit
def slow(x: jax.Array) -> jax.Array:
    """A forward long enough to be still running when the host reads (about 0.1-1 s)."""
    for _ in range(12):
        x = jnp.tanh(x @ x)
    return x


FORWARD_SIZE = 600 if jax.default_backend() == "cpu" else 8192
"""`slow`'s matrix size: 12 products of 600 x 600 take a CPU 0.1-1 s, an H100 microseconds
(8192: about 10 ms of float32 products there)."""


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_host_lengths_are_the_buffers_values(protocol: str) -> None:
    """With and without the copy, every read returns new_seq_lens at the slots: after a
    publish of host or device lengths, a finish, an engine step, at the slots last
    published, at other slots, and after a later publish elsewhere."""

    def run(needs: bool) -> list[list[int]]:
        fm = make(needs, protocol)
        out = []
        fm.publish(a(3, 5), a(4, 6))  # host lengths: kept as given
        out.append(fm.resolve_seq_lens_cpu(a(3, 5)).tolist())
        fm.publish(a(3, 5, 7), jax.device_put(a(8, 9, 10, 0)))  # device lengths: copied
        out.append(fm.resolve_seq_lens_cpu(a(3, 5, 7)).tolist())
        out.append(fm.resolve_seq_lens_cpu(a(5, 3)).tolist())  # other slots: gathered
        ids = a(1, 2) if protocol == "gather" else a(-3, -5)
        b = fj.Batch(
            D,
            a(3, 5),
            None if protocol == "gather" else ids,
            a(8, 9) if protocol == "gather" else ids,
        )
        fm.finish(b, a(3, 5), jax.device_put(a(11, 12, 0, 0)), a(1, 2))
        out.append(fm.resolve_seq_lens_cpu(a(3, 5)).tolist())
        out.append(fm.resolve_seq_lens_cpu(a(7)).tolist())

        def forward(res: fj.Resolved, batch: fj.Batch, inputs: Any) -> fj.StepOutput:
            return fj.StepOutput(res.seq_lens + 1, res.input_ids, None)

        step = fm.engine_step(forward)
        step(
            fj.Batch(
                D,
                a(3, 5),
                None if protocol == "gather" else a(-3, -5),
                a(11, 12) if protocol == "gather" else a(-3, -5),
            )
        )
        out.append(fm.resolve_seq_lens_cpu(a(3, 5)).tolist())
        fm.publish(a(9), a(2))  # a publish elsewhere: slots 3, 5 are read from the buffer
        out.append(fm.resolve_seq_lens_cpu(a(3, 5)).tolist())
        return out

    assert run(True) == run(False)
    assert run(True)[:2] == [[4, 6], [8, 9, 10]]


@pytest.mark.parametrize("reset", [False, True])
@pytest.mark.parametrize("needs", [True, False])
def test_reading_the_last_published_lengths_waits_for_their_step_only(
    needs: bool, reset: bool
) -> None:
    """With the next step's forward queued behind the publish (it reads the map), the read
    of the slots just published returns while that forward still runs; without the copy
    (`needs_cpu_seq_lens=False`) the read is a sync behind it. A map `reset()` (after a
    publish) serves as it was made: it copies exactly when `needs_cpu_seq_lens` says."""
    fm = make(needs)
    if reset:
        fm.publish(a(3, 5, 7, 9), a(1, 1, 1, 1))
        fm.reset()
    x = jnp.ones((FORWARD_SIZE, FORWARD_SIZE), jnp.float32)
    slow(x).block_until_ready()
    idx = a(3, 5, 7, 9)
    lens = jax.jit(lambda: jnp.arange(4, dtype=jnp.int32) + 3)()
    fm.publish(idx, lens)  # step N publishes
    res = fm.resolve(fj.Batch(D, idx, -idx, -idx))
    queued = slow(x + res.input_ids[0])  # step N + 1's forward, queued behind it
    got = fm.resolve_seq_lens_cpu(idx)
    running = not queued.is_ready()
    assert got.tolist() == [3, 4, 5, 6]
    assert running is needs
    queued.block_until_ready()


def test_needs_cpu_seq_lens_is_a_bool() -> None:
    """A clear error for anything else."""
    with pytest.raises(fj.FutureMapError, match="needs_cpu_seq_lens must be a bool"):
        fj.FutureMap(8, needs_cpu_seq_lens="no")  # type: ignore[arg-type]


def test_a_host_array_reused_after_publish_does_not_change_the_read() -> None:
    """The host lengths and slots a publish was given are kept as copies: an engine that
    refills its own arrays for the next batch does not change what the read returns."""
    fm = make(True)
    idx, lens = a(3, 5, 7, 9), a(4, 5, 6, 7)
    fm.publish(idx, lens)
    lens[:] = 99
    assert fm.resolve_seq_lens_cpu(a(3, 5, 7, 9)).tolist() == [4, 5, 6, 7]
    idx[:] = a(1, 2, 4, 6)
    assert fm.resolve_seq_lens_cpu(a(1, 2, 4, 6)).tolist() == [0, 0, 0, 0]


# ------------------------------------------------------------------ the confidence relay
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
