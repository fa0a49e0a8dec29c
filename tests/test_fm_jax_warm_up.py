"""Start-up: what warm_up compiles, the serving guard, and the persistent compile cache.

One-device checks run in this process. The 4 x 2 mesh checks and the persistent cache
(which must be switched on before a process's first compile, and is proven by a second
process) run in subprocesses that print a JSON report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

import fm_jax as fj
from fm_bench.child import call_in_child

R = 16
BATCH = (2, 4, 8)
TOKENS = (4, 16, 64)  # distinct from BATCH: a prefill's rows follow its token bucket
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Compiles:
    """Counts XLA compile events (compiles and persistent-cache loads) while registered."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == COMPILE_EVENT:
            self.count += 1


@pytest.fixture
def compiles() -> Any:
    counter = Compiles()
    monitoring.register_event_duration_secs_listener(counter)
    yield counter
    monitoring.unregister_event_duration_listener(counter)


def buffers_bytes(fm: fj.FutureMap) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}


def random_step(fm: fj.FutureMap, rng: np.random.Generator, dp: int = 1) -> None:
    """One overlap step of a random kind and size on every rank (host inputs): DECODE,
    EXTEND with up to 8 tokens a row, or MIXED."""
    n = int(rng.integers(0, 9))
    idx = {d: rng.choice(np.arange(1, R), n, replace=False) for d in range(dp)}
    kind = int(rng.integers(0, 3))
    if kind == 0:
        mode, ids, lens = fj.ForwardMode.DECODE, {d: -i for d, i in idx.items()}, None
    elif kind == 1:
        t = int(rng.integers(n, 8 * n + 1))
        mode, ids = fj.ForwardMode.EXTEND, {d: rng.integers(0, 99, t) for d in idx}
        lens = {d: np.ones(n, int) for d in idx}
    else:
        mode, ids = (
            fj.ForwardMode.MIXED,
            {d: np.r_[rng.integers(0, 99, 5), -i] for d, i in idx.items()},
        )
        lens = {d: np.full(n, 5) for d in idx}
    if n == 0:
        mode = fj.ForwardMode.IDLE
    lens = lens or {d: -i for d, i in idx.items()}
    if dp == 1:
        batch = fj.Batch(mode, idx[0], ids[0], lens[0])
        fm.resolve(batch)
        fm.finish(batch, idx[0], np.full(n, 3), rng.integers(0, 99, n))
    else:
        fm.resolve({d: fj.Batch(mode, idx[d], ids[d], lens[d]) for d in range(dp)})
        fm.finish(
            fj.Batch(mode, idx[0], ids[0], lens[0]),
            idx,
            {d: np.full(n, 3) for d in idx},
            {d: rng.integers(0, 99, n) for d in idx},
        )


def prefill(fm: fj.FutureMap, dp: int = 1) -> None:
    """Give every live slot of every rank a length and a token, eight slots a call."""
    for live in (np.arange(1, 9), np.arange(9, R)):
        ranks = range(dp)
        fm.publish({d: live for d in ranks}, {d: np.full(len(live), 3) for d in ranks})
        fm.stash({d: live for d in ranks}, {d: live for d in ranks})


# ------------------------------------------------------------------------ how many
@pytest.mark.parametrize("debug", [False, True])
def test_executables_grow_with_the_sum_of_the_buckets(debug: bool) -> None:
    """warm_up compiles the tail ops once per batch bucket and resolve once per token
    bucket and mode (DECODE only up to the largest batch's tokens), not per pair; a debug
    map as many (one executable per op, its slots always checked on the device)."""
    fm = fj.FutureMap(R, debug=debug, batch_buckets=BATCH, token_buckets=TOKENS)
    report = fm.warm_up()
    want = {
        "publish": 3,
        "stash": 3,
        "finish": 3,
        "sentinels": 3,
        "resolve_fixed_extend": 3,
        "resolve_fixed_decode": 2,  # token buckets 4 and 16 hold a batch of 8 decode rows
        "resolve": 3,
    }
    assert report.by_op == want
    assert report.executables == sum(want.values()) == 3 * 4 + 8
    assert report.compiled + report.from_cache == report.executables
    assert report.seconds > 0 and "executables in" in str(report)


def test_a_spec_map_warms_drafts_and_host_lengths() -> None:
    """A spec map's resolves are warmed with and without a draft, and its
    resolve_seq_lens_cpu (seq_lens_at) per batch bucket; a spec step then compiles nothing."""
    spec = fj.SpecConfig(topk=2, hidden=4, hidden_dtype=jnp.bfloat16)
    fm = fj.FutureMap(R, spec=spec, batch_buckets=BATCH, token_buckets=TOKENS)
    report = fm.warm_up(traced_modes=False)
    assert report.by_op["seq_lens_at"] == 3
    assert report.by_op["resolve_fixed_decode"] == 6  # every token bucket, x2 drafts
    assert report.by_op["resolve_fixed_extend"] == 6
    counter = Compiles()
    monitoring.register_event_duration_secs_listener(counter)
    try:
        idx = np.array([3, 5, 7])
        draft = fj.DraftPayload(
            np.array([1, 2, 3]),
            np.ones((3, 2), np.float32),
            np.ones((3, 2), np.int32),
            np.ones((3, 4), jnp.bfloat16),
        )
        fm.publish(idx, np.array([4, 4, 4]))
        fm.stash(idx, draft)
        fm.resolve_seq_lens_cpu(idx)
        fm.resolve(fj.Batch(fj.ForwardMode.DECODE, idx, -idx, -idx, idx))
        fm.resolve(fj.Batch(fj.ForwardMode.EXTEND, idx, np.arange(12), np.ones(3, int)))
        jax.block_until_ready(fm.state)
    finally:
        monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0


def test_warm_up_changes_no_buffer() -> None:
    """warm_up runs nothing: every buffer byte and the step count are as before."""
    fm = fj.FutureMap(R, debug=True, batch_buckets=BATCH, token_buckets=TOKENS)
    prefill(fm)
    before, step = buffers_bytes(fm), fm.step
    fm.warm_up()
    assert buffers_bytes(fm) == before and fm.step == step
    fm.check()


# ------------------------------------------------------------------------ the guard
@pytest.mark.parametrize("debug", [False, True])
def test_guard_is_silent_on_every_bucketed_shape(compiles: Compiles, debug: bool) -> None:
    """Under the guard, random steps of every kind and size (prefills padded by their
    token bucket) run without a compile and without a refusal."""
    fm = fj.FutureMap(R, debug=debug, batch_buckets=BATCH, token_buckets=TOKENS)
    fm.warm_up(guard=True)
    prefill(fm)
    traced = jnp.int32(fj.ForwardMode.EXTEND)  # made before counting: jnp.int32 compiles
    before = compiles.count
    rng = np.random.default_rng(0)
    for _ in range(120):
        random_step(fm, rng)
    live = np.arange(1, 9)
    fm.resolve(fj.Batch(traced, live, live, live))
    fm.invalidate(fj.Batch(fj.ForwardMode.DECODE, live, live, live), live)
    jax.block_until_ready(fm.state)
    assert compiles.count == before
    if debug:
        fm.check()


def test_guard_refuses_an_unwarmed_shape_before_it_runs(compiles: Compiles) -> None:
    """Jax-array inputs at a (rows, tokens) pair warm_up did not plan (8 tokens pair with
    8 rows, not 2), a traced mode that was not warmed, and a dtype that was not: each
    raises FutureMapError naming the op and sizes, compiles nothing, changes no buffer."""
    fm = fj.FutureMap(R, batch_buckets=BATCH, token_buckets=TOKENS)
    fm.warm_up(guard=True, traced_modes=False)
    prefill(fm)
    dev = lambda *x: jax.device_put(np.array(x, np.int32))  # noqa: E731
    traced, small = jnp.int32(1), jax.device_put(np.array([3, 4], np.int16))
    before, compiled = buffers_bytes(fm), compiles.count
    odd_pair = fj.Batch(fj.ForwardMode.EXTEND, dev(1, 2), dev(*range(16)), dev(1, 1))
    with pytest.raises(fj.FutureMapError, match=r"resolve_fixed_extend at 2 rows x 16 tokens"):
        fm.resolve(odd_pair)
    with pytest.raises(fj.FutureMapError, match=r"resolve at .*not compiled by warm_up"):
        fm.resolve(fj.Batch(traced, np.array([1, 2]), np.array([-1, -2]), np.ones(2, int)))
    with pytest.raises(fj.FutureMapError, match=r"publish at 2 rows .*warmed for other"):
        fm.publish(dev(1, 2), small)
    assert compiles.count == compiled
    assert buffers_bytes(fm) == before
    fm.publish(np.array([1, 2]), np.array([7, 7]))  # the map keeps serving
    assert np.asarray(fm.buffers()["new_seq_lens"])[1:3].tolist() == [7, 7]


def test_the_guard_refuses_a_traced_gather_resolve_without_ids_before_compiling(
    compiles: Compiles,
) -> None:
    """Defect (reliability round two): a gather resolve with a traced mode and no ids
    compiled inside a guarded call. Its kind is known only on the device, so it must bring
    its ids: refused by name on the host, before any executable is looked up or compiled,
    with no step counted and no buffer changed."""
    fm = fj.FutureMap(R, protocol="gather", batch_buckets=BATCH, token_buckets=TOKENS)
    fm.warm_up(guard=True)
    prefill(fm)
    traced = jnp.int32(fj.ForwardMode.DECODE)  # made before counting: jnp.int32 compiles
    before, compiled, step = buffers_bytes(fm), compiles.count, fm.step
    live = np.array([1, 2], np.int32)
    with pytest.raises(fj.FutureMapError, match=r"input_ids is None with a traced forward_mode"):
        fm.resolve(fj.Batch(traced, live, None, live))
    assert compiles.count == compiled and fm.step == step
    assert buffers_bytes(fm) == before
    r = fm.resolve(fj.Batch(traced, live, live, live))  # with ids: warmed, served
    jax.block_until_ready(r.input_ids)
    assert compiles.count == compiled


def test_without_the_guard_an_unwarmed_shape_compiles(compiles: Compiles) -> None:
    """The guard's counterpart: without it the same odd pair compiles and runs (so the
    guard tests above can fail)."""
    fm = fj.FutureMap(R, batch_buckets=BATCH, token_buckets=TOKENS)
    fm.warm_up()
    before = compiles.count
    dev = lambda *x: jax.device_put(np.array(x, np.int32))  # noqa: E731
    fm.resolve(fj.Batch(fj.ForwardMode.EXTEND, dev(1, 2), dev(*range(16)), dev(1, 1)))
    assert compiles.count > before


def test_prefill_rows_pad_to_their_token_bucket() -> None:
    """A host prefill of 2 rows and 10 tokens resolves at 16 rows x 16 tokens (its token
    bucket fixes its rows); a decode of 3 rows at 4 x 4; outputs keep their real rows."""
    fm = fj.FutureMap(R, batch_buckets=(2, 4, 8, 16), token_buckets=(4, 16, 64))
    prefill(fm)
    two = np.array([1, 2])
    out = fm.resolve(fj.Batch(fj.ForwardMode.EXTEND, two, np.arange(10), np.ones(2, int)))
    assert out.input_ids.shape == (16,) and out.seq_lens.shape == (16,)
    assert np.asarray(out.seq_lens)[:2].tolist() == [1, 1]
    idx = np.array([1, 2, 3])
    out = fm.resolve(fj.Batch(fj.ForwardMode.DECODE, idx, -idx, -idx))
    assert out.input_ids.shape == (4,) and np.asarray(out.input_ids)[:3].tolist() == [1, 2, 3]


# ------------------------------------------------------------------- in subprocesses
def _cache_process(cache_dir: str) -> dict[str, Any]:
    """Warm a default-bucket map with the persistent cache on; count compile events."""
    counter = Compiles()
    hits = []
    monitoring.register_event_duration_secs_listener(counter)
    monitoring.register_event_listener(
        lambda event, **kw: hits.append(1) if event.endswith("cache_hits") else None
    )
    fj.use_persistent_cache(cache_dir)
    report = fj.FutureMap(64, batch_buckets=BATCH, token_buckets=TOKENS).warm_up()
    return {
        "executables": report.executables,
        "compiled": report.compiled,
        "from_cache": report.from_cache,
        "events": counter.count,
        "hits": len(hits),
    }


def _mesh_process() -> dict[str, Any]:
    """A DP = 4 x TP = 2 map on 8 CPU devices: warm-up, then guarded random steps."""
    assert len(jax.devices()) == 8, jax.devices()
    mesh = jax.make_mesh((4, 2), ("dp", "tp"))
    out: dict[str, Any] = {}
    for debug in (False, True):
        fm = fj.FutureMap(
            R, mesh=mesh, tp_axis="tp", debug=debug, batch_buckets=BATCH, token_buckets=TOKENS
        )
        report = fm.warm_up(guard=True)
        prefill(fm, dp=4)
        counter = Compiles()
        monitoring.register_event_duration_secs_listener(counter)
        rng = np.random.default_rng(1)
        for _ in range(40):
            random_step(fm, rng, dp=4)
        jax.block_until_ready(fm.state)
        monitoring.unregister_event_duration_listener(counter)
        if debug:
            fm.check()
        dev = jax.device_put(np.zeros(8, np.int32), fm.layout.sharding)
        try:
            fm.publish(dev, jax.device_put(np.zeros(8, np.int16), fm.layout.sharding))
            refused = ""
        except fj.FutureMapError as e:
            refused = str(e)
        out[str(debug)] = {
            "executables": report.executables,
            "by_op": report.by_op,
            "compiles_after": counter.count,
            "refused": refused,
        }
    return out


def _subprocess(fn: str, args: list[Any], env: dict[str, str]) -> dict[str, Any]:
    """`fn(*args)` of this file, run in a fresh Python with `env`; its JSON report."""
    return call_in_child(__file__, fn, env, timeout=300, args=args)  # type: ignore[no-any-return]


def test_a_second_process_warms_up_from_the_persistent_cache(tmp_path: Path) -> None:
    """With use_persistent_cache, the first process compiles every executable and the
    second loads every one from disk: zero compiles by its own event count."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_ENABLE_X64")}
    args = [str(tmp_path / "cache")]
    first = _subprocess("_cache_process", args, env)
    second = _subprocess("_cache_process", args, env)
    assert first["compiled"] == first["executables"] > 0 and first["from_cache"] == 0
    assert second["from_cache"] == second["executables"] and second["compiled"] == 0
    # The whole second process (the map's init included) compiled nothing: every compile
    # event it saw was a load from the cache.
    assert second["events"] == second["hits"] > second["executables"]


def test_mesh_warm_up_and_guard() -> None:
    """On a 4 x 2 mesh of 8 CPU devices (jax.make_mesh): warm_up plans the same counts,
    guarded random steps of every kind compile nothing, and an unwarmed dtype is refused."""
    # Imported here: the child runs this file without tests/ on its path.
    from host_devices import cpu_devices_env

    env = cpu_devices_env(8)
    got = _subprocess("_mesh_process", [], env)
    for debug, part in got.items():
        assert part["compiles_after"] == 0, (debug, part)
        assert part["by_op"]["resolve"] == 3 and part["by_op"]["publish"] == 3
        assert "serving guard" in part["refused"] and "publish at 2 rows" in part["refused"]


_OTHER_DEVICE_CHILD = """
import numpy as np, jax, fm_jax as fj
fm = fj.FutureMap(8, batch_buckets=(2,), token_buckets=(2,))
fm.warm_up(guard=True, traced_modes=False)
x = jax.device_put(np.array([1, 2], np.int32), jax.devices()[1])
try:
    fm.resolve(fj.Batch(fj.ForwardMode.EXTEND, x, x, x))
    print("ran")
except fj.FutureMapError as e:
    print("refused", fm.step, "other arguments" in str(e))
"""


def test_the_guard_refuses_an_array_on_another_device_by_name() -> None:
    """Defect (reliability round two): under warm_up(guard=True) a jax array committed to
    another device raised a raw ValueError, and the refused call still counted a step.
    It is a FutureMapError from the guard now, and the step count stays."""
    from host_devices import cpu_devices_env

    proc = subprocess.run(
        [sys.executable, "-c", _OTHER_DEVICE_CHILD],
        env=cpu_devices_env(2),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["refused", "0", "True"]
