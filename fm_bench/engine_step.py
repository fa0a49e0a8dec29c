"""`fm_jax_step`: what the FutureMap adds to an engine's own step, as an overlap engine pays it.

Series, measured side by side in one interleaved group (B rows, pool R, sentinel DECODE
steps, a trivial forward `(ids * 31 + 7) % V` plus three engine arrays per row):

- `fm_jax_step`: `FutureMap.engine_step` fed numpy (the batch and the engine's arrays), as a
  host scheduler feeds it: host checks, padding, one packed transfer, one dispatch.
- `no_map_packed` (its baseline): the same forward in the engine's own jit, fed the same
  numpy arrays packed into one transfer by the engine's own packing (`fm_bench.packing`,
  as vLLM's TPU runner packs its host arrays); no relay. `fm_jax_step - no_map_packed` is the
  map's marginal cost.
- `no_map_arrays`: that baseline with one numpy argument per array (no packing): what
  packing saves.
- `no_map_carry` / `no_map_carry_jax`: the same forward as an engine's step runs it,
  carrying its own state from step to step: a donated [R] buffer (its KV cache) written
  at the batch's slots, fed the packed numpy arrays / jax arrays.
- `fm_jax_step_jax`: the engine step fed jax arrays; `fm_jax_fused`: the pure ops inlined in
  one donated jit (jax arrays); `no_map_jax`: the forward alone on jax arrays (their baseline).
- `sglang_jax_fused`: sglang-jax's fused decode as it runs: the relay written inline in the
  model's jit (`where(ids < 0, map[-ids], ids)` at the head, `map.at[slots].set(tokens)` at
  the tail), the map not donated (a new map each step).
- `fm_jax_class`: the class's one-op entry points as an engine that calls them one by one
  does: `resolve` of the numpy batch, the forward in its own jit, `finish` with the host
  slots and the forward's tokens and lengths on the device.

The scheduler's work between steps (`gap_us`, default 50 µs of busy host time before each
enqueue, untimed) is part of the loop for every series, because on XLA:CPU it changes what
a dispatch costs: an executable that is not "cheap" (over ~1000 flops by XLA's cost
analysis: every series here at B = 256) runs on a worker thread, and a call made within
~10 µs of host work after the previous one finds that worker awake, while a call after
30 µs or more costs more host time. Measured on the 2-core CI VM, quiet: the same packed
forward 21 µs back to back, 35-37 µs after 30-200 µs of host work (with
`jax_cpu_enable_async_dispatch` off the difference is gone); the same forward carrying a
donated state from step to step 28 µs and 44-45 µs. A serving loop always has that work
between steps (sglang-jax measured a 6.6 ms host span), so a loop without it times only
the series whose host path is short enough to keep the worker awake; `--gap-us 0` shows
that loop.

Three figures per series, each per step: `host_us` (the calls' own time when each step is
enqueued with one earlier step in flight, as an overlap engine runs: enqueue N + 1, then
wait for N; what the scheduler thread pays), `pipe_us` (that loop's wall time per step)
and `waited_us` (median of steps each waited for: a synchronous loop's figure). `runs`
groups, each reshuffled; medians and the range over runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax as fj
from fm_bench.packing import pack, unpack
from fm_bench.plan import EngineStepPlan
from fm_bench.report import write_result

VOCAB = 32000
DECODE = fj.ForwardMode.DECODE
INPUTS = (fj.StepInput("a", "row"), fj.StepInput("b", "row"), fj.StepInput("c", "row"))


def _tokens(ids: jax.Array, extra: Any) -> jax.Array:
    return (ids * 31 + 7 + extra["a"] + extra["b"] - extra["c"]) % VOCAB


def build(batch: int, pool: int) -> dict[str, Callable[[], Any]]:
    """The series' step functions by name; each enqueues one step and returns its output."""
    rng = np.random.default_rng(0)
    slots = rng.permutation(np.arange(1, pool, dtype=np.int32))[:batch]
    host = {k: np.arange(batch, dtype=np.int32) for k in "abc"}
    dev = {k: jnp.asarray(v) for k, v in host.items()}
    options = fj.compiler_options()
    out: dict[str, Callable[[], Any]] = {}

    # fm_jax's engine step, fed numpy and fed jax arrays.
    # No host copy of the lengths (`needs_cpu_seq_lens`): the peers read none either.
    fm = fj.FutureMap(pool, batch_buckets=[batch], token_buckets=[batch], needs_cpu_seq_lens=False)

    def forward(res: fj.Resolved, b: fj.Batch, inputs: Any) -> fj.StepOutput:
        tokens = _tokens(res.input_ids, inputs)
        return fj.StepOutput(res.seq_lens + 1, tokens, tokens)

    step = fm.engine_step(forward, inputs=INPUTS)
    fm.finish(fj.Batch(DECODE, slots, slots, slots), slots, slots, slots)
    np_batch = fj.Batch(DECODE, slots, -slots, -slots)
    jslots = jnp.asarray(slots)
    jax_batch = fj.Batch(DECODE, jslots, -jslots, -jslots)
    out["fm_jax_step"] = lambda: step(np_batch, inputs=host).out
    out["fm_jax_step_jax"] = lambda: step(jax_batch, inputs=dev).out

    # The same forward without the map: packed numpy, numpy one by one, jax arrays.
    def no_map(ids: Any, extra: Any) -> Any:
        return _tokens(ids, extra)

    spec, _ = pack((np_batch.input_ids, host))
    packed_fn = jax.jit(lambda p: no_map(*unpack(spec, p)), compiler_options=options)
    arrays_fn = jax.jit(no_map, compiler_options=options)

    def packed_call() -> Any:
        return packed_fn(pack((np_batch.input_ids, host))[1])

    out["no_map_packed"] = packed_call
    out["no_map_arrays"] = lambda: arrays_fn(np_batch.input_ids, host)
    out["no_map_jax"] = lambda: arrays_fn(-jslots, dev)

    # The same forward carrying its own donated state (its KV cache, written at the slots).
    def carry(kv: jax.Array, slots: Any, ids: Any, extra: Any) -> Any:
        tokens = no_map(ids, extra)
        return kv.at[slots].set(tokens), tokens

    cspec, _ = pack((slots, np_batch.input_ids, host))
    carry_packed = jax.jit(
        lambda kv, p: carry(kv, *unpack(cspec, p)), donate_argnums=0, compiler_options=options
    )
    carry_arrays = jax.jit(carry, donate_argnums=0, compiler_options=options)
    kv = {"packed": jnp.zeros(pool, jnp.int32), "jax": jnp.zeros(pool, jnp.int32)}

    def carry_packed_call() -> Any:
        kv["packed"], tokens = carry_packed(
            kv["packed"], pack((slots, np_batch.input_ids, host))[1]
        )
        return tokens

    def carry_jax_call() -> Any:
        kv["jax"], tokens = carry_arrays(kv["jax"], jslots, -jslots, dev)
        return tokens

    out["no_map_carry"] = carry_packed_call
    out["no_map_carry_jax"] = carry_jax_call

    # fm_jax's pure ops inlined in one donated jit.
    ops = fj.future_map(pool)
    box = {"state": ops.stash(ops.publish(ops.init(), jslots, jslots), jslots, jslots)}

    def fused(state: fj.FutureMapState, b: fj.Batch, extra: Any) -> Any:
        state, res = ops.resolve(state, b)
        tokens = _tokens(res.input_ids, extra)
        state = ops.publish(state, b.req_pool_indices, res.seq_lens + 1)
        return ops.stash(state, b.req_pool_indices, tokens), tokens

    fused_fn = jax.jit(fused, donate_argnums=0, compiler_options=options)
    jmode = fj.Batch(jnp.int32(DECODE), jslots, -jslots, -jslots)

    def fused_call() -> Any:
        box["state"], tokens = fused_fn(box["state"], jmode, dev)
        return tokens

    out["fm_jax_fused"] = fused_call

    # sglang-jax's fused decode: the relay inline, the map not donated.
    sg = {"map": jnp.zeros(pool + 2, jnp.int32).at[jslots + 1].set(jslots)}

    def sglang(fmap: jax.Array, ids: jax.Array, sl: jax.Array, extra: Any) -> Any:
        ids = jnp.where(ids < 0, fmap[jnp.clip(-ids, 0)], ids)
        tokens = _tokens(ids, extra)
        return fmap.at[sl].set(tokens, mode="drop"), tokens

    sg_fn = jax.jit(sglang)
    sg_ids = -(jslots + 1)

    def sglang_call() -> Any:
        sg["map"], tokens = sg_fn(sg["map"], sg_ids, jslots + 1, dev)
        return tokens

    out["sglang_jax_fused"] = sglang_call

    # The class's one-op entry points.
    def class_forward(ids: jax.Array, lens: jax.Array, extra: Any) -> Any:
        return _tokens(ids, extra), lens + 1

    class_fn = jax.jit(class_forward, compiler_options=options)
    cm = fj.FutureMap(pool, batch_buckets=[batch], token_buckets=[batch], needs_cpu_seq_lens=False)
    cm.finish(fj.Batch(DECODE, slots, slots, slots), slots, slots, slots)

    def class_call() -> Any:
        res = cm.resolve(np_batch)
        tokens, lens = class_fn(res.input_ids, res.seq_lens, dev)
        cm.finish(np_batch, slots, lens, tokens)
        return tokens

    out["fm_jax_class"] = class_call
    return out


def _schedule(us: float) -> None:
    """The host scheduler's work between two steps: `us` microseconds of busy host time."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def _time(fn: Callable[[], Any], steps: int, waited: int, gap_us: float) -> dict[str, float]:
    """host_us, pipe_us (one step in flight behind the one being enqueued, `gap_us` of
    scheduler work before each enqueue), waited_us."""
    host, prev = 0.0, None
    t0 = time.perf_counter()
    for _ in range(steps):
        _schedule(gap_us)
        s = time.perf_counter()
        cur = fn()
        host += time.perf_counter() - s
        if prev is not None:
            jax.block_until_ready(prev)
        prev = cur
    jax.block_until_ready(prev)
    t2 = time.perf_counter()
    w = []
    for _ in range(waited):
        _schedule(gap_us)
        s = time.perf_counter()
        jax.block_until_ready(fn())
        w.append(time.perf_counter() - s)
    return {
        "host_us": 1e6 * host / steps,
        "pipe_us": 1e6 * (t2 - t0) / steps,
        "waited_us": 1e6 * statistics.median(w),
    }


RATIOS = (
    (
        "fm_jax_step marginal host over the carrying forward (us)",
        "fm_jax_step",
        "no_map_carry",
        "diff",
        "host_us",
    ),
    (
        "fm_jax_step_jax marginal host over the carrying forward (us)",
        "fm_jax_step_jax",
        "no_map_carry_jax",
        "diff",
        "host_us",
    ),
    ("carry / no carry, packed numpy, host", "no_map_carry", "no_map_packed", "ratio", "host_us"),
    ("fm_jax_step marginal host (us)", "fm_jax_step", "no_map_packed", "diff", "host_us"),
    ("fm_jax_step marginal waited (us)", "fm_jax_step", "no_map_packed", "diff", "waited_us"),
    ("fm_jax_fused marginal waited (us)", "fm_jax_fused", "no_map_jax", "diff", "waited_us"),
    ("fm_jax_step_jax marginal host (us)", "fm_jax_step_jax", "no_map_jax", "diff", "host_us"),
    ("fm_jax_fused marginal host (us)", "fm_jax_fused", "no_map_jax", "diff", "host_us"),
    ("sglang_jax_fused marginal host (us)", "sglang_jax_fused", "no_map_jax", "diff", "host_us"),
    ("packed / one transfer per array, host", "no_map_packed", "no_map_arrays", "ratio", "host_us"),
    ("fm_jax_step / fm_jax_class, host", "fm_jax_step", "fm_jax_class", "ratio", "host_us"),
    (
        "fm_jax_step / sglang_jax_fused, pipe",
        "fm_jax_step_jax",
        "sglang_jax_fused",
        "ratio",
        "pipe_us",
    ),
)


def run(
    batch: int,
    pools: list[int],
    runs: int,
    steps: int,
    waited: int,
    log: Callable[[str], None],
    gap_us: float = EngineStepPlan.gap_us,
) -> dict[str, Any]:
    """Every pool's group `runs` times, `gap_us` of scheduler work before each step;
    rows per series and the figures over runs."""
    rows, figures = [], []
    for pool in pools:
        fns = build(batch, pool)
        for fn in fns.values():  # compile and warm
            _time(fn, 20, 5, gap_us)
        per_run: list[dict[str, dict[str, float]]] = []
        for r in range(runs):
            order = list(fns)
            random.Random(r).shuffle(order)
            per_run.append({name: _time(fns[name], steps, waited, gap_us) for name in order})
            log(f"R={pool} run {r + 1}/{runs}")
        for name in fns:
            row: dict[str, Any] = {"impl": name, "batch": batch, "pool": pool, "runs": runs}
            for f in ("host_us", "pipe_us", "waited_us"):
                vals = [pr[name][f] for pr in per_run]
                row[f] = round(statistics.median(vals), 2)
                row[f + "_range"] = [round(min(vals), 2), round(max(vals), 2)]
            rows.append(row)
        for label, a, b, how, f in RATIOS:
            vals = [pr[a][f] - pr[b][f] if how == "diff" else pr[a][f] / pr[b][f] for pr in per_run]
            figures.append(
                {
                    "figure": label,
                    "pool": pool,
                    "median": round(statistics.median(vals), 3),
                    "range": [round(min(vals), 3), round(max(vals), 3)],
                }
            )
    d = jax.devices()[0]
    device = f"{d.platform} ({d.device_kind})"
    return {"device": device, "gap_us": gap_us, "rows": rows, "figures": figures}


def markdown(res: dict[str, Any]) -> str:
    """The results as a markdown page."""
    lines = [
        "# fm_jax_step: the map inside the engine's step",
        "",
        f"Device: {res['device']}. Per step, medians over runs (range). `host_us`: the calls' "
        "own time, each step enqueued with one earlier step in flight after "
        f"{res.get('gap_us', 0):g} µs of scheduler work; `pipe_us`: that loop's wall time "
        "(the scheduler's work included); `waited_us`: each step waited for. See "
        "fm_bench/engine_step.py.",
        "",
        "| series | R | host_us | pipe_us | waited_us |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        cells = [
            f"{r[f]:.1f} ({r[f + '_range'][0]:.1f}-{r[f + '_range'][1]:.1f})"
            for f in ("host_us", "pipe_us", "waited_us")
        ]
        lines.append(f"| {r['impl']} | {r['pool']} | " + " | ".join(cells) + " |")
    lines += ["", "| figure | R | median | range |", "| --- | ---: | ---: | ---: |"]
    for f in res["figures"]:
        lines.append(
            f"| {f['figure']} | {f['pool']} | {f['median']:.2f} | "
            f"{f['range'][0]:.2f} - {f['range'][1]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m fm_bench.engine_step`: run the group, print markdown, write files."""
    p = argparse.ArgumentParser(prog="fm_bench.engine_step", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pools", default="4096,1048576", help="comma-separated R values")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=300, help="steps enqueued per host figure")
    p.add_argument("--waited", type=int, default=50, help="waited steps per run")
    p.add_argument(
        "--gap-us",
        type=float,
        default=EngineStepPlan.gap_us,
        help="scheduler work before each step (busy µs)",
    )
    p.add_argument("--out", type=Path, default=None, help="write engine_step_<tag>.{md,json}")
    p.add_argument("--tag", default=None, help="file tag (default: the device platform)")
    args = p.parse_args(argv)
    pools = [int(x) for x in args.pools.split(",") if x]
    res = run(args.batch, pools, args.runs, args.steps, args.waited, log=print, gap_us=args.gap_us)
    text = markdown(res)
    print(text)
    if args.out is not None:
        write_result(args.out, "engine_step", text, res, args.tag)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
