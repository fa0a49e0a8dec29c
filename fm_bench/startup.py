"""Start-up: what `FutureMap.warm_up()` costs a restarting engine, cold and from disk.

Every figure comes from a fresh process (a process that already compiled would hit JAX's
in-memory caches): per run and map, one process without the persistent cache, one that
fills an empty cache directory, and one that starts from that directory. Maps: the
default-bucket `FutureMap(4097)`, a spec map (K = 8, H = 4096 bf16; `--maps spec_pallas`:
the same with the Pallas spec kernel), a debug map, and a DP = 4 x TP = 2 mesh map on 8
virtual CPU devices (`--xla_force_host_platform_device_count`; on a GPU machine the mesh
case needs 8 devices and is skipped with fewer).

    python -m fm_bench.startup              # the table, 3 runs
    python -m fm_bench.startup --runs 1 --pool 65 --small   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fm_bench.child import ChildFailed, child_report
from fm_parity.host_devices import with_host_devices

MAPS = ("plain", "spec", "debug", "mesh")
"""The maps a run takes by default."""
KINDS = (*MAPS, "spec_pallas")
"""Every map --maps may name: also the spec map moving its fields with one Pallas kernel
(`SpecConfig(kernel='pallas')`; on CPU interpreted, so its figure is a GPU's only there)."""
MODES = ("no cache", "filling the cache", "from the cache")
SMALL_BUCKETS = (1, 4, 16)  # --small: a check of the machinery, not a figure


def _child(kind: str, pool: int, small: bool, cache: str | None) -> dict[str, Any]:
    """One fresh process's start-up: import, build the map, warm it up."""
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp

    import fm_jax as fj

    if cache:
        fj.use_persistent_cache(cache)
    kw: dict[str, Any] = {}
    if small:
        kw.update(batch_buckets=SMALL_BUCKETS, token_buckets=SMALL_BUCKETS)
    if kind in ("spec", "spec_pallas"):
        kernel = "pallas" if kind == "spec_pallas" else "xla"
        kw["spec"] = fj.SpecConfig(topk=8, hidden=4096, hidden_dtype=jnp.bfloat16, kernel=kernel)
    elif kind == "debug":
        kw["debug"] = True
    elif kind == "mesh":
        if len(jax.devices()) < 8:
            return {"skipped": f"{len(jax.devices())} devices, the mesh needs 8"}
        kw.update(mesh=jax.make_mesh((4, 2), ("dp", "tp")), tp_axis="tp")
    fm = fj.FutureMap(pool, **kw)
    report = fm.warm_up()
    return {
        "executables": report.executables,
        "compiled": report.compiled,
        "from_cache": report.from_cache,
        "warm_up_s": report.seconds,
        "process_s": time.perf_counter() - t0,  # import + map + warm-up
        "platform": jax.devices()[0].platform,
    }


def _spawn(kind: str, pool: int, small: bool, cache: str | None) -> dict[str, Any]:
    cmd = ["-m", "fm_bench.startup", "--child", kind, "--pool", str(pool)]
    cmd += ["--small"] if small else []
    cmd += ["--cache", cache] if cache else []
    env = dict(os.environ)
    env.pop("JAX_ENABLE_X64", None)
    if kind == "mesh" and "cpu" in env.get("JAX_PLATFORMS", "cpu"):
        env = with_host_devices(env, 8)
    try:
        return child_report(cmd, env, timeout=900, marker="STARTUP")  # type: ignore[no-any-return]
    except ChildFailed as e:
        return {"error": (e.stderr or e.stdout)[-1500:]}


def measure(
    runs: int = 3, pool: int = 4097, small: bool = False, maps: tuple[str, ...] = MAPS
) -> list[dict[str, Any]]:
    """Start-up rows: one per map and mode, with the medians and spread over `runs`."""
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(runs):
        for kind in maps:
            with tempfile.TemporaryDirectory() as tmp:
                cache = str(Path(tmp) / "jax-cache")
                for mode, c in zip(MODES, (None, cache, cache), strict=True):
                    samples.setdefault((kind, mode), []).append(_spawn(kind, pool, small, c))
    rows = []
    for (kind, mode), got in samples.items():
        ok = [g for g in got if "error" not in g and "skipped" not in g]
        row: dict[str, Any] = {"map": kind, "mode": mode, "pool": pool, "runs": len(ok)}
        if not ok:
            row["note"] = got[0].get("skipped") or got[0].get("error", "")[-300:]
            rows.append(row)
            continue
        for k in ("warm_up_s", "process_s"):
            xs = [g[k] for g in ok]
            row[k] = statistics.median(xs)
            row[k + "_range"] = [min(xs), max(xs)]
        for k in ("executables", "compiled", "from_cache"):
            row[k] = ok[-1][k]
        row["platform"] = ok[-1]["platform"]
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The start-up table in markdown."""
    lines = [
        "| map | mode | executables | compiled | from cache | warm_up s, median (range) "
        "| process s (import + map + warm-up) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "warm_up_s" not in r:
            lines.append(f"| {r['map']} | {r['mode']} | {r.get('note', 'failed')} | | | | |")
            continue
        lo, hi = r["warm_up_s_range"]
        plo, phi = r["process_s_range"]
        lines.append(
            f"| {r['map']} | {r['mode']} | {r['executables']} | {r['compiled']} | "
            f"{r['from_cache']} | {r['warm_up_s']:.2f} ({lo:.2f}-{hi:.2f}) | "
            f"{r['process_s']:.2f} ({plo:.2f}-{phi:.2f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fm_bench.startup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pool", type=int, default=4097)
    ap.add_argument("--small", action="store_true", help="tiny buckets: a machinery check")
    ap.add_argument("--maps", nargs="+", choices=KINDS, default=list(MAPS))
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("STARTUP " + json.dumps(_child(args.child, args.pool, args.small, args.cache)))
        return 0
    rows = measure(args.runs, args.pool, args.small, tuple(args.maps))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
