"""The headline figures of issue 5: ratios of medians from one interleaved group."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from bench.plan import Headline
from bench.report import COLUMNS
from bench.run import Key, build_series
from bench.timing import Series, Stats
from bench.workload import Config

_VARIANTS = COLUMNS  # every implementation, debug off and on where it has one
_SPEC_VARIANTS = (("fm_jax", False), ("fm_jax", True), ("fm_torch", False), ("floor", False))


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
            impl = k.impl.removesuffix("/baseline")
            if isinstance(k, Key) and k.op == "step" and (impl, k.debug) in want:
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

    def evaluate(self, stats: dict[Hashable, Stats]) -> dict[str, Any]:
        n, d = stats[self.num].median_us, stats[self.den].median_us
        # A marginal cost can come out <= 0 (indistinguishable from nothing): no ratio then.
        ratio = n / d if d > 0 else None
        ok = None
        if self.target is not None and ratio is not None:
            ok = ratio >= self.target if self.at_least else ratio <= self.target
        return {
            "figure": self.name,
            "numerator": _describe(self.num),
            "denominator": _describe(self.den),
            "numerator_us": round(n, 2),
            "denominator_us": round(d, 2),
            "ratio": None if ratio is None else round(ratio, 3),
            "target": None
            if self.target is None
            else (">= " if self.at_least else "<= ") + f"{self.target:g}",
            "pass": ok,
        }


def _describe(k: Key) -> str:
    c = k.cfg
    s = f"{k.impl}{' debug' if k.debug else ''} step B={c.batch} R={c.pool}"
    return s + (f" spec H={c.hidden}" if c.spec else "")


def figures(h: Headline) -> list[Figure]:
    """The issue's figures (targets) and a few reported-only companions."""
    c = h.configs()
    small, large, ss, sl = c["small"], c["large"], c["spec_small"], c["spec_large"]
    s32 = [] if "spec32_small" not in c else [(c["spec32_small"], c["spec32_large"])]

    def k(impl: str, cfg: Any, debug: bool = False) -> Key:
        return Key(impl, debug, "step", cfg)

    return [
        Figure(
            "fm_jax class vs fm_torch eager (debug off)",
            k("fm_jax", small),
            k("fm_torch", small),
            1.0,
        ),
        Figure(
            "fm_jax fused (marginal) vs fm_torch eager",
            k("fm_jax_fused", small),
            k("fm_torch", small),
            0.5,
        ),
        Figure(
            f"fm_jax step, R={large.pool} vs R={small.pool}",
            k("fm_jax", large),
            k("fm_jax", small),
            1.3,
        ),
        Figure(
            f"fm_jax spec step (H={sl.hidden}), R={sl.pool} vs R={ss.pool}",
            k("fm_jax", sl),
            k("fm_jax", ss),
            1.3,
        ),
        *(
            Figure(
                f"fm_jax spec step (H={lg.hidden} f32), R={lg.pool} vs R={sm.pool}",
                k("fm_jax", lg),
                k("fm_jax", sm),
                None,
            )
            for sm, lg in s32
        ),
        Figure(
            f"naive_jax vs fm_jax at R={large.pool} (speed-up)",
            k("naive_jax", large),
            k("fm_jax", large),
            10.0,
            at_least=True,
        ),
        Figure(
            f"fm_jax debug vs debug off, R={small.pool}",
            k("fm_jax", small, True),
            k("fm_jax", small),
            2.0,
        ),
        Figure(
            f"fm_jax debug vs debug off, R={large.pool}",
            k("fm_jax", large, True),
            k("fm_jax", large),
            2.0,
        ),
        Figure(
            f"fm_jax debug step, R={large.pool} vs R={small.pool} (flat in R)",
            k("fm_jax", large, True),
            k("fm_jax", small, True),
            1.3,
        ),
        Figure("fm_jax class vs floor (aim)", k("fm_jax", small), k("floor", small), 3.0),
        Figure(
            "fm_jax fused debug (marginal) vs fm_torch eager debug",
            k("fm_jax_fused", small, True),
            k("fm_torch", small, True),
            None,
        ),
        Figure(
            "fm_jax debug vs fm_torch eager debug",
            k("fm_jax", small, True),
            k("fm_torch", small, True),
            None,
        ),
        Figure(
            f"fm_jax fused (marginal), R={large.pool} vs R={small.pool}",
            k("fm_jax_fused", large),
            k("fm_jax_fused", small),
            None,
        ),
        Figure(
            f"fm_jax spec vs fm_torch spec, R={ss.pool}", k("fm_jax", ss), k("fm_torch", ss), None
        ),
    ]
