"""Run a DP scenario on a mesh (`fm_jax.FutureMap(mesh=...)`) and on one unsharded map per rank.

Both drivers follow SPEC.md's overlap step per rank (resolve, forward, publish, stash,
invalidate) and record a trace: per (step, rank) the resolved ids and lengths, the
sampled tokens, the invalidated sentinels, and at the end each rank's buffers. Traces are
compared as raw bytes. `run_on_mesh` is what `fm-parity --dp N --tp M` calls.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.experimental import checkify
from jax.sharding import Mesh

from fm_jax import (
    Batch,
    ForwardMode,
    FutureMap,
    future_map,
    pad_to_bucket,
    per_rank,
    power_of_two_buckets,
    raise_if_violated,
)
from parity.mesh_scenario import RankStep, Scenario, data_parallel_scenario, forward_tokens

Trace = dict[tuple[int, int], dict[str, np.ndarray]]
"""(step, rank) -> named arrays; (-1, rank) holds the rank's final buffers."""

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")

BATCH_BUCKETS = power_of_two_buckets(1024)
TOKEN_BUCKETS = power_of_two_buckets(8192)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
    """Collect one entry per XLA backend compile made inside the block."""
    seen: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def make_mesh(dp: int, tp: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A ('dp', 'tp') mesh over the first dp*tp devices (DP-major: a rank's TP group adjacent)."""
    devs = list(devices if devices is not None else jax.devices())
    if len(devs) < dp * tp:
        raise ValueError(f"dp={dp} x tp={tp} needs {dp * tp} devices, have {len(devs)}")
    return Mesh(np.array(devs[: dp * tp], dtype=object).reshape(dp, tp), ("dp", "tp"))


def _record(
    trace: Trace,
    s: int,
    d: int,
    step: RankStep,
    ids: np.ndarray,
    lens: np.ndarray,
    tokens: np.ndarray,
    sentinels: np.ndarray,
) -> None:
    trace[(s, d)] = {
        "input_ids": np.ascontiguousarray(ids),
        "seq_lens": np.ascontiguousarray(lens),
        "tokens": tokens,
        "sentinels": np.ascontiguousarray(sentinels),
    }
    if not np.array_equal(lens, step.host_lens):
        raise AssertionError(
            f"step {s} rank {d}: resolved seq_lens {lens.tolist()} != host's "
            f"{step.host_lens.tolist()}"
        )


@functools.lru_cache(maxsize=8)
def _single_pool_ops(pool_size: int, debug: bool) -> tuple[Any, Any, Any, Any]:
    """Jitted single-pool ops, shared by every rank's reference map (one compile per shape)."""
    ops = future_map(pool_size, debug=debug)

    def wrap(fn: Any) -> Any:
        if debug:
            return jax.jit(checkify.checkify(fn, errors=checkify.user_checks))
        return jax.jit(lambda *a: (None, fn(*a)))

    return wrap(ops.resolve), wrap(ops.publish), wrap(ops.stash), jax.jit(ops.init)


def run_unsharded(scn: Scenario, *, debug: bool = False) -> Trace:
    """Replay `scn` on one unsharded single-pool map per DP rank (the reference).

    Each rank has its own state from `fm_jax.future_map` (one device, no mesh), and pads
    its own rows to its own power-of-two bucket, as `fm_jax.FutureMap` does; idle ranks
    call nothing (SPEC.md: empty publish/stash are no-ops).
    """
    resolve, publish, stash, init = _single_pool_ops(scn.pool_size, debug)
    states = [init() for _ in range(scn.dp)]
    trace: Trace = {}

    def done(err: Any, s: int, op: str) -> None:
        if err is not None:
            raise_if_violated(err, step=s, op=op)

    for s, ranks in enumerate(scn.steps):
        for d, st in enumerate(ranks):
            if st.mode == ForwardMode.IDLE:
                continue
            n, t = st.slots.shape[0], st.input_ids.shape[0]
            rows, toks = _bucket(n, BATCH_BUCKETS), _bucket(t, TOKEN_BUCKETS)
            idx = pad_rows(st.slots, rows)
            batch = Batch(
                np.int32(st.mode), idx, pad_rows(st.input_ids, toks), pad_rows(st.seq_lens, rows)
            )
            err, (states[d], out) = resolve(states[d], batch)
            done(err, s, "resolve")
            ids = np.asarray(out.input_ids)[:t]
            lens = np.asarray(out.seq_lens)[:n]
            tokens, new_lens = forward_tokens(st, ids, lens, s)
            err, states[d] = publish(states[d], idx, pad_rows(new_lens, rows))
            done(err, s, "publish")
            err, states[d] = stash(states[d], idx, pad_rows(tokens, rows))
            done(err, s, "stash")
            sentinels = -st.slots  # SPEC.md: invalidate leaves -slot in ids and lengths
            _record(trace, s, d, st, ids, lens, tokens, sentinels)
    for d, state in enumerate(states):
        trace[(-1, d)] = {k: np.asarray(v) for k, v in state._asdict().items() if v is not None}
    return trace


@dataclass
class MeshRun:
    """A sharded run's trace and what it shows about compiles and collectives."""

    trace: Trace
    compiles: int = 0  # backend compiles on steps whose shape and batch kinds were seen before
    compiles_total: int = 0  # all backend compiles during the steps
    shapes: set[tuple[int, int]] = field(default_factory=set)  # (rows, tokens) per rank seen
    collectives: dict[str, int] = field(default_factory=dict)  # op -> collectives in its HLO
    resharded: bool = False  # did any step's state come back with another sharding


def run_sharded(
    scn: Scenario,
    mesh: Mesh,
    *,
    tp_axis: str | None = "tp",
    debug: bool = False,
    sizes: Any = None,
) -> MeshRun:
    """Replay `scn` on a `FutureMap` over `mesh`, feeding this process's ranks.

    Args:
      scn: the scenario; `scn.dp` must equal the mesh's 'dp' size.
      mesh: a mesh with a 'dp' axis.
      tp_axis: the TP axis name (buffers replicated on it), or None.
      debug: debug mode (errors raised at the end by `check()`).
      sizes: callable (step, local_rows, local_tokens) -> (rows, tokens) agreeing the
        per-rank padded sizes across processes; default: the scenario's own maxima
        bucketed, which every process can compute alone.

    Returns:
      MeshRun with the local ranks' trace.
    """
    fm = FutureMap(scn.pool_size, mesh=mesh, dp_axis="dp", tp_axis=tp_axis, debug=debug)
    if fm.layout.dp != scn.dp:
        raise ValueError(f"scenario has {scn.dp} DP ranks, the mesh {fm.layout.dp}")
    state_sharding = fm.state.output_tokens.sharding
    run = MeshRun(trace={})
    seen: set[tuple[int, int, frozenset[bool]]] = set()
    local = fm.local_ranks
    with count_compiles() as compiles:
        for s, ranks in enumerate(scn.steps):
            mine = {d: ranks[d] for d in local if ranks[d].mode != ForwardMode.IDLE}
            if sizes is None:
                rows = _bucket(scn.max_rows(s), fm.batch_buckets)
                toks = _bucket(scn.max_tokens(s), fm.token_buckets)
            else:
                rows, toks = sizes(
                    s,
                    max((st.slots.shape[0] for st in mine.values()), default=0),
                    max((st.input_ids.shape[0] for st in mine.values()), default=0),
                )
            # The map runs one of three resolve executables per shape: DECODE fixed, another
            # kind fixed, or the kinds traced when ranks differ (DECODE next to not).
            kind = frozenset(st.mode == ForwardMode.DECODE for st in mine.values())
            first_of_shape = (rows, toks, kind) not in seen
            before = len(compiles)
            batches = {
                d: Batch(int(st.mode), st.slots, st.input_ids, st.seq_lens)
                for d, st in mine.items()
            }
            out = fm.resolve(batches, rows=rows, tokens=toks)
            ids_r, lens_r = per_rank(out.input_ids, fm.layout), per_rank(out.seq_lens, fm.layout)
            new_lens, toks_by_rank, slots = {}, {}, {}
            for d, st in mine.items():
                ids = ids_r[d][: st.input_ids.shape[0]]
                lens = lens_r[d][: st.slots.shape[0]]
                toks_by_rank[d], new_lens[d] = forward_tokens(st, ids, lens, s)
                slots[d] = st.slots
            fm.publish(slots, new_lens, rows=rows)
            fm.stash(slots, toks_by_rank, rows=rows)
            inv = fm.invalidate(Batch(None, None, out.input_ids, out.seq_lens), slots, rows=rows)
            inv_r = per_rank(inv.input_ids, fm.layout)
            for d, st in mine.items():
                ids = ids_r[d][: st.input_ids.shape[0]]
                lens = lens_r[d][: st.slots.shape[0]]
                n = st.slots.shape[0]
                _record(run.trace, s, d, st, ids, lens, toks_by_rank[d], inv_r[d][:n])
            if not first_of_shape:
                run.compiles += len(compiles) - before
            run.shapes.add((rows, toks))
            seen.add((rows, toks, kind))
            if fm.state.output_tokens.sharding != state_sharding:
                run.resharded = True
    run.compiles_total = len(compiles)
    fm.check()
    for name, buffer in fm.buffers().items():
        for d, buf in per_rank(buffer, fm.layout).items():
            run.trace.setdefault((-1, d), {})[name] = buf
    run.collectives = hlo_collectives(fm, rows, toks)
    return run


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return int(pad_to_bucket(np.zeros(max(n, 1)), buckets).shape[0])


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """`x` with zero rows appended up to `rows` (slot 0, token 0)."""
    return np.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def hlo_collectives(fm: FutureMap, rows: int, tokens: int) -> dict[str, int]:
    """Count collective instructions in each op's compiled HLO at per-rank sizes (rows, tokens)."""
    dp, dt = fm.layout.dp, fm.dtype
    sh = fm.layout.sharding

    def arr(n: int, dtype: Any = dt) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((dp * n,), dtype, sharding=sh)

    state = jax.tree.map(
        lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=b.sharding), fm.state
    )
    mode = jax.ShapeDtypeStruct((dp,), np.int32)  # traced: one per rank, placed by the jit
    batch = Batch(mode, arr(rows), arr(tokens), arr(rows), None)
    ex = fm.executables()
    lowered = {
        "publish": ex["publish"].lower(state, arr(rows), arr(rows)),
        "stash": ex["stash"].lower(state, arr(rows), arr(rows)),
        "resolve": ex["resolve"].lower(state, batch),
        "invalidate": ex["sentinels"].lower(arr(rows)),
    }
    out = {}
    for op, low in lowered.items():
        text = low.compile().as_text()
        out[op] = count_collectives(text)
    return out


def count_collectives(hlo_text: str) -> int:
    """Cross-device collective instructions (sync or async start) in an HLO module's text."""
    return sum(hlo_text.count(f" {c}(") + hlo_text.count(f" {c}-start(") for c in COLLECTIVES)


def compare(
    ref: Trace, got: Trace, *, ranks: set[int] | None = None, skip_padding_slot: bool = False
) -> list[str]:
    """Byte-level differences between two traces (restricted to `ranks` if given).

    `skip_padding_slot` leaves out each rank's slot 0 from the final buffers: SPEC.md makes
    its content garbage (debug mode poisons it on resolve and overwrites it with padding on
    publish/stash, so it depends on how each driver padded). Everything else is compared.
    """
    keys_ref = {k for k in ref if ranks is None or k[1] in ranks}
    keys_got = {k for k in got if ranks is None or k[1] in ranks}
    diffs = [f"only in reference: step {k[0]} rank {k[1]}" for k in sorted(keys_ref - keys_got)]
    diffs += [f"only in run: step {k[0]} rank {k[1]}" for k in sorted(keys_got - keys_ref)]
    for k in sorted(keys_ref & keys_got):
        a, b = ref[k], got[k]
        if skip_padding_slot and k[0] < 0:
            a = {n: v[1:] for n, v in a.items()}
            b = {n: v[1:] for n, v in b.items()}
        for name in sorted(set(a) | set(b)):
            x, y = a.get(name), b.get(name)
            if (
                x is None
                or y is None
                or x.dtype != y.dtype
                or x.shape != y.shape
                or x.tobytes() != y.tobytes()
            ):
                where = "final buffers" if k[0] < 0 else f"step {k[0]}"
                diffs.append(f"{where} rank {k[1]} {name}: {x!r} != {y!r}")
    return diffs


def run_on_mesh(
    dp: int,
    tp: int,
    *,
    scenario: Scenario | None = None,
    steps: int = 12,
    pool_size: int = 8,
    seed: int = 0,
    debug: bool = False,
) -> list[dict[str, Any]]:
    """Run a DP scenario sharded over a dp x tp mesh and unsharded per rank; compare bytes.

    Needs dp*tp devices in this process (on CPU: XLA_FLAGS=
    --xla_force_host_platform_device_count=N before JAX starts).

    Returns:
      One report row: scenario, dp, tp, steps, ok (bit-identical), diffs (first few),
      recompiles (compiles on steps whose per-rank shape was seen before), shapes,
      collectives (per op, in the compiled HLO), resharded.
    """
    scn = scenario or data_parallel_scenario(dp, pool_size=pool_size, steps=steps, seed=seed)
    mesh = make_mesh(dp, tp)
    got = run_sharded(scn, mesh, tp_axis="tp", debug=debug)
    ref = run_unsharded(scn, debug=debug)
    diffs = compare(ref, got.trace, skip_padding_slot=debug)
    return [
        {
            "scenario": scn.name,
            "dp": dp,
            "tp": tp,
            "steps": len(scn.steps),
            "debug": debug,
            "ok": not diffs,
            "diffs": diffs[:5],
            "recompiles": got.compiles,
            "compiles_total": got.compiles_total,
            "shapes": sorted(got.shapes),
            "collectives": got.collectives,
            "resharded": got.resharded,
        }
    ]
