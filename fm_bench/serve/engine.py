"""The two serving loops over the same scheduler, model and requests.

- sync: build batch N, run it, wait for its tokens, process them, build N+1.
- overlap: build batch N+1 while the device runs N. The step is a `fm_jax.FutureMap`'s
  engine step: one dispatch, which returns once the step is enqueued; only after
  dispatching N+1 does the host read N's tokens (for outputs and stop conditions), one step
  late. The step resolves the decode rows of N+1 from the relay that N wrote on device:
  their sentinels (sentinel protocol), or their slots (gather protocol).

With debug, the map checks every step on the device and the run calls `FutureMap.check()`
when it ends (a sync per step would undo the overlap), raising InvariantViolation naming
the step and op of every violation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

import fm_jax
from fm_bench.serve import model as mdl
from fm_bench.serve.config import EngineConfig, ModelConfig
from fm_bench.serve.host_cost import HostCost
from fm_bench.serve.requests import Request
from fm_bench.serve.scheduler import ScheduledBatch, Scheduler
from fm_bench.serve.step import make_overlap_step, make_sync_step


@dataclass
class ServeResult:
    """What one serving run produced and how long it took.

    Attributes:
      outputs: rid -> output tokens (EOS included when it stopped the request).
      wall_s: wall time of the serving loop.
      steps: batches dispatched; `modes` counts them by ForwardMode name.
      wait_s: time the host spent blocked on the device (reading tokens).
      step_s: sync only: per-step dispatch-to-tokens time (the device time seen by the host).
      host_s: sync only: per-step host time (building the batch, then processing its tokens).
      dispatch_s: per step, the time inside the step call (until it returns to the host).
    """

    outputs: dict[int, list[int]]
    wall_s: float
    steps: int
    wait_s: float
    modes: dict[str, int] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    host_s: list[float] = field(default_factory=list)
    dispatch_s: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Output tokens produced."""
        return sum(len(v) for v in self.outputs.values())

    @property
    def tok_s(self) -> float:
        """Output tokens per second of wall time."""
        return self.tokens / self.wall_s


class Engine:
    """A model, its jitted steps and FutureMap ops; serves request sets in either mode.

    Args:
      model_cfg: the transformer's shapes and seed.
      engine_cfg: pool size, prefill budget, buckets.
      debug: checkify the overlap step with fm_jax's debug invariants.
      protocol: the overlap step's relay protocol, "sentinel" or "gather" (docs/CONTRACT.md,
        'Two protocols'); both serve the same tokens.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        engine_cfg: EngineConfig,
        *,
        debug: bool = False,
        protocol: str = "sentinel",
    ):
        bad = [
            b for b in engine_cfg.batch_buckets + engine_cfg.token_buckets if b % model_cfg.row_tile
        ]
        if bad:
            raise ValueError(f"buckets {bad} are not multiples of row_tile {model_cfg.row_tile}")
        self.model_cfg = model_cfg
        self.engine_cfg = engine_cfg
        self.debug = debug
        self.protocol = protocol
        self.params = mdl.init_params(model_cfg)
        # One map for every run: a run leaves each slot's last write unread (its request
        # finished), which the next run's first write to that slot replaces.
        self.fm = fm_jax.FutureMap(
            engine_cfg.pool_size,
            debug=debug,
            protocol=protocol,
            batch_buckets=engine_cfg.batch_buckets,
            token_buckets=engine_cfg.token_buckets,
        )
        self._overlap_step = make_overlap_step(model_cfg, self.fm)
        self._sync_step = make_sync_step(model_cfg)

    def _scheduler(
        self, requests: Sequence[Request], overlap: bool, host_cost: HostCost
    ) -> Scheduler:
        vocab = self.model_cfg.vocab
        for r in requests:
            if not r.prompt or r.max_new_tokens < 1:
                raise ValueError(f"request {r.rid}: needs a non-empty prompt and max_new >= 1")
            bad = [t for t in r.prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"request {r.rid}: prompt ids {bad[:5]} outside [0, {vocab})")
        return Scheduler(
            requests,
            self.engine_cfg,
            overlap=overlap,
            host_cost=host_cost,
            max_seq_len=self.model_cfg.max_seq_len,
            eos_id=self.model_cfg.eos_id,
            protocol=self.protocol,
        )

    def _fresh_cache(self) -> mdl.KVCache:
        cache = mdl.init_cache(self.model_cfg, self.engine_cfg.pool_size)
        return jax.block_until_ready(cache)

    def run_sync(
        self, requests: Sequence[Request], host_cost: HostCost | None = None
    ) -> ServeResult:
        """Serve `requests` synchronously: the host waits for each step's tokens."""
        sched = self._scheduler(requests, False, host_cost or HostCost())
        cache = self._fresh_cache()
        steps, wait, modes, step_s, host_s, dispatch_s = 0, 0.0, dict[str, int](), [], [], []
        t0 = time.perf_counter()
        while not sched.idle:
            t_build = time.perf_counter()
            batch = sched.build()
            if batch is None:
                raise RuntimeError("sync scheduler built no batch while requests remain")
            t_launch = time.perf_counter()
            cache, tokens = self._sync_step(self.params, cache, batch.inputs)
            dispatch_s.append(time.perf_counter() - t_launch)
            host_tokens = np.asarray(tokens)  # the sync point
            t_done = time.perf_counter()
            wait += t_done - t_launch
            step_s.append(t_done - t_launch)
            sched.process(batch, host_tokens)
            host_s.append(time.perf_counter() - t_build - step_s[-1])
            steps += 1
            modes[batch.mode.name] = modes.get(batch.mode.name, 0) + 1
        wall = time.perf_counter() - t0
        outputs = {st.req.rid: st.output for st in sched.done}
        return ServeResult(outputs, wall, steps, wait, modes, step_s, host_s, dispatch_s)

    def run_overlap(
        self, requests: Sequence[Request], host_cost: HostCost | None = None
    ) -> ServeResult:
        """Serve `requests` with overlap: build N+1 while N runs, read N's tokens one step late.

        Raises:
          fm_jax.InvariantViolation: debug mode, when a step broke a FutureMap invariant.
        """
        sched = self._scheduler(requests, True, host_cost or HostCost())
        cache = self._fresh_cache()
        gather = self.protocol == "gather"
        steps, wait, modes, dispatch_s = 0, 0.0, dict[str, int](), []
        pending: tuple[ScheduledBatch, jax.Array] | None = None
        t0 = time.perf_counter()
        while True:
            batch = sched.build()  # runs while the device works on `pending`
            launched = None
            if batch is not None:
                fm_batch, model_inputs = batch.relay_batch(gather)
                t_launch = time.perf_counter()
                cache, tokens = self._overlap_step(
                    fm_batch, self.params, cache, inputs=model_inputs
                ).out
                dispatch_s.append(time.perf_counter() - t_launch)
                tokens.copy_to_host_async()
                steps += 1
                modes[batch.mode.name] = modes.get(batch.mode.name, 0) + 1
                launched = (batch, tokens)
            if pending is not None:
                prev, prev_tokens = pending
                t_wait = time.perf_counter()
                host_tokens = np.asarray(prev_tokens)  # blocks on step N only, N+1 is queued
                wait += time.perf_counter() - t_wait
                sched.process(prev, host_tokens)
            elif batch is None:  # nothing in flight and nothing to build
                if not sched.idle:
                    raise RuntimeError("overlap scheduler stalled with requests remaining")
                break
            pending = launched
        wall = time.perf_counter() - t0
        self.fm.check()  # debug: every violation of the run, by step and op
        outputs = {st.req.rid: st.output for st in sched.done}
        return ServeResult(outputs, wall, steps, wait, modes, dispatch_s=dispatch_s)
