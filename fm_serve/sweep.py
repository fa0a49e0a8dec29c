"""Calibrate the forward time, then serve the request set sync vs overlap over host costs.

For each host-cost ratio r the scheduler spends r x t_fwd per batch (t_fwd: the mean step
time of a warm synchronous run with no added host cost). The ideal overlap speedup counts
the dispatch as host time: (H + S) / max(H + D, S), with H (host time per step, the
scheduler's own Python work included) and S (the step, dispatch to tokens) from that
ratio's synchronous run and D (time inside the step call) from its overlap run; it falls
below 1 where the overlap step's dispatch outlasts the sync step (tiny steps). Every
run's tokens are compared with the first synchronous run's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from fm_serve.config import EngineConfig, ModelConfig
from fm_serve.engine import Engine, ServeResult
from fm_serve.host_cost import HostCost
from fm_serve.model import toy
from fm_serve.requests import Request


@dataclass
class SweepRun:
    """One host-cost ratio: sync and overlap throughput and the ideal speedup."""

    host_cost_ratio: float
    host_cost_ms: float
    sync: ServeResult
    overlap: ServeResult

    @property
    def t_host_ms(self) -> float:
        """H: host time per step of the sync run (scheduling, simulated cost, bookkeeping)."""
        return 1e3 * (self.sync.wall_s - self.sync.wait_s) / self.sync.steps

    @property
    def t_step_ms(self) -> float:
        """S: the sync run's step, dispatch to tokens (the forward as the host sees it)."""
        return 1e3 * self.sync.wait_s / self.sync.steps

    @property
    def t_dispatch_ms(self) -> float:
        """D: the overlap run's mean time inside the step call. The host is busy for it (the
        map's checks and packing, tracing nothing, enqueueing the kernels): overlap can hide
        only the rest of the step behind the host's work."""
        d = self.overlap.dispatch_s
        return 1e3 * sum(d) / len(d)

    @property
    def speedup(self) -> float:
        """Overlap tokens/s over sync tokens/s."""
        return self.overlap.tok_s / self.sync.tok_s

    @property
    def ideal_speedup(self) -> float:
        """The bound that counts the dispatch as host time: (H + S) / max(H + D, S).

        A sync step costs H + S; an overlap step at best the larger of the host's work per
        step (its own H plus the dispatch D) and the step S.
        """
        h, s, d = self.t_host_ms, self.t_step_ms, self.t_dispatch_ms
        return (h + s) / max(h + d, s)

    @property
    def ideal_speedup_dispatch_free(self) -> float:
        """(H + S) / max(H, S): the bound if dispatch cost the host nothing (above the
        achievable bound whenever D > 0; kept to show what dispatch costs)."""
        h, s = self.t_host_ms, self.t_step_ms
        return (h + s) / max(h, s)

    @property
    def ideal_speedup_per_step(self) -> float:
        """The same bound taken step by step: sum(h_i + s_i) / sum(max(h_i + D, s_i)).

        Tighter than `ideal_speedup` when step times vary (prefill-heavy MIXED steps cost more
        than DECODE steps while the host cost is constant): overlap hides at most the smaller
        of the two in each step.
        """
        h, s, d = self.sync.host_s, self.sync.step_s, self.t_dispatch_ms / 1e3
        return (sum(h) + sum(s)) / sum(max(a + d, b) for a, b in zip(h, s, strict=True))

    def as_json(self) -> dict[str, Any]:
        """The JSON record of this run (schema keys first, then diagnostics)."""
        return {
            "host_cost_ratio": self.host_cost_ratio,
            "sync_tok_s": self.sync.tok_s,
            "overlap_tok_s": self.overlap.tok_s,
            "speedup": self.speedup,
            "ideal_speedup": self.ideal_speedup,
            "fraction_of_ideal": self.speedup / self.ideal_speedup,
            "t_dispatch_ms": self.t_dispatch_ms,
            "t_step_ms": self.t_step_ms,
            "t_host_ms": self.t_host_ms,
            "ideal_speedup_per_step": self.ideal_speedup_per_step,
            "fraction_of_ideal_per_step": self.speedup / self.ideal_speedup_per_step,
            "ideal_speedup_dispatch_free": self.ideal_speedup_dispatch_free,
            "host_cost_ms": self.host_cost_ms,
            "sync_dispatch_ms": 1e3 * sum(self.sync.dispatch_s) / len(self.sync.dispatch_s),
            "sync_steps": self.sync.steps,
            "overlap_steps": self.overlap.steps,
            "overlap_wait_ms_per_step": 1e3 * self.overlap.wait_s / self.overlap.steps,
        }


@dataclass
class SweepResult:
    """The whole demo: settings, correctness and the runs."""

    device: str
    requests: int
    output_tokens: int
    tokens_equal: bool
    debug_tokens_equal: bool | None
    t_fwd_ms: float
    host_cost_kind: str
    repeats: int
    runs: list[SweepRun]
    model: ModelConfig
    engine: EngineConfig
    mismatches: list[str]
    eos_stops: int = 0
    xla_cpu_threads: str = "all"
    protocol: str = "sentinel"

    def as_json(self) -> dict[str, Any]:
        """The `--json` document (schema keys first, then settings and diagnostics)."""
        return {
            "device": self.device,
            "requests": self.requests,
            "tokens_equal": self.tokens_equal,
            "runs": [r.as_json() for r in self.runs],
            "debug_tokens_equal": self.debug_tokens_equal,
            "output_tokens": self.output_tokens,
            "eos_stops": self.eos_stops,
            "xla_cpu_threads": self.xla_cpu_threads,
            "protocol": self.protocol,
            "t_fwd_ms": self.t_fwd_ms,
            "host_cost_kind": self.host_cost_kind,
            "repeats": self.repeats,
            "model": self.model._asdict(),
            "engine": self.engine._asdict(),
            "mismatches": self.mismatches,
        }


def describe_device() -> str:
    """The JAX default device in words, e.g. 'cpu (TFRT_CPU_0), 2 cores'."""
    import os

    d = jax.devices()[0]
    cores = f", {os.cpu_count()} host cores" if d.platform == "cpu" else ""
    return f"{d.platform} ({d.device_kind}){cores}"


def diff_outputs(name: str, ref: ServeResult, got: ServeResult) -> list[str]:
    """Human-readable mismatches between two runs' outputs (empty when token-for-token equal)."""
    out = []
    for rid in sorted(set(ref.outputs) | set(got.outputs)):
        a, b = ref.outputs.get(rid), got.outputs.get(rid)
        if a != b:
            out.append(f"{name}: request {rid}: expected {a}, got {b}")
    return out


def run_sweep(
    requests: Sequence[Request],
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    *,
    ratios: Sequence[float],
    host_cost_kind: str = "spin",
    debug_check: bool = True,
    repeats: int = 1,
    protocol: str = "sentinel",
    log: Callable[[str], None] = lambda _: None,
) -> SweepResult:
    """Warm up, check tokens, calibrate t_fwd and measure sync vs overlap at each ratio.

    Args:
      requests: the request set, served whole by every run.
      model_cfg, engine_cfg: the model and engine.
      ratios: simulated host cost per batch as multiples of t_fwd.
      host_cost_kind: 'spin' or 'sleep' (see host_cost).
      debug_check: also serve once with the checkified (debug) overlap step and compare.
      repeats: runs per mode and ratio, interleaved; the fastest counts (noisy machines).
      protocol: the overlap engine's relay protocol, "sentinel" or "gather".
      log: progress messages.

    Returns:
      SweepResult; `tokens_equal` covers every run (debug one included when run).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    engine = Engine(*toy(model_cfg), engine_cfg, protocol=protocol)
    log("warm-up (compiles every bucket shape the request set reaches): sync")
    ref = engine.run_sync(requests)
    log(f"warm-up: overlap ({protocol} protocol)")
    mismatches = diff_outputs("overlap warm-up", ref, engine.run_overlap(requests))
    debug_equal = None
    if debug_check:
        log("debug: overlap with fm_jax checkify invariants")
        dbg_engine = Engine(*toy(model_cfg), engine_cfg, debug=True, protocol=protocol)
        dbg = dbg_engine.run_overlap(requests)
        debug_mismatch = diff_outputs("overlap debug", ref, dbg)
        debug_equal = not debug_mismatch
        mismatches += debug_mismatch
    log("calibrate t_fwd: warm sync run, no host cost")
    calib = engine.run_sync(requests)
    mismatches += diff_outputs("sync calibration", ref, calib)
    t_fwd = sum(calib.step_s) / len(calib.step_s)
    runs = []
    for r in ratios:
        cost = HostCost(r * t_fwd, host_cost_kind)
        log(f"host cost ratio {r:g} ({1e3 * cost.seconds:.1f} ms per batch)")
        best: dict[str, ServeResult] = {}
        for _ in range(repeats):  # interleaved; the fastest of each mode counts
            for name, run in (("sync", engine.run_sync), ("overlap", engine.run_overlap)):
                got = run(requests, cost)
                mismatches += diff_outputs(f"{name} r={r:g}", ref, got)
                if name not in best or got.wall_s < best[name].wall_s:
                    best[name] = got
        runs.append(SweepRun(r, 1e3 * cost.seconds, best["sync"], best["overlap"]))
    eos = model_cfg.eos_id
    eos_stops = sum(
        1
        for r in requests
        if ref.outputs[r.rid][-1:] == [eos] and len(ref.outputs[r.rid]) < r.max_new_tokens
    )
    return SweepResult(
        device=describe_device(),
        requests=len(requests),
        output_tokens=ref.tokens,
        tokens_equal=not mismatches,
        debug_tokens_equal=debug_equal,
        t_fwd_ms=1e3 * t_fwd,
        host_cost_kind=host_cost_kind,
        repeats=repeats,
        runs=runs,
        model=model_cfg,
        engine=engine_cfg,
        mismatches=mismatches,
        eos_stops=eos_stops,
        protocol=protocol,
    )
