"""fm_jax's pure ops, jitted and eager (chex.variants), against hand-worked expectations."""

from __future__ import annotations

import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.experimental import checkify

import fm_jax as fj

R = 6  # pool size: slot 0 is padding, live slots 1..5
K, H = 3, 4
DECODE, EXTEND, MIXED, IDLE = (
    fj.ForwardMode.DECODE,
    fj.ForwardMode.EXTEND,
    fj.ForwardMode.MIXED,
    fj.ForwardMode.IDLE,
)

OPS = fj.future_map(R)
OPS_DEBUG = fj.future_map(R, debug=True)


def i32(*xs: int) -> jax.Array:
    return jnp.asarray(np.array(xs, dtype=np.int32).reshape(-1))


def mode(m: fj.ForwardMode) -> jax.Array:
    return jnp.asarray(np.int32(m))


def checked(fn):  # noqa: ANN001, ANN201
    """`fn` under checkify with fm_jax's user checks (what debug-mode ops need)."""
    return checkify.checkify(fn, errors=checkify.user_checks)


def hidden_bits(hidden_dtype: object) -> np.dtype:
    """The unsigned dtype of the same width in which the state keeps hidden-state bits."""
    return np.dtype(f"uint{np.dtype(hidden_dtype).itemsize * 8}")  # type: ignore[call-overload]


def spec_ops(hidden_dtype: object | None) -> fj.FutureMapOps:
    cfg = fj.SpecConfig(topk=K, hidden=0 if hidden_dtype is None else H)
    if hidden_dtype is not None:
        cfg = cfg._replace(hidden_dtype=jnp.dtype(hidden_dtype))
    return fj.future_map(R, spec=cfg)


def draft(rows: int, hidden_dtype: object | None, seed: int) -> fj.DraftPayload:
    rng = np.random.default_rng(seed)
    hidden = None
    if hidden_dtype is not None:
        hidden = jnp.asarray(rng.standard_normal((rows, H)).astype(np.float32)).astype(hidden_dtype)
    return fj.DraftPayload(
        bonus_tokens=jnp.asarray(rng.integers(0, 1000, rows).astype(np.int32)),
        topk_p=jnp.asarray(rng.random((rows, K)).astype(np.float32)),
        topk_index=jnp.asarray(rng.integers(0, 1000, (rows, K)).astype(np.int32)),
        hidden_states=hidden,
    )


def bits(x: jax.Array | None) -> bytes | None:
    return None if x is None else np.asarray(x).tobytes()


HIDDEN_CASES = (
    ("no_hidden", None),
    ("bf16", jnp.bfloat16),
    ("f16", jnp.float16),
    ("f32", jnp.float32),
)


class InitTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_init_zeros_int32(self):
        """init must give zeroed int32 [R] buffers and no spec buffers without spec."""
        st = self.variant(OPS.init)()
        chex.assert_shape([st.output_tokens, st.new_seq_lens], (R,))
        chex.assert_type([st.output_tokens, st.new_seq_lens], jnp.int32)
        np.testing.assert_array_equal(st.output_tokens, np.zeros(R))
        np.testing.assert_array_equal(st.new_seq_lens, np.zeros(R))
        self.assertIsNone(st.topk_p)
        self.assertIsNone(st.hidden_states)
        self.assertEqual(OPS.dtype, np.dtype(np.int32))

    @chex.variants(with_jit=True, without_jit=True)
    def test_init_debug_poisons_output_tokens_and_lengths(self):
        """Debug init must poison output_tokens and new_seq_lens with -1 (so a read before
        any write fails; SGLang's poisoned init)."""
        st = self.variant(OPS_DEBUG.init)()
        np.testing.assert_array_equal(st.output_tokens, np.full(R, -1))
        np.testing.assert_array_equal(st.new_seq_lens, np.full(R, -1))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*HIDDEN_CASES)
    def test_init_spec_shapes(self, hidden_dtype):
        """Spec init must allocate [R, K] topk buffers and [R, H] hidden states, the real
        floats stored as the raw bits of their dtype (uint16 for bf16/f16, uint32 for f32)."""
        ops = spec_ops(hidden_dtype)
        st = self.variant(ops.init)()
        chex.assert_shape([st.topk_p, st.topk_index], (R, K))
        chex.assert_type([st.topk_p, st.topk_index], [jnp.uint32, jnp.int32])
        if hidden_dtype is None:
            self.assertIsNone(st.hidden_states)
        else:
            chex.assert_shape(st.hidden_states, (R, H))
            chex.assert_type(st.hidden_states, hidden_bits(hidden_dtype))
            self.assertFalse(np.asarray(st.hidden_states).any())


class WriteTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_publish_writes_indexed_slots_only(self):
        """publish must set new_seq_lens at its slots only, leaving output_tokens alone."""
        st = OPS.init()
        st = self.variant(OPS.publish)(st, i32(3, 1, 0), i32(7, 9, 4))
        # slot 0 takes the padding row's garbage (4); slots 2, 4, 5 untouched.
        np.testing.assert_array_equal(st.new_seq_lens, [4, 9, 0, 7, 0, 0])
        np.testing.assert_array_equal(st.output_tokens, np.zeros(R))
        chex.assert_type(st.new_seq_lens, jnp.int32)

    @chex.variants(with_jit=True, without_jit=True)
    def test_publish_casts_int64_host_values(self):
        """publish must cast lengths to the buffer dtype (numpy int64 in, int32 stored)."""
        st = self.variant(OPS.publish)(OPS.init(), i32(2), np.array([123], np.int64))
        chex.assert_type(st.new_seq_lens, jnp.int32)
        np.testing.assert_array_equal(st.new_seq_lens, [0, 0, 123, 0, 0, 0])

    @chex.variants(with_jit=True, without_jit=True)
    def test_empty_indices_are_noops(self):
        """An idle DP rank (empty indices) must leave every buffer unchanged."""
        st = OPS.publish(OPS.init(), i32(1, 2), i32(5, 6))
        st = OPS.stash(st, i32(1, 2), i32(8, 9))
        before = jax.tree.map(bits, st)
        empty = jnp.zeros((0,), jnp.int32)
        st2 = self.variant(OPS.publish)(st, empty, empty)
        st3 = self.variant(OPS.stash)(st2, empty, empty)
        self.assertEqual(jax.tree.map(bits, st3), before)

    @chex.variants(with_jit=True, without_jit=True)
    def test_stash_tokens_including_token_zero(self):
        """stash must write tokens at its slots; token 0 is a real token, stored as 0."""
        st = OPS.stash(OPS.init(), i32(2, 5), i32(7, 7))
        st = self.variant(OPS.stash)(st, i32(2, 5, 0), i32(0, 11, 99))
        np.testing.assert_array_equal(st.output_tokens, [99, 0, 0, 0, 0, 11])
        np.testing.assert_array_equal(st.new_seq_lens, np.zeros(R))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*HIDDEN_CASES)
    def test_stash_spec_draft(self, hidden_dtype):
        """A spec stash must write bonus tokens and every declared extra at its slots, bitwise."""
        ops = spec_ops(hidden_dtype)
        d = draft(2, hidden_dtype, seed=1)
        st = self.variant(ops.stash)(ops.init(), i32(4, 1), d)
        tok = np.zeros(R, np.int32)
        tok[[4, 1]] = np.asarray(d.bonus_tokens)
        np.testing.assert_array_equal(st.output_tokens, tok)
        p = np.zeros((R, K), np.float32)
        p[[4, 1]] = np.asarray(d.topk_p)
        self.assertEqual(bits(st.topk_p), p.tobytes())
        ti = np.zeros((R, K), np.int32)
        ti[[4, 1]] = np.asarray(d.topk_index)
        np.testing.assert_array_equal(st.topk_index, ti)
        if hidden_dtype is None:
            self.assertIsNone(st.hidden_states)
        else:
            h = np.zeros((R, H), np.asarray(d.hidden_states).dtype)
            h[[4, 1]] = np.asarray(d.hidden_states)
            chex.assert_type(st.hidden_states, hidden_bits(hidden_dtype))
            self.assertEqual(bits(st.hidden_states), h.tobytes())


def written_state() -> fj.FutureMapState:
    """Slots 1..5 hold tokens 10, 0, 30, 40, 50 and lengths 11, 12, 13, 14, 15."""
    st = OPS.publish(OPS.init(), i32(1, 2, 3, 4, 5), i32(11, 12, 13, 14, 15))
    return OPS.stash(st, i32(1, 2, 3, 4, 5), i32(10, 0, 30, 40, 50))


class ResolveTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_decode_restores_ids_and_lengths(self):
        """DECODE must replace id and length sentinels from the buffers; padding rows stay 0."""
        st = written_state()
        batch = fj.Batch(mode(DECODE), i32(3, 2, 0), i32(-3, -2, 0), i32(-3, -2, 0))
        st2, out = self.variant(OPS.resolve)(st, batch)
        np.testing.assert_array_equal(out.input_ids, [30, 0, 0])  # slot 2 holds token 0
        np.testing.assert_array_equal(out.seq_lens[:2], [13, 12])
        chex.assert_type([out.input_ids, out.seq_lens], jnp.int32)
        self.assertIsNone(out.draft)
        self.assertEqual(jax.tree.map(bits, st2), jax.tree.map(bits, st))  # non-debug: read only

    @chex.variants(with_jit=True, without_jit=True)
    def test_extend_passes_through(self):
        """EXTEND must leave positive ids (token 0 included) and real lengths unchanged."""
        st = written_state()
        batch = fj.Batch(mode(EXTEND), i32(4, 5), i32(0, 7, 8, 9, 0), i32(3, 2))
        _, out = self.variant(OPS.resolve)(st, batch)
        np.testing.assert_array_equal(out.input_ids, [0, 7, 8, 9, 0])
        np.testing.assert_array_equal(out.seq_lens, [3, 2])

    @chex.variants(with_jit=True, without_jit=True)
    def test_mixed_resolves_tail_ids_without_length_restore(self):
        """MIXED must fill the decode rows' id sentinels at the tail but keep host lengths."""
        st = written_state()
        # prefill row (slot 5, 3 tokens), then running decode rows (slots 1 and 4).
        batch = fj.Batch(mode(MIXED), i32(5, 1, 4), i32(6, 7, 8, -1, -4), i32(3, 21, 22))
        _, out = self.variant(OPS.resolve)(st, batch)
        np.testing.assert_array_equal(out.input_ids, [6, 7, 8, 10, 40])
        np.testing.assert_array_equal(out.seq_lens, [3, 21, 22])

    @chex.variants(with_jit=True, without_jit=True)
    def test_idle_padded_batch(self):
        """An IDLE batch (all rows padding, slot 0) must resolve to zeros and change nothing."""
        st = written_state()
        batch = fj.Batch(mode(IDLE), i32(0, 0), i32(0, 0), i32(0, 0))
        st2, out = self.variant(OPS.resolve)(st, batch)
        np.testing.assert_array_equal(out.input_ids, [0, 0])
        np.testing.assert_array_equal(out.seq_lens, [0, 0])
        self.assertEqual(jax.tree.map(bits, st2), jax.tree.map(bits, st))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*HIDDEN_CASES)
    def test_spec_decode_gathers_draft(self, hidden_dtype):
        """Spec DECODE with draft_indices must gather bonus tokens and extras bitwise, keep
        input_ids as given and restore lengths."""
        ops = spec_ops(hidden_dtype)
        d = draft(3, hidden_dtype, seed=2)
        st = ops.stash(ops.init(), i32(2, 5, 3), d)
        st = ops.publish(st, i32(2, 5, 3), i32(20, 50, 30))
        batch = fj.Batch(mode(DECODE), i32(5, 2, 0), i32(-5, -2, 0), i32(-5, -2, 0), i32(5, 2, 0))
        _, out = self.variant(ops.resolve)(st, batch)
        np.testing.assert_array_equal(out.input_ids, [-5, -2, 0])
        np.testing.assert_array_equal(out.seq_lens[:2], [50, 20])
        rows = [1, 0]  # slot 5 was row 1 of the draft, slot 2 row 0
        g = out.draft
        np.testing.assert_array_equal(g.bonus_tokens[:2], np.asarray(d.bonus_tokens)[rows])
        self.assertEqual(bits(g.topk_p[:2]), np.asarray(d.topk_p)[rows].tobytes())
        np.testing.assert_array_equal(g.topk_index[:2], np.asarray(d.topk_index)[rows])
        if hidden_dtype is None:
            self.assertIsNone(g.hidden_states)
        else:
            self.assertEqual(bits(g.hidden_states[:2]), np.asarray(d.hidden_states)[rows].tobytes())

    @chex.variants(with_jit=True, without_jit=True)
    def test_spec_prefill_without_draft_indices(self):
        """A spec batch without draft_indices (prefill) must return no draft and keep ids."""
        ops = spec_ops(jnp.bfloat16)
        batch = fj.Batch(mode(EXTEND), i32(1, 2), i32(4, 5, 6), i32(2, 1))
        _, out = self.variant(ops.resolve)(ops.init(), batch)
        self.assertIsNone(out.draft)
        np.testing.assert_array_equal(out.input_ids, [4, 5, 6])
        np.testing.assert_array_equal(out.seq_lens, [2, 1])

    @chex.variants(with_jit=True, without_jit=True)
    def test_invalidate_leaves_sentinels(self):
        """invalidate must set ids and lengths to -slot (padding rows 0) in the map dtype."""
        batch = fj.Batch(mode(DECODE), i32(3, 1, 0), i32(30, 10, 0), i32(13, 11, 0))
        out = self.variant(OPS.invalidate)(batch, i32(3, 1, 0))
        np.testing.assert_array_equal(out.input_ids, [-3, -1, 0])
        np.testing.assert_array_equal(out.seq_lens, [-3, -1, 0])
        chex.assert_type([out.input_ids, out.seq_lens], jnp.int32)
        np.testing.assert_array_equal(out.req_pool_indices, [3, 1, 0])

    @chex.variants(with_jit=True, without_jit=True)
    def test_debug_resolve_poisons_consumed_slots(self):
        """Debug resolve must pass a clean read and write -1 back into the batch's slots."""
        st = OPS_DEBUG.init()
        st = checked(OPS_DEBUG.stash)(st, i32(1, 2, 3), i32(10, 0, 30))[1]
        st = checked(OPS_DEBUG.publish)(st, i32(1, 2, 3), i32(5, 6, 7))[1]
        batch = fj.Batch(mode(DECODE), i32(2, 3), i32(-2, -3), i32(-2, -3))
        err, (st, out) = self.variant(checked(OPS_DEBUG.resolve))(st, batch)
        fj.raise_if_violated(err)
        np.testing.assert_array_equal(out.input_ids, [0, 30])
        np.testing.assert_array_equal(out.seq_lens, [6, 7])
        np.testing.assert_array_equal(st.output_tokens[1:], [10, -1, -1, -1, -1])

    @chex.variants(with_jit=True, without_jit=True)
    def test_composes_in_one_engine_step(self):
        """resolve at the head and publish/stash at the tail must compose in one function
        (one jit when jitted), with the state threaded through."""

        def step(state, batch):  # noqa: ANN001, ANN202
            state, res = OPS.resolve(state, batch)
            tokens = res.input_ids[: res.seq_lens.shape[0]] + 100  # the "forward"
            lens = res.seq_lens + 1
            state = OPS.publish(state, batch.req_pool_indices, lens)
            state = OPS.stash(state, batch.req_pool_indices, tokens)
            return state, OPS.invalidate(batch, batch.req_pool_indices), tokens

        st = OPS.publish(OPS.init(), i32(1, 2), i32(4, 5))
        batch = fj.Batch(mode(EXTEND), i32(1, 2), i32(1, 2), i32(4, 5))
        st, batch, tok = self.variant(step)(st, batch)
        np.testing.assert_array_equal(tok, [101, 102])
        batch = batch._replace(forward_mode=mode(DECODE))
        st, batch, tok = self.variant(step)(st, batch)
        np.testing.assert_array_equal(tok, [201, 202])
        np.testing.assert_array_equal(st.new_seq_lens[1:3], [6, 7])


class DtypeTest(chex.TestCase):
    def test_int64_refused_without_x64(self):
        """Asking for int64 without x64 mode must raise a FutureMapError naming x64, for the
        ops and the class, and leave x64 off."""
        self.assertFalse(jax.config.read("jax_enable_x64"))
        with pytest.raises(fj.FutureMapError, match="x64"):
            fj.future_map(R, dtype=jnp.int64)
        with pytest.raises(fj.FutureMapError, match="x64"):
            fj.FutureMap(R, dtype=np.int64)
        self.assertFalse(jax.config.read("jax_enable_x64"))

    def test_bad_int_dtype_refused(self):
        """A non-int32/int64 dtype must be a FutureMapError, not a numpy TypeError."""
        for bad in (jnp.int16, jnp.float32, "not-a-dtype"):
            with pytest.raises(fj.FutureMapError, match="int32 or int64"):
                fj.future_map(R, dtype=bad)

    @chex.variants(with_jit=True, without_jit=True)
    def test_int64_with_x64(self):
        """Under x64 mode int64 buffers must hold values beyond int32 through publish, stash
        and resolve (jax.enable_x64 is a context, so the global setting stays off)."""
        big = 2**40 + 3
        with jax.enable_x64(True):
            ops = fj.future_map(R, dtype=jnp.int64)
            st = self.variant(ops.init)()
            chex.assert_type(st.output_tokens, jnp.int64)
            idx = jnp.asarray(np.array([2, 4], np.int64))
            st = self.variant(ops.publish)(st, idx, jnp.asarray(np.array([big, 5], np.int64)))
            st = self.variant(ops.stash)(st, idx, jnp.asarray(np.array([big + 1, 6], np.int64)))
            batch = fj.Batch(jnp.asarray(np.int32(DECODE)), idx, -idx, -idx)
            _, out = self.variant(ops.resolve)(st, batch)
            np.testing.assert_array_equal(out.input_ids, [big + 1, 6])
            np.testing.assert_array_equal(out.seq_lens, [big, 5])
            chex.assert_type(out.input_ids, jnp.int64)
        self.assertFalse(jax.config.read("jax_enable_x64"))

    def test_int64_class_with_x64(self):
        """The FutureMap class must take int64 under x64 and keep host values beyond int32."""
        big = 2**35
        with jax.enable_x64(True):
            fm = fj.FutureMap(R, dtype=np.int64, batch_buckets=(2,), token_buckets=(2,))
            fm.publish(np.array([3]), np.array([big]))
            fm.stash(np.array([3]), np.array([big + 7]))
            out = fm.resolve(fj.Batch(DECODE, np.array([3]), np.array([-3]), np.array([-3])))
            np.testing.assert_array_equal(out.input_ids[:1], [big + 7])
            np.testing.assert_array_equal(out.seq_lens[:1], [big])
            chex.assert_type(fm.state.output_tokens, jnp.int64)
        self.assertFalse(jax.config.read("jax_enable_x64"))


def test_fm_jax_leaves_global_config_alone():
    """Building and running maps (int32, debug, spec, the class) must not flip any JAX
    config value."""
    names = ("jax_enable_x64", "jax_enable_checks", "jax_debug_nans", "jax_transfer_guard")
    before = {n: getattr(jax.config, n) for n in names}
    fm = fj.FutureMap(R, debug=True, batch_buckets=(2,), token_buckets=(2,))
    fm.publish(np.array([1]), np.array([3]))
    fm.check()
    with pytest.raises(fj.FutureMapError):
        fj.future_map(R, dtype=jnp.int64)
    spec_ops(jnp.bfloat16).init()
    assert {n: getattr(jax.config, n) for n in names} == before


def test_import_pulls_in_no_torch_parity_bench_or_serving_loop():
    """`import fm_jax` (and building and running a map) must not import torch, parity,
    bench or the serving loop: fm_jax is what a JAX engine imports."""
    code = (
        "import sys, numpy as np, fm_jax as fj\n"
        "fm = fj.FutureMap(4, batch_buckets=(1,), token_buckets=(1,))\n"
        "fm.publish(np.array([1]), np.array([2]))\n"
        "tools = ('torch', 'fm_parity', 'fm_bench', 'fm_serve')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in tools]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
