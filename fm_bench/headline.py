"""The headline figures: ratios of medians from one interleaved group.

Targets come from the issues (11: the host path and the floor; 12: the peers as they run)
and never change here; a figure that misses is reported as missed.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from fm_bench.plan import Headline
from fm_bench.report import COLUMNS
from fm_bench.run import Key, build_series
from fm_bench.timing import Series, Stats
from fm_bench.workload import Config

_VARIANTS = COLUMNS  # every implementation, debug off and on where it has one
_SPEC_VARIANTS = (
    ("fm_jax", False),
    ("fm_jax", True),
    ("fm_torch", False),
    ("sglang_torch", False),
    ("floor", False),
)


def variants(spec: bool) -> tuple[tuple[str, bool], ...]:
    """The (impl, debug) pairs whose 'step' enters the headline group for a (spec) config."""
    return _SPEC_VARIANTS if spec else _VARIANTS


def headline_series(h: Headline, built: dict[Config, list[Series]]) -> list[Series]:
    """Every 'step' series the headline figures compare, picked from the built series.

    Configurations missing from `built` are built here, 'step' only. The series stay in
    `built` (a configuration's sweep group measures them again).
    """
    out: list[Series] = []
    for cfg in dict.fromkeys(h.configs().values()):
        want = set(variants(cfg.spec))
        if cfg not in built:
            built[cfg] = build_series(cfg, sorted(want), ("step",))
        for s in built[cfg]:
            k = s.key
            if not isinstance(k, Key) or k.op != "step":
                continue
            if (k.impl.removesuffix("/baseline"), k.debug) in want:
                out.append(s)
    return out


@dataclass(frozen=True)
class Figure:
    """One headline ratio: numerator / denominator against a target (None: reported only)."""

    name: str
    num: Key
    den: Key
    target: float | None
    at_least: bool = False  # True: ratio must be >= target (a speed-up)
    # Judged on the waited medians: a figure about device work (growth in R, a copying
    # map's bytes), which host time cannot see. Every other figure: on host time.
    waited: bool = False

    def evaluate(self, stats: dict[Hashable, Stats]) -> dict[str, Any]:
        """The figure as a JSON row: both medians (waited, and host time with one step in
        flight), both ratios, the target and pass/miss. The target judges the host-time
        ratio (what an overlap engine's scheduler pays), or the waited one for a figure
        about device work (`waited`) or where no host time was measured."""
        num, den = stats[self.num], stats[self.den]

        def ratio_of(n: float | None, d: float | None) -> float | None:
            # A marginal cost can come out <= 0 (indistinguishable from nothing): no ratio.
            return None if n is None or d is None or d <= 0 else n / d

        waited = ratio_of(num.median_us, den.median_us)
        host = ratio_of(num.host_us, den.host_us)
        on_waited = self.waited or num.host_us is None
        ratio = waited if on_waited else host
        ok = None
        if self.target is not None and ratio is not None:
            ok = ratio >= self.target if self.at_least else ratio <= self.target

        def us(x: float | None) -> float | None:
            return None if x is None else round(x, 2)

        return {
            "figure": self.name,
            "numerator": _describe(self.num),
            "denominator": _describe(self.den),
            "numerator_us": round(num.median_us, 2),
            "denominator_us": round(den.median_us, 2),
            "numerator_host_us": us(num.host_us),
            "denominator_host_us": us(den.host_us),
            "ratio": None if ratio is None else round(ratio, 3),
            "judged_on": "waited" if on_waited else "host",
            "host_ratio": None if host is None else round(host, 3),
            "waited_ratio": None if waited is None else round(waited, 3),
            "target": None
            if self.target is None
            else (">= " if self.at_least else "<= ") + f"{self.target:g}",
            "pass": ok,
        }


def _describe(k: Key) -> str:
    c = k.cfg
    s = f"{k.impl}{' debug' if k.debug else ''} step B={c.batch} R={c.pool}"
    return s + (f" spec H={c.hidden}" if c.spec else "")


def figures(h: Headline, on_cpu: bool = True) -> list[Figure]:
    """The headline figures (targets) and reported-only companions.

    The class's host path against the floors and the real peers (sglang_jax, sglang_torch)
    at both non-spec pool sizes, then the flat-in-R figures. `on_cpu`: jax and torch both
    run on the CPU; the figures targeted on CPU only are reported elsewhere.
    """
    c = h.configs()
    small, large, ss, sl = c["small"], c["large"], c["spec_small"], c["spec_large"]
    s32 = [] if "spec32_small" not in c else [(c["spec32_small"], c["spec32_large"])]
    cpu_only = 1.0 if on_cpu else None

    def k(impl: str, cfg: Any, debug: bool = False) -> Key:
        return Key(impl, debug, "step", cfg)

    out: list[Figure] = []
    for cfg in (small, large):  # the class's host path, against the floors
        r = f"R={cfg.pool}"
        out += [
            Figure(
                f"fm_jax class step, numpy inputs vs floor_host, {r}",
                k("fm_jax_host", cfg),
                k("floor_host", cfg),
                1.5,
            ),
            Figure(
                f"fm_jax class step, jax inputs vs floor (2 dispatches each), {r}",
                k("fm_jax", cfg),
                k("floor", cfg),
                1.3,
            ),
            Figure(
                f"fm_jax class step, jax inputs vs floor_state (the floor carrying the state), {r}",
                k("fm_jax", cfg),
                k("floor_state", cfg),
                None,
            ),
            Figure(
                f"floor_state vs floor: the state's own dispatch cost, {r}",
                k("floor_state", cfg),
                k("floor", cfg),
                None,
            ),
            Figure(
                f"fm_jax class vs sglang_torch step (target on CPU), {r}",
                k("fm_jax", cfg),
                k("sglang_torch", cfg),
                cpu_only,
            ),
            Figure(
                f"fm_jax debug vs debug off, {r}", k("fm_jax", cfg, True), k("fm_jax", cfg), 1.5
            ),
        ]
    for cfg, fused, cls in ((small, 0.2, 0.5), (large, 0.05, 0.1)):  # the real peers
        r = f"R={cfg.pool}"
        out += [
            Figure(
                f"fm_jax fused (marginal) vs sglang_jax step, {r}",
                k("fm_jax_fused", cfg),
                k("sglang_jax", cfg),
                fused,
            ),
            Figure(
                f"fm_jax class, jax inputs vs sglang_jax step, {r}",
                k("fm_jax", cfg),
                k("sglang_jax", cfg),
                cls,
            ),
            Figure(
                f"fm_jax class, numpy inputs vs sglang_jax step, {r}",
                k("fm_jax_host", cfg),
                k("sglang_jax", cfg),
                cls,
            ),
            Figure(
                f"fm_jax class, numpy inputs vs sglang_torch step, {r}",
                k("fm_jax_host", cfg),
                k("sglang_torch", cfg),
                None,
            ),
        ]
    for cfg in (ss, sl):
        out.append(
            Figure(
                f"fm_jax spec step vs sglang_torch spec step (H={cfg.hidden}), R={cfg.pool}",
                k("fm_jax", cfg),
                k("sglang_torch", cfg),
                None,
            )
        )
    out += [
        Figure(
            f"fm_jax step, R={large.pool} vs R={small.pool} (flat in R)",
            k("fm_jax", large),
            k("fm_jax", small),
            1.3,
            waited=True,
        ),
        Figure(
            f"fm_jax debug step, R={large.pool} vs R={small.pool} (flat in R)",
            k("fm_jax", large, True),
            k("fm_jax", small, True),
            1.3,
            waited=True,
        ),
        Figure(
            f"fm_jax spec step (H={sl.hidden}), R={sl.pool} vs R={ss.pool}",
            k("fm_jax", sl),
            k("fm_jax", ss),
            1.3,
            waited=True,
        ),
        *(
            Figure(
                f"fm_jax spec step (H={lg.hidden} f32), R={lg.pool} vs R={sm.pool}",
                k("fm_jax", lg),
                k("fm_jax", sm),
                None,
                waited=True,
            )
            for sm, lg in s32
        ),
        Figure(
            f"naive_jax vs fm_jax at R={large.pool} (speed-up)",
            k("naive_jax", large),
            k("fm_jax", large),
            10.0,
            at_least=True,
            waited=True,
        ),
        Figure(
            f"fm_jax class step, numpy inputs, R={large.pool} vs R={small.pool}",
            k("fm_jax_host", large),
            k("fm_jax_host", small),
            None,
            waited=True,
        ),
        Figure(
            f"fm_jax fused (marginal), R={large.pool} vs R={small.pool}",
            k("fm_jax_fused", large),
            k("fm_jax_fused", small),
            None,
            waited=True,
        ),
        Figure(
            f"sglang_jax step, R={large.pool} vs R={small.pool}",
            k("sglang_jax", large),
            k("sglang_jax", small),
            None,
            waited=True,
        ),
        Figure(
            f"fm_jax debug vs sglang_torch debug (CI mode), R={small.pool}",
            k("fm_jax", small, True),
            k("sglang_torch", small, True),
            None,
        ),
        Figure(
            f"fm_jax class vs fm_torch eager, R={small.pool}",
            k("fm_jax", small),
            k("fm_torch", small),
            None,
        ),
        Figure(
            f"fm_torch eager vs sglang_torch step (the twin's checks), R={small.pool}",
            k("fm_torch", small),
            k("sglang_torch", small),
            None,
        ),
    ]
    # A plan whose small and large sizes coincide (tests) would list a figure twice.
    return list({f.name: f for f in out}.values())
