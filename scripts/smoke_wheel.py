"""Smoke test of an installed fm-jax: run by scripts/check_wheel.sh in a fresh environment that
holds the wheel and its runtime dependencies only (no torch).

It checks that the installed copy (not a checkout) is imported, that the distribution's
unconditional requirements are jax, jaxlib and numpy and that py.typed ships with fm_jax and
fm_torch, then runs two overlap steps (a prefill, then a decode that reads what the prefill
relayed) through the pure ops inlined in a jitted, donated step, and through the
`FutureMap` class fed numpy arrays, asserting the values.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax

# A donated state that XLA could not reuse would be copied on every step.
warnings.filterwarnings("error", message=".*donated buffers were not usable.*")


def check_install() -> None:
    """The installed wheel is imported, with its runtime requirements and type markers."""
    here = Path(fm_jax.__file__).resolve()
    assert "site-packages" in here.parts, f"fm_jax imported from {here}, not an installed wheel"
    reqs = importlib.metadata.requires("fm-jax") or []
    runtime = sorted(
        re.split(r"[^A-Za-z0-9_.-]", r, maxsplit=1)[0].lower() for r in reqs if "extra ==" not in r
    )
    assert runtime == ["jax", "jaxlib", "numpy"], reqs
    # Listed in the wheel's RECORD and on disk (read without importing fm_torch: no torch here).
    shipped = {str(f): f for f in importlib.metadata.files("fm-jax") or []}
    for marker in ("fm_jax/py.typed", "fm_torch/py.typed"):
        assert marker in shipped and Path(shipped[marker].locate()).is_file(), marker
    assert "torch" not in sys.modules


def check_pure_ops() -> None:
    """Prefill then decode through the pure ops in one jitted step with the state donated."""
    fm = fm_jax.future_map(pool_size=16)

    def step(state, batch):
        state, r = fm.resolve(state, batch)
        tokens = (r.input_ids * 7 + r.seq_lens) % 1000  # stand-in for the forward
        state = fm.publish(state, batch.req_pool_indices, r.seq_lens + 1)
        state = fm.stash(state, batch.req_pool_indices, tokens)
        return state, r, tokens, fm.invalidate(batch, batch.req_pool_indices)

    step = jax.jit(step, donate_argnums=0, compiler_options=fm_jax.compiler_options())
    slots = jnp.array([3, 5, 0, 0], jnp.int32)  # two requests, two padding rows
    prefill = fm_jax.Batch(
        jnp.int32(fm_jax.ForwardMode.EXTEND),
        slots,
        jnp.array([10, 20, 0, 0], jnp.int32),
        jnp.array([4, 6, 0, 0], jnp.int32),
    )
    state, r, tokens, nxt = step(fm.init(), prefill)
    np.testing.assert_array_equal(np.asarray(r.input_ids)[:2], [10, 20])
    np.testing.assert_array_equal(np.asarray(tokens)[:2], [74, 146])  # 10*7+4, 20*7+6
    # The host leaves sentinels for the next step: ids = lengths = -slot (padding: 0).
    np.testing.assert_array_equal(np.asarray(nxt.input_ids), [-3, -5, 0, 0])
    np.testing.assert_array_equal(np.asarray(nxt.seq_lens), [-3, -5, 0, 0])

    decode = nxt._replace(forward_mode=jnp.int32(fm_jax.ForwardMode.DECODE))
    state, r, tokens, _ = step(state, decode)
    np.testing.assert_array_equal(np.asarray(r.input_ids)[:2], [74, 146])  # what prefill stashed
    np.testing.assert_array_equal(np.asarray(r.seq_lens)[:2], [5, 7])  # what prefill published
    np.testing.assert_array_equal(np.asarray(tokens)[:2], [523, 29])  # (74*7+5, 146*7+7) % 1000
    np.testing.assert_array_equal(np.asarray(state.output_tokens)[[3, 5]], [523, 29])
    np.testing.assert_array_equal(np.asarray(state.new_seq_lens)[[3, 5]], [6, 8])


def check_class() -> None:
    """The same overlap through the FutureMap class (host numpy inputs, padded to buckets)."""
    fm = fm_jax.FutureMap(pool_size=16)
    slots = np.array([3, 4])
    r = fm.resolve(
        fm_jax.Batch(fm_jax.ForwardMode.EXTEND, slots, np.array([11, 12, 13]), np.array([2, 1]))
    )
    np.testing.assert_array_equal(np.asarray(r.input_ids)[:3], [11, 12, 13])  # EXTEND: as given
    np.testing.assert_array_equal(np.asarray(r.seq_lens)[:2], [2, 1])
    fm.publish(slots, np.array([3, 2]))
    fm.stash(slots, np.array([101, 102]))

    nxt = fm_jax.Batch(fm_jax.ForwardMode.DECODE, slots, -slots, -slots)  # sentinels
    r = fm.resolve(nxt)
    np.testing.assert_array_equal(np.asarray(r.input_ids)[:2], [101, 102])
    np.testing.assert_array_equal(np.asarray(r.seq_lens)[:2], [3, 2])

    nxt = fm.finish(nxt, slots, np.array([4, 3]), np.array([103, 104]))  # publish+stash+invalidate
    np.testing.assert_array_equal(np.asarray(nxt.input_ids)[:2], [-3, -4])
    np.testing.assert_array_equal(np.asarray(nxt.seq_lens)[:2], [-3, -4])
    r = fm.resolve(nxt)
    np.testing.assert_array_equal(np.asarray(r.input_ids)[:2], [103, 104])
    np.testing.assert_array_equal(np.asarray(r.seq_lens)[:2], [4, 3])


def main() -> None:
    check_install()
    check_pure_ops()
    check_class()
    assert "torch" not in sys.modules
    print(
        f"fm-jax {importlib.metadata.version('fm-jax')} smoke test passed "
        f"(jax {jax.__version__}, {jax.default_backend()}, Python {sys.version.split()[0]})"
    )


if __name__ == "__main__":
    main()
