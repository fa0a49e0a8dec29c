"""What the host waits for in `resolve_seq_lens_cpu` with the next forward already queued.

An overlap engine publishes step N's lengths, enqueues step N + 1 (its resolve and its
forward), then reads step N's lengths on the host to schedule step N + 2. Two maps, side by
side in one interleaved run: `needs_cpu_seq_lens=True` (the publish starts copying its
lengths to the host; the read takes that copy) and `False` (the read gathers from the
buffer: a sync behind the queued forward). Per repetition: the wait inside the read, and
the queued forward's own time (measured alone), in ms; medians and ranges over repetitions.

    python -m fm_bench.host_lengths [--batch 256] [--pool 4096] [--size 768] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax as fj

DECODE = fj.ForwardMode.DECODE


def measure(batch: int, pool: int, size: int, reps: int) -> dict[str, Any]:
    """Per mode: the read's wait (ms) with the forward queued; and the forward alone."""

    @jax.jit
    def forward(x: jax.Array, ids: jax.Array) -> jax.Array:
        x = x + ids[0].astype(x.dtype)
        for _ in range(8):
            x = jnp.tanh(x @ x)
        return x

    lens_of = jax.jit(lambda s: s + 1)
    x = jnp.ones((size, size), jnp.float32)
    slots = np.arange(1, batch + 1, dtype=np.int32)
    maps = {
        needs: fj.FutureMap(
            pool, batch_buckets=[batch], token_buckets=[batch], needs_cpu_seq_lens=needs
        )
        for needs in (True, False)
    }
    batch_n = fj.Batch(DECODE, slots, -slots, -slots)
    waits: dict[bool, list[float]] = {True: [], False: []}
    alone: list[float] = []
    dev_slots = jnp.asarray(slots)
    for fm in maps.values():  # compile and warm
        fm.publish(slots, lens_of(dev_slots))
        forward(x, fm.resolve(batch_n).input_ids).block_until_ready()
        fm.resolve_seq_lens_cpu(slots)
    for r in range(reps):
        for needs in (True, False) if r % 2 else (False, True):
            fm = maps[needs]
            fm.publish(slots, lens_of(dev_slots))  # step N's tail
            queued = forward(x, fm.resolve(batch_n).input_ids)  # step N + 1, queued
            t = time.perf_counter()
            fm.resolve_seq_lens_cpu(slots)
            waits[needs].append(1e3 * (time.perf_counter() - t))
            queued.block_until_ready()
        t = time.perf_counter()
        forward(x, dev_slots).block_until_ready()
        alone.append(1e3 * (time.perf_counter() - t))

    def stats(v: list[float]) -> dict[str, float]:
        return {"median": statistics.median(v), "min": min(v), "max": max(v)}

    d = jax.devices()[0]
    return {
        "device": f"{d.platform} ({d.device_kind})",
        "batch": batch,
        "pool": pool,
        "reps": reps,
        "wait_ms_copy": stats(waits[True]),
        "wait_ms_gather": stats(waits[False]),
        "forward_ms": stats(alone),
    }


def markdown(res: dict[str, Any]) -> str:
    """The result as a markdown page."""

    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"

    return "\n".join(
        [
            "# resolve_seq_lens_cpu with the next forward queued",
            "",
            f"Device: {res['device']}; B = {res['batch']}, R = {res['pool']}, "
            f"{res['reps']} repetitions, ms: median (range). See fm_bench/host_lengths.py.",
            "",
            "| the host waits for | ms |",
            "| --- | ---: |",
            f"| the publish's copy (`needs_cpu_seq_lens=True`) | {cell(res['wait_ms_copy'])} |",
            f"| a gather from the buffer (`False`) | {cell(res['wait_ms_gather'])} |",
            f"| (the queued forward, alone) | {cell(res['forward_ms'])} |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Run, print markdown, write host_lengths_<platform>.{md,json} with --out."""
    p = argparse.ArgumentParser(prog="fm_bench.host_lengths", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pool", type=int, default=4096)
    p.add_argument("--size", type=int, default=768, help="the queued forward's matrix size")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    res = measure(args.batch, args.pool, args.size, args.reps)
    text = markdown(res)
    print(text)
    if args.out is not None:
        tag = jax.devices()[0].platform
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"host_lengths_{tag}.json").write_text(json.dumps(res, indent=2) + "\n")
        (args.out / f"host_lengths_{tag}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
