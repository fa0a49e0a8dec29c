"""What a run measures: the sweeps (one interleaved group per configuration), the headline
group (every series behind a headline ratio, measured side by side) and the protocol groups
(each FutureMap implementation under both relay protocols, side by side)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fm_bench.workload import PROTOCOLS, Config

IMPLS = (
    "fm_jax",
    "fm_jax_host",
    "fm_jax_fused",
    "fm_torch",
    "sglang_torch",
    "sglang_jax",
    "naive_jax",
    "floor",
    "floor_host",
    "floor_state",
)
"""Implementation names as they appear in the JSON (`debug` tells the debug variants apart)."""

PROTOCOL_IMPLS = ("fm_jax", "fm_jax_host", "fm_jax_fused", "fm_torch", "sglang_torch")
"""The implementations with a FutureMap, measured under both protocols (sglang_torch: the
sentinel-era class, and SGLang's current class for the gather protocol)."""

PROTOCOL_OPS = ("stash", "resolve_decode", "resolve_mixed", "resolve_spec", "step")
"""Ops of the protocol groups. `stash` is the control: the same code in both protocols, so
its ratio shows what 'no difference' measures as. `step` is measured on the plain and on
the spec map."""


@dataclass(frozen=True)
class Headline:
    """The configurations behind the headline figures.

    Attributes:
      small, large: non-spec pool sizes compared for flatness in R (4K and 1M in a full run).
      spec_small, spec_large: spec pool sizes compared with H hidden states (1K and 16K).
      batch: batch size of every headline series.
      hidden: H of the spec series (bf16, and f32: XLA:CPU scatters bf16 through f32).
      spec32: also compare the spec step with f32 hidden states.
    """

    batch: int
    small: int
    large: int
    spec_small: int
    spec_large: int
    hidden: int
    spec32: bool = True

    def configs(self) -> dict[str, Config]:
        """The headline configurations by role."""
        b, h = self.batch, self.hidden
        out = {
            "small": Config(b, self.small),
            "large": Config(b, self.large),
            "spec_small": Config(b, self.spec_small, spec=True, hidden=h),
            "spec_large": Config(b, self.spec_large, spec=True, hidden=h),
        }
        if self.spec32:
            out["spec32_small"] = Config(b, self.spec_small, True, hidden=h, hidden_dtype="float32")
            out["spec32_large"] = Config(b, self.spec_large, True, hidden=h, hidden_dtype="float32")
        return out


@dataclass(frozen=True)
class Protocols:
    """The protocol comparison: one interleaved group per pool size, measured `runs` times,
    holding every implementation of `impls` under both protocols (plain and spec maps).

    Attributes:
      batch: B of every series.
      pools: R of each group.
      hidden: the spec maps' H (bf16, K = 8), one per pool: an H = 4096 bf16 hidden buffer
        at R = 1M would be 8 GiB per map.
      runs: groups per pool; medians and ranges are taken over them.
      reps: timed rounds per group (at most; `budget_s` may cut them to `min_reps`).
      budget_s: wall-time budget of one group's timed rounds (None: all `reps`).
      impls: the implementations measured.
    """

    batch: int
    pools: tuple[int, ...]
    hidden: tuple[int, ...]
    runs: int
    reps: int
    budget_s: float | None = None
    impls: tuple[str, ...] = PROTOCOL_IMPLS

    def __post_init__(self) -> None:
        if len(self.hidden) != len(self.pools):
            raise ValueError(f"one hidden size per pool: {self.hidden} for {self.pools}")

    def configs(self, pool: int) -> list[Config]:
        """One group's configurations: the plain and the spec map, each in both protocols."""
        h = self.hidden[self.pools.index(pool)]
        plain = [Config(self.batch, pool, protocol=p) for p in PROTOCOLS]
        return plain + [Config(self.batch, pool, True, hidden=h, protocol=p) for p in PROTOCOLS]


@dataclass(frozen=True)
class Startup:
    """The start-up table's runs (`fm_bench.startup`): fresh processes per map and mode.

    Attributes:
      runs: runs per map and mode (medians and ranges over them).
      pool: R of every map.
      small: tiny buckets instead of the defaults (a machinery check, not a figure).
      maps: which maps (plain, spec, debug, mesh).
    """

    runs: int
    pool: int = 4097
    small: bool = False
    maps: tuple[str, ...] = ("plain", "spec", "debug", "mesh")


@dataclass(frozen=True)
class EngineStepPlan:
    """The engine-step group's sizes (`fm_bench.engine_step`): B, pools, runs, steps per
    host figure and per waited figure, and the scheduler's busy µs before each step."""

    batch: int
    pools: tuple[int, ...]
    runs: int
    steps: int
    waited: int
    gap_us: float = 50.0


@dataclass(frozen=True)
class Plan:
    """A whole run: sweep configurations, headline sizes and repetition counts."""

    name: str
    batch_sweep: tuple[Config, ...]
    pool_sweep: tuple[Config, ...]
    spec_sweep: tuple[Config, ...]
    int64_sweep: tuple[Config, ...]
    headline: Headline
    reps: int
    warmup: int
    group_budget_s: float
    headline_reps: int
    min_reps: int = 20
    headline_budget_s: float | None = None
    inplace_check: tuple[Config, ...] = ()
    debug_variants: tuple[str, ...] = field(
        default=("fm_jax", "fm_jax_fused", "fm_torch", "sglang_torch")
    )
    startup: Startup | None = None
    protocols: Protocols | None = None
    engine_step: EngineStepPlan | None = None

    def sweep_configs(self, int64: bool) -> list[Config]:
        """Distinct configurations of the int32 sweeps (or of the int64 one), in order."""
        cfgs = self.int64_sweep if int64 else self.batch_sweep + self.pool_sweep + self.spec_sweep
        return list(dict.fromkeys(cfgs))


def _full() -> Plan:
    h = 4096
    return Plan(
        name="full",
        batch_sweep=tuple(Config(b, 4096) for b in (1, 4, 16, 64, 256, 1024)),
        pool_sweep=tuple(Config(256, r) for r in (1024, 4096, 16384, 65536, 262144, 1 << 20)),
        spec_sweep=tuple(Config(256, r, spec=True, hidden=h) for r in (1024, 4096, 16384)),
        int64_sweep=(Config(256, 4096, dtype="int64"), Config(256, 1 << 20, dtype="int64")),
        headline=Headline(256, 4096, 1 << 20, 1024, 16384, h),
        reps=200,
        warmup=10,
        group_budget_s=6.0,
        headline_reps=400,
        headline_budget_s=90.0,
        inplace_check=(Config(256, 1 << 20), Config(256, 16384, spec=True, hidden=h)),
        startup=Startup(runs=3),
        protocols=Protocols(256, (4096, 1 << 20), (h, 256), runs=5, reps=400, budget_s=15.0),
        engine_step=EngineStepPlan(256, (4096, 1 << 20), runs=5, steps=300, waited=50),
    )


def _quick() -> Plan:
    h = 256
    return Plan(
        name="quick",
        batch_sweep=tuple(Config(b, 1024) for b in (1, 64)),
        pool_sweep=tuple(Config(64, r) for r in (1024, 16384)),
        spec_sweep=tuple(Config(64, r, spec=True, hidden=h) for r in (1024, 4096)),
        int64_sweep=(Config(64, 1024, dtype="int64"),),
        headline=Headline(64, 1024, 16384, 1024, 4096, h),
        reps=15,
        warmup=2,
        group_budget_s=0.5,
        headline_reps=30,
        min_reps=5,
        inplace_check=(Config(64, 16384),),
        startup=Startup(runs=1, pool=65, small=True, maps=("plain", "mesh")),
        protocols=Protocols(64, (1024, 16384), (h, h), runs=2, reps=15, budget_s=0.5),
        engine_step=EngineStepPlan(64, (1024,), runs=2, steps=50, waited=10),
    )


def _tiny() -> Plan:
    # For tests: one plain and one spec configuration (the headline compares them with
    # themselves), a handful of repetitions.
    return Plan(
        name="tiny",
        batch_sweep=(Config(8, 64),),
        pool_sweep=(Config(8, 64),),
        spec_sweep=(Config(8, 64, spec=True, hidden=16),),
        int64_sweep=(Config(8, 64, dtype="int64"),),
        headline=Headline(8, 64, 64, 64, 64, 16, spec32=False),
        reps=3,
        warmup=1,
        group_budget_s=0.2,
        headline_reps=3,
        min_reps=2,
        debug_variants=("fm_jax", "fm_torch", "sglang_torch"),
        startup=Startup(runs=1, pool=65, small=True, maps=("plain",)),
        protocols=Protocols(8, (64,), (16,), runs=2, reps=3),
        engine_step=EngineStepPlan(8, (64,), runs=1, steps=4, waited=2),
    )


PLANS = {"full": _full, "quick": _quick, "tiny": _tiny}


def get(name: str) -> Plan:
    """The plan called `name` ('full', 'quick' or 'tiny')."""
    return PLANS[name]()
