"""What the host waits for in `resolve_seq_lens_cpu` with the next forward already queued.

An overlap engine publishes step N's lengths, enqueues step N + 1 (its resolve and its
forward), then reads step N's lengths on the host to schedule step N + 2. Three maps, side
by side in one interleaved run:

- fm_jax, `needs_cpu_seq_lens=True`: the publish starts copying its lengths to the host;
  the read takes that copy;
- fm_jax, `False`: the read gathers from the buffer, a sync behind the queued forward;
- SGLang's current class (`fm_bench.impls.sglang_torch_gather`, `needs_cpu_seq_lens` on, a
  spec map: SGLang copies only behind a spec publish's event), the same forward queued in
  torch: on CUDA a private stream copies the length buffer into pinned memory behind the
  publish event and the host waits for that stream; elsewhere `.cpu()` (torch's CPU ops
  run eagerly, so there the queued forward has already run when the read starts).

Per repetition: the wait inside the read, and each framework's forward alone, in ms;
medians and ranges over repetitions.

    python -m fm_bench.host_lengths [--batch 256] [--pool 4096] [--size 768] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax as fj
from fm_bench.impls.sglang_torch import DraftInfo
from fm_bench.impls.sglang_torch_gather import Batch as TorchBatch
from fm_bench.impls.sglang_torch_gather import SGLangGatherFutureMap
from fm_bench.impls.torch_common import device as torch_device
from fm_bench.report import write_result

DECODE = fj.ForwardMode.DECODE


class _SGLangWay:
    """SGLang's class on torch's device with a torch forward queued behind its publish."""

    def __init__(self, batch: int, pool: int, size: int) -> None:
        import torch

        self.torch, dev = torch, torch_device()
        self.dev = dev
        # A spec map (K = 1, H = 8): SGLang records the publish event, which its host copy
        # waits on, only when it publishes for speculative decoding.
        self.fm = SGLangGatherFutureMap(
            pool, dev, spec=(1, 8, torch.float32), needs_cpu_seq_lens=True
        )
        self.slots_cpu = torch.arange(1, batch + 1, dtype=torch.int64)
        self.slots = self.slots_cpu.to(dev)
        self.x = torch.ones((size, size), device=dev)

    def forward(self, ids: Any) -> Any:
        """The same forward as fm_jax's series, in torch."""
        x = self.x + ids[0].to(self.x.dtype)
        for _ in range(8):
            x = self.torch.tanh(x @ x)
        return x

    def sync(self) -> None:
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def wait_ms(self) -> float:
        """Publish (step N's tail), queue the next forward, time the host-length read."""
        self.fm.publish(self.slots, self.slots + 1)
        self.forward(self.slots)  # step N + 1, queued (on CPU: run)
        b = TorchBatch(
            self.slots,
            self.slots,
            spec_info=DraftInfo(self.slots),
            req_pool_indices_cpu=self.slots_cpu,
        )
        t = time.perf_counter()
        self.fm.resolve_seq_lens_cpu(b)
        wait = 1e3 * (time.perf_counter() - t)
        if b.seq_lens_cpu is None or int(b.seq_lens_cpu[0]) != 2:
            raise AssertionError("SGLang's host copy did not read the published lengths")
        self.sync()
        return wait

    def forward_ms(self) -> float:
        """The forward alone, waited for."""
        t = time.perf_counter()
        self.forward(self.slots)
        self.sync()
        return 1e3 * (time.perf_counter() - t)


def measure(batch: int, pool: int, size: int, reps: int) -> dict[str, Any]:
    """Per map: the read's wait (ms) with the forward queued; and each forward alone."""

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
    sglang = _SGLangWay(batch, pool, size)
    sglang_waits: list[float] = []
    torch_alone: list[float] = []
    for fm in maps.values():  # compile and warm
        fm.publish(slots, lens_of(dev_slots))
        forward(x, fm.resolve(batch_n).input_ids).block_until_ready()
        fm.resolve_seq_lens_cpu(slots)
    sglang.wait_ms()

    def fm_jax_wait(needs: bool) -> None:
        fm = maps[needs]
        fm.publish(slots, lens_of(dev_slots))  # step N's tail
        queued = forward(x, fm.resolve(batch_n).input_ids)  # step N + 1, queued
        t = time.perf_counter()
        fm.resolve_seq_lens_cpu(slots)
        waits[needs].append(1e3 * (time.perf_counter() - t))
        queued.block_until_ready()

    series = [
        lambda: fm_jax_wait(True),
        lambda: fm_jax_wait(False),
        lambda: sglang_waits.append(sglang.wait_ms()),
    ]
    for r in range(reps):
        for run in series[r % 3 :] + series[: r % 3]:  # each series first in turn
            run()
        t = time.perf_counter()
        forward(x, dev_slots).block_until_ready()
        alone.append(1e3 * (time.perf_counter() - t))
        torch_alone.append(sglang.forward_ms())

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
        "wait_ms_sglang": stats(sglang_waits),
        "forward_ms": stats(alone),
        "forward_ms_torch": stats(torch_alone),
        "torch_device": str(sglang.dev),
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
            f"| fm_jax: the publish's copy (`needs_cpu_seq_lens=True`) | "
            f"{cell(res['wait_ms_copy'])} |",
            f"| fm_jax: a gather from the buffer (`False`) | {cell(res['wait_ms_gather'])} |",
            f"| SGLang's class: its host copy behind the publish event ({res['torch_device']}) | "
            f"{cell(res['wait_ms_sglang'])} |",
            f"| (the queued forward alone: jax) | {cell(res['forward_ms'])} |",
            f"| (the queued forward alone: torch) | {cell(res['forward_ms_torch'])} |",
            "",
            "SGLang's copy off CUDA is `.cpu()`, and torch's CPU ops run as they are called: "
            "there its forward has run before the read, so its wait is the copy alone.",
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
        write_result(args.out, "host_lengths", text, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
