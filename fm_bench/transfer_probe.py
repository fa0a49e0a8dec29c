"""What feeding numpy arrays to a jitted step costs: k host arrays passed one by one (each
its own host-to-device transfer), packed into one host array that the step splits (one
transfer), put with one `jax.device_put` of the list, or already on the device. The step
sums its inputs, so every byte is used; each run waits for the result. Interleaved rounds
(fm_bench.timing), medians and p10/p90 in µs.

Run: `python -m fm_bench.transfer_probe [--arrays 6] [--batch 256] [--reps 300]`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fm_bench.timing import Series, measure_group


def series(k: int, batch: int) -> list[Series]:
    """The five ways in, for k int32 arrays of `batch` entries."""
    rng = np.random.default_rng(0)
    host = [rng.integers(0, 1 << 20, batch, dtype=np.int32) for _ in range(k)]
    packed = np.stack(host)
    dev = [jax.device_put(a) for a in host]

    @jax.jit
    def many(*xs: Any) -> Any:
        return sum(xs[1:], xs[0])

    @jax.jit
    def one(x: Any) -> Any:
        return jnp.sum(x, axis=0)

    def run(f: Any, *args: Any) -> Any:
        return lambda: f(*args).block_until_ready()

    return [
        Series("numpy arrays, one transfer each", run(many, *host)),
        Series("numpy arrays packed (np.stack + one transfer)", lambda: run(one, np.stack(host))()),
        Series("one device_put of the list", lambda: run(many, *jax.device_put(host))()),
        Series("packed array already on the host", run(one, packed)),
        Series("jax arrays already on the device", run(many, *dev)),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Print (and with --json write) the medians of every way in."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arrays", type=int, default=6)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    stats = measure_group(series(args.arrays, args.batch), reps=args.reps, warmup=20)
    print(f"device: {jax.devices()[0].device_kind}; {args.arrays} x int32[{args.batch}]")
    rows = {}
    for key, s in stats.items():
        rows[str(key)] = {"median_us": s.median_us, "p10_us": s.p10_us, "p90_us": s.p90_us}
        print(f"{key:48s} {s.median_us:9.1f} µs  (p10 {s.p10_us:.1f}, p90 {s.p90_us:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": jax.devices()[0].device_kind,
                    "arrays": args.arrays,
                    "batch": args.batch,
                    "series": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
