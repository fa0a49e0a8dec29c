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

Sampling features (`sampling.Features`, fixed per engine): the sampler state rides through
both steps donated beside the cache; with logprobs the step's logprob arrays reach the
host with its tokens through the engine step's host ring (`host_out`: copies started as the
step is enqueued, read a step late in overlap, so they add no wait). `abort(rid)` during a
run (from `on_token`, which streams each token as it is read) finishes a request at once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

import fm_jax
from fm_serve.config import EngineConfig
from fm_serve.grammar import GrammarTokenizer, Matchers
from fm_serve.host_cost import HostCost
from fm_serve.requests import Request, RequestState
from fm_serve.sampling import NO_FEATURES, Features, HostRows, init_state
from fm_serve.scheduler import OnToken, ScheduledBatch, Scheduler
from fm_serve.served import ServedModel
from fm_serve.spec import DRAFT_FIELD, Ngram, init_history, make_spec_split, make_spec_step
from fm_serve.step import (
    ModelInputs,
    StepInputs,
    make_overlap_step,
    make_split_step,
    make_sync_step,
)

Progress = Callable[[int], None]
"""Called after each step's tokens are taken, with the number of new output tokens."""


@dataclass
class ServeResult:
    """What one serving run produced and how long it took.

    Attributes:
      outputs: rid -> output tokens (EOS included when it stopped the request).
      wall_s: wall time of the serving loop.
      steps: batches dispatched; `modes` counts them by ForwardMode name.
      wait_s: time the host spent blocked on the device (reading tokens).
      step_s: sync only: per-step dispatch-to-tokens time (the device time seen by the host).
      host_s: per step, the host's time: building the batch and processing its tokens (sync:
        the step excluded; overlap: each loop turn less its wait, the dispatch included).
      dispatch_s: per step, the time inside the step call (until it returns to the host).
      logprobs: rid -> per output token (its logprob, the top ids, their logprobs), for
        requests that asked for logprobs.
      aborted: rids aborted during the run; retractions: requests retracted (KV budget).
      prefill_tokens: prompt (and recomputed) tokens the steps prefilled.
      reasons: rid -> why its grammar finished it ("grammar complete", "grammar dead end").
      drafts_proposed, drafts_accepted: speculative decoding: drafts of the verified rows
        read back, and how many of them the verify accepted; `accepted`: those by rid
        (requests with one at least).
    """

    outputs: dict[int, list[int]]
    wall_s: float
    steps: int
    wait_s: float
    modes: dict[str, int] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    host_s: list[float] = field(default_factory=list)
    dispatch_s: list[float] = field(default_factory=list)
    logprobs: dict[int, list[tuple[float, tuple[int, ...], tuple[float, ...]]]] = field(
        default_factory=dict
    )
    aborted: list[int] = field(default_factory=list)
    retractions: int = 0
    prefill_tokens: int = 0
    reasons: dict[int, str] = field(default_factory=dict)
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    accepted: dict[int, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Output tokens produced."""
        return sum(len(v) for v in self.outputs.values())

    @property
    def acceptance(self) -> float:
        """Speculative decoding: the fraction of the drafts read back that were accepted."""
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0

    def tokens_per_verify(self, draft_tokens: int) -> float:
        """Speculative decoding: output tokens per verified decode row (1 to K + 1)."""
        rows = self.drafts_proposed / draft_tokens if draft_tokens else 0
        return 1.0 + self.drafts_accepted / rows if rows else 0.0

    @property
    def tok_s(self) -> float:
        """Output tokens per second of wall time."""
        return self.tokens / self.wall_s


class Engine:
    """A model, its jitted steps and FutureMap ops; serves request sets in either mode.

    Args:
      model: the served model (`served.ServedModel`: the toy transformer, Gemma 3).
      params: its weights.
      engine_cfg: pool size, prefill budget, buckets.
      debug: checkify the overlap step with fm_jax's debug invariants.
      protocol: the overlap step's relay protocol, "sentinel" or "gather" (docs/CONTRACT.md,
        'Two protocols'); both serve the same tokens.
      features: the sampling features the steps compute (default: none beyond greedy and
        seeded sampling); a request needing one the engine lacks is refused by name.
      decode: token ids -> text, for stop strings.
      grammar: the vocabulary's bytes for structured output (`grammar.gemma_tokenizer`,
        `grammar.toy_tokenizer`), or matchers already built over them: requests with a
        `Grammar` are then served, a batch with a constrained row by the split step
        (`grammar` module; with `speculative`, the split spec step, `spec.make_spec_split`);
        None refuses them.
      speculative: an n-gram drafter (`spec.Ngram`): speculative decoding through a spec
        map of the gather protocol (`protocol` is then ignored), greedy requests only, both
        loops on the relay step (sync waits for each step's tokens before building the
        next); None: one token per decode row.
    """

    def __init__(
        self,
        model: ServedModel,
        params: Any,
        engine_cfg: EngineConfig,
        *,
        debug: bool = False,
        protocol: str = "sentinel",
        features: Features = NO_FEATURES,
        decode: Callable[[Sequence[int]], str] | None = None,
        speculative: Ngram | None = None,
        grammar: GrammarTokenizer | Matchers | None = None,
    ):
        tile = model.row_tile
        bad = [b for b in engine_cfg.batch_buckets + engine_cfg.token_buckets if b % tile]
        if bad:
            raise ValueError(f"buckets {bad} are not multiples of row_tile {tile}")
        self.model = model
        self.engine_cfg = engine_cfg
        self.debug = debug
        self.protocol = protocol
        self.params = params
        self.features = features
        self.decode = decode
        self.speculative = None if speculative is None else speculative.check()
        if self.speculative is not None:
            if features != NO_FEATURES:
                raise ValueError(
                    f"speculative decoding serves greedy requests only; got features {features}"
                )
            protocol = self.protocol = "gather"
        self._sched: Scheduler | None = None
        # One map for every run: a run leaves each slot's last write unread (its request
        # finished), which the next run's first write to that slot replaces.
        spec = self.speculative
        self.fm = fm_jax.FutureMap(
            engine_cfg.pool_size,
            debug=debug,
            protocol=protocol,
            batch_buckets=engine_cfg.batch_buckets,
            token_buckets=engine_cfg.token_buckets,
            spec=None if spec is None else spec.spec_config(),
            needs_cpu_seq_lens=spec is None,  # the spec host never reads lengths
        )
        self._overlap_step = (
            make_overlap_step(model, self.fm, features)
            if spec is None
            else make_spec_step(model, self.fm, spec)
        )
        self._sync_step = make_sync_step(model, features)
        self.matchers = (
            grammar
            if grammar is None or isinstance(grammar, Matchers)
            else Matchers(grammar, model.vocab)
        )
        self._split = None if grammar is None else make_split_step(model, features)
        self._spec_split = None if grammar is None or spec is None else make_spec_split(model, spec)

    def abort(self, rid: int) -> None:
        """Abort request `rid` of the run in progress (call it from `on_token`): it finishes
        now with the tokens streamed so far; none of its tokens in flight is kept.

        Raises:
          KeyError: no run in progress, an unknown rid, or a finished request.
        """
        if self._sched is None:
            raise KeyError(f"abort: no run in progress (request {rid!r})")
        self._sched.abort(rid)

    def _scheduler(
        self,
        requests: Sequence[Request],
        overlap: bool,
        host_cost: HostCost,
        on_token: OnToken | None,
    ) -> Scheduler:
        vocab = self.model.vocab
        for r in requests:
            if not r.prompt or r.max_new_tokens < 1:
                raise ValueError(f"request {r.rid}: needs a non-empty prompt and max_new >= 1")
            bad = [t for t in r.prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"request {r.rid}: prompt ids {bad[:5]} outside [0, {vocab})")
            try:
                r.sampling.check(vocab, r.temperature, r.seed)
            except ValueError as err:
                raise ValueError(f"request {r.rid}: {err}") from None
        self._sched = Scheduler(
            requests,
            self.engine_cfg,
            overlap=overlap,
            host_cost=host_cost,
            max_seq_len=self.model.max_seq_len,
            stop_ids=self.model.stop_ids,
            protocol=self.protocol,
            features=self.features,
            decode=self.decode,
            on_token=on_token,
            draft_tokens=0 if self.speculative is None else self.speculative.draft_tokens,
            matchers=self.matchers,
        )
        return self._sched

    def _state(self) -> Any:
        if self.speculative is not None:
            history = init_history(self.engine_cfg.pool_size, self.model.max_seq_len)
            return jax.block_until_ready(history)
        return jax.block_until_ready(
            init_state(self.features, self.engine_cfg.pool_size, self.model.vocab)
        )

    def _result(
        self, sched: Scheduler, wall: float, steps: int, wait: float, modes: dict[str, int]
    ) -> ServeResult:
        self._sched = None
        done: list[RequestState] = sched.done
        return ServeResult(
            {st.req.rid: st.output for st in done},
            wall,
            steps,
            wait,
            modes,
            logprobs={st.req.rid: st.logprobs for st in done if st.req.sampling.logprobs},
            aborted=sorted(st.req.rid for st in done if st.aborted),
            retractions=sched.retractions,
            reasons={st.req.rid: st.reason for st in done if st.reason},
            drafts_proposed=sched.drafts_proposed,
            drafts_accepted=sched.drafts_accepted,
            accepted={st.req.rid: st.accepted for st in done if st.accepted},
        )

    def _fresh_cache(self) -> Any:
        cache = self.model.init_cache(self.engine_cfg.pool_size)
        return jax.block_until_ready(cache)

    def warm_up(self, overlap: bool) -> None:
        """Compile the steps one mode serves, for every bucket it reaches.

        Overlap: the engine step's `warm_up(guard=True)` (afterwards a call that would
        compile is refused). Sync: one all-padding step per (batch, token) bucket pair;
        padding writes only slot 0, which nothing live reads.
        """
        cache, state = self._fresh_cache(), self._state()
        if overlap or self.speculative is not None:
            self._overlap_step.warm_up(self.params, cache, state, guard=True, traced_modes=False)
            return

        cfg = self.engine_cfg
        for b, t in itertools.product(cfg.batch_buckets, cfg.token_buckets):
            if b > t:
                continue
            rows, toks = np.zeros(b, np.int32), np.zeros(t, np.int32)
            pad = StepInputs(
                forward_mode=np.int32(int(fm_jax.ForwardMode.EXTEND)),
                req_pool_indices=rows,
                input_ids=toks,
                seq_lens=rows,
                extend_lens=rows,
                token_rows=toks,
                token_slots=toks,
                token_offsets=toks,
                last_token=rows,
                relay_slots=toks,
                temperature=np.zeros(b, np.float32),
                sample_seed=rows,
                extra=HostRows(self.features, b).arrays,
            )
            cache, state, _, _ = self._sync_step(self.params, cache, state, pad)
        jax.block_until_ready(cache)

    def run_sync(
        self,
        requests: Sequence[Request],
        host_cost: HostCost | None = None,
        progress: Progress | None = None,
        on_token: OnToken | None = None,
    ) -> ServeResult:
        """Serve `requests` synchronously: the host waits for each step's tokens.

        `on_token(state, token)` streams each output token as it is read (it may call
        `abort`). Speculative: the relay step, each step's tokens read before the next is
        built."""
        if self.speculative is not None:
            return self._run_relay(requests, host_cost, progress, on_token, lag=False)
        sched = self._scheduler(requests, False, host_cost or HostCost(), on_token)
        cache, state = self._fresh_cache(), self._state()
        steps, wait, modes, step_s, host_s, dispatch_s = 0, 0.0, dict[str, int](), [], [], []
        prefill = 0
        t0 = time.perf_counter()
        while not sched.idle:
            t_build = time.perf_counter()
            batch = sched.build()
            if batch is None:
                raise RuntimeError("sync scheduler built no batch while requests remain")
            t_launch = time.perf_counter()
            if self._split is not None and sched.constrained(batch):
                inp = batch.inputs
                masks = sched.masks(batch, inp.req_pool_indices.shape[0])
                cache, state, logits, raw = self._split.forward(
                    self.params, cache, state, inp, inp.input_ids, inp.seq_lens
                )
                tokens, lp, _ = self._split.sample(inp, logits, raw, inp.seq_lens, masks)
            else:
                cache, state, tokens, lp = self._sync_step(self.params, cache, state, batch.inputs)
            dispatch_s.append(time.perf_counter() - t_launch)
            host_tokens = np.asarray(tokens)  # the sync point
            host_lp = None if lp is None else jax.tree.map(np.asarray, lp)
            t_done = time.perf_counter()
            wait += t_done - t_launch
            step_s.append(t_done - t_launch)
            prefill += batch.prefill_tokens
            made = sched.process(batch, host_tokens, host_lp)
            if progress is not None:
                progress(made)
            host_s.append(time.perf_counter() - t_build - step_s[-1])
            steps += 1
            modes[batch.mode.name] = modes.get(batch.mode.name, 0) + 1
        wall = time.perf_counter() - t0
        res = self._result(sched, wall, steps, wait, modes)
        res.step_s, res.host_s, res.dispatch_s = step_s, host_s, dispatch_s
        res.prefill_tokens = prefill
        return res

    def run_overlap(
        self,
        requests: Sequence[Request],
        host_cost: HostCost | None = None,
        progress: Progress | None = None,
        on_token: OnToken | None = None,
    ) -> ServeResult:
        """Serve `requests` with overlap: build N+1 while N runs, read N's tokens one step late.

        `on_token(state, token)` streams each output token as it is read (it may call
        `abort`).

        Raises:
          fm_jax.InvariantViolation: debug mode, when a step broke a FutureMap invariant.
        """
        return self._run_relay(requests, host_cost, progress, on_token, lag=True)

    def _split_head(
        self, fm_batch: fm_jax.Batch, model_inputs: dict[str, np.ndarray], cache: Any, state: Any
    ) -> tuple[Any, Any, tuple[Any, ...]]:
        """The split step's head: the map's resolve, then the forward (two dispatches);
        returns (cache, state, what the tail needs)."""
        res = self.fm.resolve(fm_batch)
        rows, toks = res.seq_lens.shape[0], res.input_ids.shape[0]
        if self._spec_split is not None:
            slots = _pad(np.asarray(fm_batch.req_pool_indices, np.int32), rows)
            fed = {
                k: _pad(v, toks if k.startswith("token_") else rows)
                for k, v in model_inputs.items()
            }
            decode = fm_batch.forward_mode == fm_jax.ForwardMode.DECODE and res.draft is not None
            relay = fm_batch.token_slots
            relay = None if relay is None else _pad(np.asarray(relay, np.int32), toks)
            cache, state, logits, lens = self._spec_split.forward(
                self.params,
                cache,
                state,
                fed,
                res.input_ids,
                res.seq_lens,
                res.draft,
                relay,
                decode=decode,
            )
            return cache, state, (res, slots, logits, lens, decode)
        assert self._split is not None
        inp = _padded_inputs(self.features, fm_batch.req_pool_indices, model_inputs, rows, toks)
        cache, state, logits, raw = self._split.forward(
            self.params, cache, state, inp, res.input_ids, res.seq_lens
        )
        return cache, state, (res, inp, logits, raw)

    def _split_tail(
        self,
        sched: Scheduler,
        batch: ScheduledBatch,
        fm_batch: fm_jax.Batch,
        state: Any,
        head: tuple[Any, ...],
    ) -> tuple[Any, jax.Array, Any]:
        """The split step's tail: the masks from the matchers as they stand, the sampling
        (speculative: the masked verification) with them, and the map's publish and stash
        (`finish`); returns (state, tokens, logprobs or, speculative, (drafts,))."""
        if self._spec_split is not None:
            res, slots, logits, lens, decode = head
            masks = sched.masks(batch, res.seq_lens.shape[0])
            state, tokens, new_lens, bonus, drafts = self._spec_split.accept(
                logits, masks, slots, lens, res.draft, state, decode=decode
            )
            payload = fm_jax.DraftPayload(bonus_tokens=bonus, extras={DRAFT_FIELD: drafts})
            self.fm.finish(fm_batch, slots, new_lens, payload)
            return state, tokens, (drafts,)
        assert self._split is not None
        res, inp, logits, raw = head
        masks = sched.masks(batch, res.seq_lens.shape[0])
        tokens, lp, new_lens = self._split.sample(inp, logits, raw, res.seq_lens, masks)
        self.fm.finish(fm_batch, inp.req_pool_indices, new_lens, tokens)
        return state, tokens, lp

    def _run_relay(
        self,
        requests: Sequence[Request],
        host_cost: HostCost | None,
        progress: Progress | None,
        on_token: OnToken | None,
        *,
        lag: bool,
    ) -> ServeResult:
        """The loop over the relay step; `lag`: read step N's tokens after dispatching N+1
        (overlap), else right after dispatching N (sync, speculative only)."""
        sched = self._scheduler(requests, lag, host_cost or HostCost(), on_token)
        cache, state = self._fresh_cache(), self._state()
        while self._overlap_step.read_host(wait=True) is not None:
            pass  # a run cut short left steps unread
        gather = self.protocol == "gather"
        steps, wait, modes, dispatch_s, host_s = 0, 0.0, dict[str, int](), [], []
        prefill = 0
        pending: tuple[ScheduledBatch, Any, Any] | None = None

        def take(launched: tuple[ScheduledBatch, Any, Any]) -> float:
            """Read a launched step's tokens and hand them to the scheduler; the wait."""
            nonlocal wait
            prev, prev_tokens, prev_lp = launched
            t_wait = time.perf_counter()
            if prev_tokens is None:  # an engine step: its copies are in the step's host ring
                got = self._overlap_step.read_host(wait=True)  # blocks on that step only
                assert got is not None
                host_tokens, host_lp = got.out
            else:  # a split step's tail, outside the engine step
                host_tokens = np.asarray(prev_tokens)
                host_lp = None if prev_lp is None else tuple(np.asarray(a) for a in prev_lp)
            waited = time.perf_counter() - t_wait
            wait += waited
            made = sched.process(prev, host_tokens, host_lp)
            if progress is not None:
                progress(made)
            return waited

        t0 = time.perf_counter()
        while True:
            t_turn, waited = time.perf_counter(), 0.0
            batch = sched.build()  # runs while the device works on `pending`
            launched = split = None
            if batch is not None:
                if self.speculative is not None:
                    fm_batch, model_inputs = batch.spec_batch()
                else:
                    fm_batch, model_inputs = batch.relay_batch(gather)
                t_launch = time.perf_counter()
                if self.matchers is not None and sched.constrained(batch):
                    # The head: resolve and the forward; the sampling waits for the masks.
                    cache, state, split = self._split_head(fm_batch, model_inputs, cache, state)
                else:
                    cache, state, _, _ = self._overlap_step(
                        fm_batch, self.params, cache, state, inputs=model_inputs
                    ).out
                    launched = (batch, None, None)  # read from the step's host ring
                dispatch_s.append(time.perf_counter() - t_launch)
                steps += 1
                prefill += batch.prefill_tokens
                modes[batch.mode.name] = modes.get(batch.mode.name, 0) + 1
            if not lag and launched is not None:  # sync: read this very step now
                pending, launched = launched, None
            if pending is not None:  # overlap: step N, while N+1 is queued
                waited = take(pending)
            elif batch is None:  # nothing in flight and nothing to build
                if not sched.idle:
                    raise RuntimeError("overlap scheduler stalled with requests remaining")
                break
            if split is not None:  # the tail, once step N's tokens advanced the grammars
                assert batch is not None
                state, tokens, lp = self._split_tail(sched, batch, fm_batch, state, split)
                launched = _copying(batch, tokens, lp)
                if not lag:  # sync: read this very step now
                    waited += take(launched)
                    launched = None
            host_s.append(time.perf_counter() - t_turn - waited)
            pending = launched
        wall = time.perf_counter() - t0
        self._sched = None
        self.fm.check()  # debug: every violation of the run, by step and op
        res = self._result(sched, wall, steps, wait, modes)
        res.host_s, res.dispatch_s, res.prefill_tokens = host_s, dispatch_s, prefill
        return res


def _copying(batch: ScheduledBatch, tokens: jax.Array, lp: Any) -> tuple[Any, ...]:
    """A launched step, its tokens (and logprobs) already copying to the host."""
    tokens.copy_to_host_async()
    if lp is not None:
        for a in lp:
            a.copy_to_host_async()
    return (batch, tokens, lp)


def _pad(a: Any, n: int) -> Any:
    """`a` with zero rows up to `n` leading entries."""
    a = np.asarray(a)
    out = np.zeros((n, *a.shape[1:]), a.dtype)
    out[: len(a)] = a
    return out


def _padded_inputs(
    features: Features, slots: Any, model: dict[str, np.ndarray], rows: int, toks: int
) -> ModelInputs:
    """The model's inputs of a batch's real rows and tokens, padded to the map's resolved
    shapes (`rows`, `toks`) as the engine step pads them (padding: slot 0, zeros, the
    features' neutral rows)."""

    pad = _pad
    extra: dict[str, Any] = HostRows(features, rows).arrays
    for name, arr in extra.items():
        arr[: len(model[name])] = model[name]
    return ModelInputs(
        req_pool_indices=pad(np.asarray(slots, np.int32), rows),
        extend_lens=pad(model["extend_lens"], rows),
        last_token=pad(model["last_token"], rows),
        token_rows=pad(model["token_rows"], toks),
        token_slots=pad(model["token_slots"], toks),
        token_offsets=pad(model["token_offsets"], toks),
        temperature=pad(model["temperature"], rows),
        sample_seed=pad(model["sample_seed"], rows),
        extra=extra,
    )
