"""Where the class's host time goes: its Python, its executables, and the dispatch floor.

A class step (`resolve` + `finish`, jax arrays already on the device) costs its scheduler
thread three things, measured here as three series side by side in one interleaved group,
per protocol and debug setting (B rows, pool R, DECODE steps):

- `floor`: two jitted no-ops on the batch's arrays: what any two dispatches cost;
- `ops`: the same two steps through fm_jax's pure ops, each jitted by hand as an engine that
  calls them one by one would (resolve with the mode fixed, returning no state unless
  debug; the tail (publish, stash, and in the sentinel protocol invalidate) donating the
  state): the class's executables without the class;
- `class`: `FutureMap.resolve` + `FutureMap.finish`;
- `class_host`: the same class step fed numpy arrays (the batch and the tail's slots,
  lengths and tokens), as a host scheduler feeds it, with the map's defaults.

`class - ops` is the class's own Python (argument checks, padding, keys, the lock, debug
bookkeeping); `ops - floor` is what its executables cost beyond a bare dispatch (more
arguments and outputs, a donated state, and on a GPU each kernel they launch). With debug
on the split is rough: the class's tail skips the slot checks its resolve made, so its
executables do less than `ops` and `class - ops` can be negative. The figures
are `host_us` (one step in flight, as an overlap engine runs), `pipe_us` and the waited
median; medians over `runs` groups, each reshuffled, with their range.

    python -m fm_bench.host_path [--batch 256] [--pool 4096] [--runs 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import checkify

import fm_jax as fj
from fm_bench.impls import floor
from fm_bench.impls.jax_common import device_data
from fm_bench.report import write_result
from fm_bench.timing import Series, measure_group, wait_jax
from fm_bench.workload import Config, host_data

D = fj.ForwardMode.DECODE
FIGURES = ("host_us", "pipe_us", "median_us")


def _batch(cfg: Config, idx: Any, lens: Any) -> fj.Batch:
    """A DECODE batch at `idx` (jax or numpy arrays) as the protocol's host builds it."""
    if cfg.gather:  # no ids: a DECODE's are gathered; the host's lengths
        return fj.Batch(D, idx, None, lens)
    return fj.Batch(D, idx, -idx, -idx)


def _floor(cfg: Config) -> Callable[[], object]:
    dd = device_data(cfg, host_data(cfg))
    b = _batch(cfg, dd.idx, dd.lens)
    head = tuple(a for a in (b.req_pool_indices, b.input_ids, b.seq_lens) if a is not None)

    def run() -> object:
        return wait_jax((floor.noop(*head), floor.noop(dd.idx, dd.lens, dd.tokens)))

    return run


def _ops(cfg: Config, debug: bool) -> tuple[Callable[[], object], Callable[[], object]]:
    """(run, setup) of resolve + tail through the pure ops, each in its own jit, as the class
    compiles them; setup reads the debug errors, untimed, as the class's does."""
    dd = device_data(cfg, host_data(cfg))
    ops = fj.future_map(cfg.pool, debug=debug, protocol=cfg.protocol)
    options = fj.compiler_options(jax.devices()[0].platform)
    wrap = (lambda f: checkify.checkify(f, errors=checkify.user_checks)) if debug else (lambda f: f)

    def head(state: fj.FutureMapState, b: fj.Batch) -> Any:
        state, res = ops.resolve(state, b._replace(forward_mode=D))
        return (state, res) if debug else res  # debug: the consume poison is written

    def tail(state: fj.FutureMapState, b: fj.Batch, toks: jax.Array, lens: jax.Array) -> Any:
        idx = b.req_pool_indices
        state = ops.stash(ops.publish(state, idx, lens), idx, toks)
        return state, (b if cfg.gather else ops.invalidate(b, idx))

    resolve = jax.jit(wrap(head), donate_argnums=(0,) if debug else (), compiler_options=options)
    finish = jax.jit(wrap(tail), donate_argnums=(0,), compiler_options=options)
    box: dict[str, Any] = {
        "state": ops.stash(ops.publish(ops.init(), dd.idx, dd.lens), dd.idx, dd.tokens),
        "batch": _batch(cfg, dd.idx, dd.lens)._replace(forward_mode=None),
    }
    errors: list[Any] = []

    def run() -> object:
        out = resolve(box["state"], box["batch"])
        if debug:
            err, (box["state"], out) = out
            errors.append(err)
        fin = finish(box["state"], box["batch"], dd.tokens, dd.lens)
        if debug:
            err, fin = fin
            errors.append(err)
        box["state"], box["batch"] = fin
        return wait_jax((out, box["state"], box["batch"].seq_lens))

    def setup() -> None:
        if len(errors) > 64:  # an engine reads its errors where it syncs anyway
            for e in errors:
                fj.raise_if_violated(e)
            errors.clear()

    return run, setup


def _class(
    cfg: Config, debug: bool, host: bool = False
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(run, setup) of a class step on jax arrays (`host`: numpy arrays, the batch built
    anew by the host each step); setup surfaces debug errors, untimed."""
    data = host_data(cfg)
    idx: Any
    lens: Any
    toks: Any
    if host:
        idx, lens, toks = (a.astype(np.int32) for a in (data.idx, data.lens, data.tokens))
    else:
        dd = device_data(cfg, data)
        idx, lens, toks = dd.idx, dd.lens, dd.tokens
    fm = fj.FutureMap(cfg.pool, debug=debug, protocol=cfg.protocol, needs_cpu_seq_lens=False)
    fm.publish(idx, lens)
    fm.stash(idx, toks)
    box = {"batch": _batch(cfg, idx, lens)}
    calls = [0]

    def run() -> object:
        r = fm.resolve(box["batch"])
        out = fm.finish(box["batch"], idx, lens, toks)
        if not host:  # the host builds its next batch itself
            box["batch"] = out
        calls[0] += 1
        return wait_jax((r, fm.state, out.seq_lens))

    def setup() -> None:
        if debug and calls[0] > 64:
            fm.check()  # the sync point an engine has anyway: keeps the error list short
            calls[0] = 0

    return run, setup


def measure(batch: int, pool: int, runs: int, reps: int, steps: int) -> dict[str, Any]:
    """Per (protocol, debug): floor, ops and class figures, medians over `runs` groups."""
    series: list[Series] = []
    for protocol in ("sentinel", "gather"):
        cfg = Config(batch, pool, protocol=protocol)
        series.append(Series((protocol, "floor", False), _floor(cfg)))
        for debug in (False, True):
            run, setup = _ops(cfg, debug)
            series.append(Series((protocol, "ops", debug), run, setup))
            run, setup = _class(cfg, debug)
            series.append(Series((protocol, "class", debug), run, setup))
        run, setup = _class(cfg, False, host=True)
        series.append(Series((protocol, "class_host", False), run, setup))
    per_run: dict[Any, list[dict[str, float]]] = {s.key: [] for s in series}
    for r in range(runs):
        stats = measure_group(series, reps=reps, warmup=5, seed=r, pipe_rounds=3, pipe_steps=steps)
        for k, st in stats.items():
            per_run[k].append({f: getattr(st, f) for f in FIGURES})
    rows = []
    for (protocol, kind, debug), got in per_run.items():
        row: dict[str, Any] = {"protocol": protocol, "series": kind, "debug": debug}
        for f in FIGURES:
            vals = [g[f] for g in got]
            row[f] = statistics.median(vals)
            row[f + "_range"] = [min(vals), max(vals)]
        rows.append(row)
    dev = jax.devices()[0]
    return {
        "device": f"{dev.platform} ({dev.device_kind})",
        "jax": jax.__version__,
        "batch": batch,
        "pool": pool,
        "runs": runs,
        "rows": rows,
    }


def markdown(res: dict[str, Any]) -> str:
    """The figures and, per protocol and debug setting, the split of the class's host time."""
    get = {(r["protocol"], r["series"], r["debug"]): r for r in res["rows"]}
    lines = [
        "# Where the class's host time goes",
        "",
        f"Device: {res['device']}, jax {res['jax']}; B = {res['batch']}, R = {res['pool']}, "
        f"{res['runs']} runs; µs per step, median (range over runs). See fm_bench/host_path.py.",
        "",
        "| protocol | series | debug | host_us | pipe_us | waited |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        cells = " | ".join(
            f"{r[f]:.1f} ({r[f + '_range'][0]:.1f}-{r[f + '_range'][1]:.1f})" for f in FIGURES
        )
        lines.append(
            f"| {r['protocol']} | {r['series']} | {'on' if r['debug'] else 'off'} | {cells} |"
        )
    lines += [
        "",
        "Host time of a class step, split (µs, medians): the dispatch floor, what the "
        "executables add to it (`ops - floor`), the class's Python (`class - ops`).",
        "",
        "| protocol | debug | floor | executables | class Python | class | class / floor |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    tail = ["", "Gather vs sentinel, host time of a class step (µs, medians):", ""]
    tail += ["| fed | sentinel | gather | gather / sentinel |", "| --- | ---: | ---: | ---: |"]
    for kind, fed in (("class", "jax arrays"), ("class_host", "numpy arrays")):
        s_us = get[("sentinel", kind, False)]["host_us"]
        g_us = get[("gather", kind, False)]["host_us"]
        tail.append(f"| {fed} | {s_us:.1f} | {g_us:.1f} | {g_us / s_us:.2f} |")
    for protocol in ("sentinel", "gather"):
        floor = get[(protocol, "floor", False)]["host_us"]
        for debug in (False, True):
            ops = get[(protocol, "ops", debug)]["host_us"]
            cls = get[(protocol, "class", debug)]["host_us"]
            lines.append(
                f"| {protocol} | {'on' if debug else 'off'} | {floor:.1f} | {ops - floor:.1f} | "
                f"{cls - ops:.1f} | {cls:.1f} | {cls / floor:.2f} |"
            )
    return "\n".join(lines + tail) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fm_bench.host_path", description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pool", type=int, default=4096)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--reps", type=int, default=50, help="waited rounds per run")
    p.add_argument("--steps", type=int, default=100, help="steps enqueued per host figure")
    p.add_argument("--out", type=Path, default=None, help="write host_path_<tag>.{md,json}")
    p.add_argument("--tag", default=None, help="file tag (default: the device platform)")
    a = p.parse_args(argv)
    res = measure(a.batch, a.pool, a.runs, a.reps, a.steps)
    md = markdown(res)
    print(md)
    if a.out is not None:
        write_result(a.out, "host_path", md, res, a.tag)


if __name__ == "__main__":
    main()
