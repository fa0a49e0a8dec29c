"""Calibrate the forward time, then serve the request set sync vs overlap over host costs.

For each host-cost ratio r the scheduler spends r x t_fwd per batch (t_fwd: the mean step
time of a warm synchronous run with no added host cost). The ideal overlap speedup is
(t_host + t_device) / max(t_host, t_device), with t_host and t_device measured per step from
that ratio's synchronous run (t_host includes the scheduler's own Python work, t_device is
dispatch-to-tokens). Every run's tokens are compared with the first synchronous run's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from bench.serve.config import EngineConfig, ModelConfig
from bench.serve.engine import Engine, ServeResult
from bench.serve.host_cost import HostCost
from bench.serve.requests import Request


@dataclass
class SweepRun:
    """One host-cost ratio: sync and overlap throughput and the ideal speedup."""

    host_cost_ratio: float
    host_cost_ms: float
    sync: ServeResult
    overlap: ServeResult

    @property
    def t_host_ms(self) -> float:
        """Host time per step of the sync run (scheduling, simulated cost, bookkeeping)."""
        return 1e3 * (self.sync.wall_s - self.sync.wait_s) / self.sync.steps

    @property
    def t_device_ms(self) -> float:
        """Device time per step of the sync run, as the host sees it (dispatch to tokens)."""
        return 1e3 * self.sync.wait_s / self.sync.steps

    @property
    def speedup(self) -> float:
        """Overlap tokens/s over sync tokens/s."""
        return self.overlap.tok_s / self.sync.tok_s

    @property
    def ideal_speedup(self) -> float:
        """(t_host + t_device) / max(t_host, t_device) from the sync run's measured split."""
        h, d = self.t_host_ms, self.t_device_ms
        return (h + d) / max(h, d)

    @property
    def ideal_speedup_per_step(self) -> float:
        """The same bound taken step by step: sum(h_i + d_i) / sum(max(h_i, d_i)).

        Tighter than `ideal_speedup` when step times vary (prefill-heavy MIXED steps cost more
        than DECODE steps while the host cost is constant): overlap hides at most the smaller
        of the two in each step.
        """
        h, d = self.sync.host_s, self.sync.step_s
        return (sum(h) + sum(d)) / sum(max(a, b) for a, b in zip(h, d, strict=True))

    def as_json(self) -> dict[str, Any]:
        """The JSON record of this run (schema keys first, then diagnostics)."""
        return {
            "host_cost_ratio": self.host_cost_ratio,
            "sync_tok_s": self.sync.tok_s,
            "overlap_tok_s": self.overlap.tok_s,
            "speedup": self.speedup,
            "ideal_speedup": self.ideal_speedup,
            "fraction_of_ideal": self.speedup / self.ideal_speedup,
            "ideal_speedup_per_step": self.ideal_speedup_per_step,
            "fraction_of_ideal_per_step": self.speedup / self.ideal_speedup_per_step,
            "host_cost_ms": self.host_cost_ms,
            "t_host_ms": self.t_host_ms,
            "t_device_ms": self.t_device_ms,
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
    engine = Engine(model_cfg, engine_cfg, protocol=protocol)
    log("warm-up (compiles every bucket shape the request set reaches): sync")
    ref = engine.run_sync(requests)
    log(f"warm-up: overlap ({protocol} protocol)")
    mismatches = diff_outputs("overlap warm-up", ref, engine.run_overlap(requests))
    debug_equal = None
    if debug_check:
        log("debug: overlap with fm_jax checkify invariants")
        dbg = Engine(model_cfg, engine_cfg, debug=True, protocol=protocol).run_overlap(requests)
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
