"""Build the series of a group, time them interleaved, and turn the stats into result rows."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fm_bench import timing
from fm_bench.impls import (
    Op,
    floor,
    fm_jax_class,
    fm_jax_fused,
    fm_torch_eager,
    naive_jax,
    sglang_jax,
    sglang_torch,
    sglang_torch_gather,
)
from fm_bench.workload import Config, host_data, min_bytes

BUILDERS: dict[str, Callable[..., dict[str, Op]]] = {
    # sglang_torch: SGLang's sentinel-era class, or its current one under the gather protocol
    "fm_jax": fm_jax_class.build,
    "fm_jax_host": fm_jax_class.build_host,
    "fm_jax_fused": fm_jax_fused.build,
    "fm_torch": fm_torch_eager.build,
    "sglang_torch": lambda cfg, *a: (
        sglang_torch_gather.build if cfg.gather else sglang_torch.build
    )(cfg, *a),
    "sglang_jax": sglang_jax.build,
    "naive_jax": naive_jax.build,
    "floor": floor.build,
    "floor_host": floor.build_host,
    "floor_state": floor.build_state,
}


@dataclass(frozen=True)
class Key:
    """Identifies a series: implementation, debug mode, op and configuration (the
    configuration names the protocol)."""

    impl: str
    debug: bool
    op: str
    cfg: Config


def _baseline(key: Key) -> Key:
    return Key(key.impl + "/baseline", key.debug, key.op, key.cfg)


def build_series(
    cfg: Config,
    impls: Iterable[tuple[str, bool]],
    ops: Sequence[str],
) -> list[timing.Series]:
    """Series for each (impl, debug) of `impls` and each op of `ops` that it implements."""
    data = host_data(cfg)
    out: list[timing.Series] = []
    for impl, debug in impls:
        for op, w in BUILDERS[impl](cfg, data, debug, ops).items():
            key = Key(impl, debug, op, cfg)
            if w.baseline is not None:
                base = _baseline(key)
                out.append(timing.Series(base, w.baseline))
                out.append(timing.Series(key, w.run, w.setup, pair=base))
            else:
                out.append(timing.Series(key, w.run, w.setup))
    return out


def row(key: Key, st: timing.Stats, stats: dict[Hashable, timing.Stats]) -> dict[str, Any]:
    """One JSON result row (fused rows hold the marginal cost, baseline alongside)."""
    c = key.cfg
    r: dict[str, Any] = {
        "impl": key.impl,
        "op": key.op,
        "batch": c.batch,
        "pool": c.pool,
        "spec": c.spec,
        "dtype": c.dtype,
        "protocol": c.protocol,
        "debug": key.debug,
        "median_us": round(st.median_us, 2),
        "p10_us": round(st.p10_us, 2),
        "p90_us": round(st.p90_us, 2),
        "n": st.n,
        "host_us": None if st.host_us is None else round(st.host_us, 2),
        "pipe_us": None if st.pipe_us is None else round(st.pipe_us, 2),
        "bytes": min_bytes(c, key.op),
    }
    if c.spec:
        r["topk"], r["hidden"], r["hidden_dtype"] = c.topk, c.hidden, c.hidden_dtype
    base = stats.get(_baseline(key))
    if base is not None:
        r["baseline_median_us"] = round(base.median_us, 2)
    return r


def measure(
    series: Sequence[timing.Series],
    *,
    reps: int,
    warmup: int,
    budget_s: float | None,
    min_reps: int,
    on_rep: Callable[[], object] | None = None,
    seed: int = 0,
) -> dict[Hashable, timing.Stats]:
    """Time `series` as one interleaved group (`seed`: its shuffling)."""
    return timing.measure_group(
        series,
        reps=reps,
        warmup=warmup,
        budget_s=budget_s,
        min_reps=min_reps,
        on_rep=on_rep,
        seed=seed,
    )


def rows_of(stats: dict[Hashable, timing.Stats]) -> list[dict[str, Any]]:
    """Result rows of every non-baseline series."""
    return [
        row(k, st, stats)
        for k, st in stats.items()
        if isinstance(k, Key) and not k.impl.endswith("/baseline")
    ]
