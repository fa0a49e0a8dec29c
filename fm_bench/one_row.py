"""The one-row path and engine-owned relay buffers, measured: compiled ops and time per call.

For batches of one row and of two (static shapes), each pure op jitted with the state
donated: its compiled entry ops (`gathers`, `scatters`, dynamic slices `dslices`, in-place
dynamic-update-slices `dus`, and `kernels` as `fm_bench.inplace` counts them), the host time
of a call (dispatch, the wait deferred) and its waited time (dispatch + run), medians. Then
the engine step whose tail publishes and stashes against the one whose forward owns
`new_seq_lens` and `output_tokens` (`StepInput(..., "slot")`): scatters in the compiled step
and the same timings. On a GPU `kernels` is about the launches (see `fm_bench.inplace`).

    python -m fm_bench.one_row [--calls N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax as fj
from fm_bench.inplace import kernels

POOL = 1024


def _ops(hlo: str) -> dict[str, float]:
    entry = hlo[hlo.index("ENTRY") :]
    count = lambda op: len(re.findall(rf"\b{op}\(", hlo))  # noqa: E731
    return {
        "kernels": kernels(hlo),
        "gathers": count("gather"),
        "scatters": count("scatter"),
        "dslices": count("dynamic-slice"),
        "dus": count("dynamic-update-slice"),
        "entry_lines": len(entry.splitlines()),
    }


def _time(call: Callable[[], Any], calls: int) -> tuple[float, float]:
    """(host us, waited us) of `call`: medians over `calls` calls, one warm call first."""
    jax.block_until_ready(call())
    host, waited = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = call()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        host.append(t1 - t0)
        waited.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(host), 1e6 * statistics.median(waited)


def pure_ops(b: int, spec: fj.SpecConfig | None, calls: int) -> dict[str, Any]:
    """Each op of a `b`-row DECODE batch: compiled ops and times."""
    ops = fj.future_map(POOL, spec=spec)
    idx = jnp.arange(1, b + 1, dtype=jnp.int32)
    if spec is None:
        payload: Any = idx
        batch = fj.Batch(fj.ForwardMode.DECODE, idx, -idx, -idx)
    else:
        k, h = spec.topk, spec.hidden
        payload = fj.DraftPayload(
            idx,
            jnp.ones((b, k), jnp.float32),
            jnp.ones((b, k), jnp.int32),
            jnp.ones((b, h), spec.hidden_dtype),
        )
        batch = fj.Batch(fj.ForwardMode.DECODE, idx, idx, idx, draft_indices=idx)
    writes = {
        "publish": lambda s, i: ops.publish(s, i, i + 1),
        "stash": lambda s, i: ops.stash(s, i, payload),
    }
    out = {}
    for name, f in writes.items():
        jitted = jax.jit(f, donate_argnums=0)
        held = [ops.init()]
        out[name] = _ops(jitted.lower(held[0], idx).compile().as_text() or "")

        def call(j: Any = jitted, held: list[Any] = held) -> Any:
            held[0] = j(held[0], idx)
            return held[0]

        out[name]["host_us"], out[name]["waited_us"] = _time(call, calls)
    # Without debug resolve only reads: not donated.
    resolve = jax.jit(lambda s, i: ops.resolve(s, batch._replace(req_pool_indices=i))[1])
    state = ops.init()
    out["resolve"] = _ops(resolve.lower(state, idx).compile().as_text() or "")
    out["resolve"]["host_us"], out["resolve"]["waited_us"] = _time(
        lambda: resolve(state, idx), calls
    )
    return out


def engine_steps(calls: int) -> dict[str, Any]:
    """The engine step of 1 and 8 rows: the tail's publish and stash, or owned buffers."""

    def tail(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
        toks = (res.input_ids[: res.seq_lens.shape[0]] * 7 + res.seq_lens) % 997
        return fj.StepOutput(res.seq_lens + 1, toks)

    def owned(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
        toks = (res.input_ids[: res.seq_lens.shape[0]] * 7 + res.seq_lens) % 997
        i = batch.req_pool_indices
        lens = inputs["new_seq_lens"].at[i].set(res.seq_lens + 1, mode="drop")
        return fj.StepOutput(lens, inputs["output_tokens"].at[i].set(toks, mode="drop"))

    own = [fj.StepInput("new_seq_lens", "slot"), fj.StepInput("output_tokens", "slot")]
    out = {}
    for b in (1, 8):
        for name, fwd, decl in (("tail", tail, ()), ("owned", owned, own)):
            fm = fj.FutureMap(POOL, batch_buckets=[b], token_buckets=[b])
            step = fm.engine_step(fwd, inputs=decl)
            slots = np.arange(1, b + 1, dtype=np.int32)
            batch = fj.Batch(fj.ForwardMode.EXTEND, slots, slots, slots)
            p = fm._placement.resolve(batch, None, None, step=step._placed, inputs={})
            fn = fm._registry.jitted(p.key, p.pack, 0, step._build)
            hlo = fn.lower(fm.state, *p.args).compile()
            row = _ops(hlo.as_text() or "")

            def call(st: Any = step, bt: fj.Batch = batch) -> Any:
                return st(bt).out

            row["host_us"], row["waited_us"] = _time(call, calls)
            out[f"B={b} {name}"] = row
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    result: dict[str, Any] = {"backend": jax.default_backend(), "pool": POOL}
    for label, spec in (
        ("plain", None),
        ("spec_xla", fj.SpecConfig(4, 64)),
        ("spec_pallas", fj.SpecConfig(4, 64, kernel="pallas")),
    ):
        for b in (1, 2):
            result[f"{label} B={b}"] = pure_ops(b, spec, a.calls)
    result["engine_step"] = engine_steps(a.calls)
    cols = ["kernels", "gathers", "scatters", "dslices", "dus", "host_us", "waited_us"]
    print(f"{'':28s}" + "".join(f"{c:>10s}" for c in cols))
    for group, rows in result.items():
        if not isinstance(rows, dict):
            continue
        for op, row in rows.items():
            cells = "".join(
                f"{row[c]:10.1f}" if isinstance(row[c], float) else f"{row[c]:10d}" for c in cols
            )
            print(f"{group + ' ' + op:28s}{cells}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
