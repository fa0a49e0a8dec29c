"""Continuous batching on the host: admission, chunked prefill, decode, MIXED, retirement.

The scheduler never reads device values. In overlap mode a decode row's input id is not
known on the host. Sentinel protocol: the id is the sentinel `-slot` (and, in a DECODE
batch, so is its length): what fm_jax's `invalidate` leaves after the previous step, written
here directly because each batch is built afresh. Gather protocol: the id is 0 (none), the
length is the host's own count, and a MIXED batch names each running row's slot at its token
position (`relay_slots`), where resolve gathers its id. In sync mode the same rows carry the
real last token, which the host read back.

Row order: prefill rows first, then running decode rows (a MIXED batch, SPEC 'Batch kinds').
Batches are padded to a batch bucket and a token bucket; padding carries slot 0.

KV budget (`EngineConfig.kv_budget`): the KV positions every running request holds after
the next step may not pass it. When they would, the newest running request is retracted:
its slot freed at once, it goes back to the front of the queue, and it is resumed by
prefilling its prompt and the outputs read so far (recomputed), once every token of its
dispatched steps has been read (overlap: a step later). A retracted or aborted request's
row in a step already dispatched still runs on the device; nothing reads it back: its slot's
next request starts with a fresh prefill (`sampling`: fresh state). Speculative decoding
(`draft_tokens`): a running request counts its published length bounded from above (what
the host has read, plus K + 1 per step in flight), plus the K positions its next verify
feeds past it; it resumes once no step that samples for it is in flight.

Streaming and abort: `process` hands each output token to `on_token` as it is read; `abort`
finishes a request at once, so no token after it is streamed or kept.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import fm_jax
from fm_serve.config import EngineConfig
from fm_serve.grammar import DEAD_END, Matchers
from fm_serve.host_cost import HostCost
from fm_serve.requests import Request, RequestState
from fm_serve.sampling import NO_FEATURES, Features, HostRows, Sampling
from fm_serve.step import StepInputs

OnToken = Callable[[RequestState, int], None]
"""Called with a request's state and its new token, as each output token is read."""


@dataclass
class Row:
    """One batch row: its request, and whether this step samples an output token for it.

    `dead_at`: a constrained speculative row whose grammar allows no token after its
    first `dead_at` drafts (set with its masks): an output reaching that position ends
    the request ("grammar dead end") before the token there is taken.
    """

    state: RequestState
    samples: bool
    dead_at: int | None = None


@dataclass
class ScheduledBatch:
    """A built batch: the padded step inputs and the rows they stand for (rows[i] is row i).

    `n_tokens` of the padded `inputs.input_ids` are real (the rest is padding).
    """

    inputs: StepInputs
    rows: list[Row]
    mode: fm_jax.ForwardMode
    n_tokens: int = 0
    prefill_tokens: int = 0

    def spec_batch(self) -> tuple[fm_jax.Batch, dict[str, np.ndarray]]:
        """The batch as a speculative step takes it (`spec.make_spec_step`): a DECODE
        batch gathers its drafts, lengths and bonus tokens at its slots (`draft_indices`)
        and brings zeros for its K + 1 ids per row; an EXTEND batch its prompt ids; a
        MIXED batch its prefill ids and, last, a token per running row gathered at its
        slot (`token_slots`: the bonus token, its length bound by resolve)."""
        from fm_serve.spec import spec_inputs

        inp, b, t = self.inputs, len(self.rows), self.n_tokens
        slots = inp.req_pool_indices[:b]
        decode = self.mode == fm_jax.ForwardMode.DECODE
        batch = fm_jax.Batch(
            self.mode,
            slots,
            inp.input_ids[:t],
            inp.seq_lens[:b],
            draft_indices=slots if decode else None,
            token_slots=inp.relay_slots[:t] if self.mode == fm_jax.ForwardMode.MIXED else None,
        )
        return batch, spec_inputs(inp, b, t)

    def relay_batch(self, gather: bool) -> tuple[fm_jax.Batch, dict[str, np.ndarray]]:
        """The batch as a FutureMap's engine step takes it, with the model's own inputs:
        real rows and tokens only (the map pads them to its buckets), the mode on the host.

        Gather protocol: a DECODE batch brings no ids (T = B: its token arrays are one per
        row), a MIXED batch its token slots; sentinel protocol: the ids and lengths as built.
        """
        inp, b, t = self.inputs, len(self.rows), self.n_tokens
        mode = self.mode
        decode_gather = gather and mode == fm_jax.ForwardMode.DECODE
        batch = fm_jax.Batch(
            mode,
            inp.req_pool_indices[:b],
            None if decode_gather else inp.input_ids[:t],
            inp.seq_lens[:b],
            token_slots=inp.relay_slots[:t]
            if gather and mode == fm_jax.ForwardMode.MIXED
            else None,
        )
        model = {
            "extend_lens": inp.extend_lens[:b],
            "last_token": inp.last_token[:b],
            "token_rows": inp.token_rows[:t],
            "token_slots": inp.token_slots[:t],
            "token_offsets": inp.token_offsets[:t],
            "temperature": inp.temperature[:b],
            "sample_seed": inp.sample_seed[:b],
            **{k: v[:b] for k, v in inp.extra.items()},
        }
        return batch, model


def _bucket(n: int, buckets: tuple[int, ...], what: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} of {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class Scheduler:
    """Request queue, pool slots and batch building for one serving run.

    Args:
      requests: served in order of arrival (all queued at start).
      cfg: engine limits and buckets.
      overlap: decode rows carry no real id (the relay fills it) instead of the last token.
      protocol: overlap only: "sentinel" (`-slot` ids and DECODE lengths) or "gather" (no
        ids, host lengths, relay slots in MIXED batches).
      host_cost: simulated scheduling cost spent per built batch.
      max_seq_len: the model's KV positions per slot; a request that cannot fit is refused.
      stop_ids: the tokens that stop a request (read back one step late in overlap mode).
      features: the step's sampling features (their rows are filled per batch).
      decode: token ids -> text, for stop strings (None: a request with one is refused).
      on_token: streaming: called with each output token as it is read.
      draft_tokens: K > 0: speculative decoding (`spec`): a decode row feeds K + 1 tokens
        (its bonus token and K drafts, all resolved on the device), yields 1 to K + 1
        outputs ([B, K + 1] tokens, -1 past a row's outputs); in a MIXED batch a running
        row feeds its bonus token alone and yields one output.
        Greedy requests without sampling features only. With a KV budget a verify row
        counts an upper bound (the host does not know how many tokens a step accepts
        until it reads them; `_need`), and a request must fit it with K more positions.
      matchers: compiles the requests' grammars (`grammar.Matchers`); None refuses a
        request with a grammar.
    """

    def __init__(
        self,
        requests: Sequence[Request],
        cfg: EngineConfig,
        *,
        overlap: bool,
        host_cost: HostCost,
        max_seq_len: int,
        stop_ids: Collection[int],
        protocol: str = "sentinel",
        features: Features = NO_FEATURES,
        decode: Callable[[Sequence[int]], str] | None = None,
        on_token: OnToken | None = None,
        draft_tokens: int = 0,
        matchers: Matchers | None = None,
    ) -> None:
        if protocol not in ("sentinel", "gather"):
            raise ValueError(f"protocol must be 'sentinel' or 'gather', got {protocol!r}")
        if max(cfg.batch_buckets) < cfg.max_running:
            raise ValueError(
                f"largest batch bucket {max(cfg.batch_buckets)} < max_running {cfg.max_running}"
            )
        if max(cfg.token_buckets) < cfg.prefill_budget + cfg.max_running:
            raise ValueError("largest token bucket must hold prefill_budget + max_running tokens")
        if draft_tokens and max(cfg.token_buckets) < cfg.max_running * (draft_tokens + 1):
            raise ValueError(
                f"speculative decoding: the largest token bucket {max(cfg.token_buckets)} "
                f"must hold max_running x (K + 1) = {cfg.max_running * (draft_tokens + 1)} "
                "tokens"
            )
        budget = cfg.kv_budget
        for r in requests:
            if len(r.prompt) + r.max_new_tokens > max_seq_len:
                raise ValueError(
                    f"request {r.rid}: prompt {len(r.prompt)} + max_new {r.max_new_tokens} "
                    f"exceeds max_seq_len {max_seq_len}"
                )
            if budget is not None and len(r.prompt) + r.max_new_tokens + draft_tokens > budget:
                spec = f" + K {draft_tokens}" if draft_tokens else ""
                raise ValueError(
                    f"request {r.rid}: prompt {len(r.prompt)} + max_new {r.max_new_tokens}"
                    f"{spec} exceeds the KV budget {budget}"
                )
            if draft_tokens and (r.temperature != 0.0 or r.sampling != Sampling()):
                raise ValueError(
                    f"request {r.rid}: speculative decoding serves greedy requests "
                    "(temperature 0) without sampling settings"
                )
            if r.grammar is not None and matchers is None:
                raise ValueError(
                    f"request {r.rid}: has a grammar, but the engine was built without a "
                    "grammar tokenizer"
                )
            lacking = features.serves(r.sampling)
            if lacking is not None:
                raise ValueError(f"request {r.rid}: the engine was built without {lacking}")
            if r.sampling.stop and decode is None:
                raise ValueError(f"request {r.rid}: stop strings need the engine's decode")
        if len({r.rid for r in requests}) != len(requests):
            raise ValueError("request ids must be distinct")
        self.features = features
        self.draft_tokens = draft_tokens
        self.drafts_proposed = 0  # K per spec decode row taken
        self.drafts_accepted = 0  # of those, the drafts the verify accepted
        self.decode = decode
        self.on_token = on_token
        self.retractions = 0
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.overlap = overlap
        self.gather = overlap and protocol == "gather"
        self.host_cost = host_cost
        self.stop_ids = frozenset(stop_ids)
        self.queue = collections.deque(RequestState(r) for r in requests)
        for st in self.queue:  # every grammar compiled before anything is served
            if st.req.grammar is not None:
                assert matchers is not None
                try:
                    st.matcher = matchers.compile(st.req.grammar)
                except ValueError as err:
                    raise ValueError(f"request {st.req.rid}: {err}") from None
        self.matchers = matchers
        self.by_rid = {st.req.rid: st for st in self.queue}
        self.running: list[RequestState] = []  # admission order
        self.free_slots = list(range(cfg.pool_size - 1, 0, -1))  # pop() gives the lowest
        self.done: list[RequestState] = []

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        return not self.queue and not self.running

    # ---------------------------------------------------------------------------- building
    def _need(self) -> int:
        """KV positions the running requests will hold after the next step."""
        chunks, need = self.cfg.prefill_budget, 0
        k = self.draft_tokens
        for st in self.running:
            if st.prefill_done and k:
                # A verify feeds K + 1 tokens from the published length L - 1, and each
                # step in flight may publish K + 1 more than the host has read.
                published = len(st.req.prompt) + len(st.output) + (k + 1) * st.pending_steps
                need += min(published + k, self.max_seq_len)
            elif st.prefill_done:
                need += st.seq_len_cpu if st.wants_decode else st.seq_len_cpu - 1
            else:
                chunk = min(len(st.prefix) - st.prefilled, chunks)
                chunks -= chunk
                need += st.prefilled + chunk
        return need

    def _admit(self) -> None:
        budget = self.cfg.kv_budget
        while self.queue and self.free_slots:
            st = self.queue[0]
            if st.in_flight or st.pending_steps:  # retracted, a step in flight: wait for it
                break
            st.prefix = st.req.prompt + tuple(st.output)
            st.prefilled = 0
            self.running.append(st)
            if budget is not None and len(self.running) > 1 and self._need() > budget:
                self.running.pop()  # it would be retracted at once: leave it queued
                break
            self.queue.popleft()
            st.slot = self.free_slots.pop()

    def _free(self, st: RequestState) -> None:
        self.free_slots.append(st.slot)
        self.free_slots.sort(reverse=True)
        st.slot = 0

    def _retract_over_budget(self) -> None:
        """Retract the newest running requests until the next step fits the KV budget."""
        budget = self.cfg.kv_budget
        if budget is None:
            return
        while len(self.running) > 1 and self._need() > budget:
            st = self.running.pop()
            self._free(st)
            st.retractions += 1
            self.retractions += 1
            self.queue.appendleft(st)

    def abort(self, rid: int) -> None:
        """Finish request `rid` now: nothing it has in flight is read back or streamed.

        Raises:
          KeyError: no request `rid` in this run, or it has finished (named in the message).
        """
        st = self.by_rid.get(rid)
        if st is None:
            raise KeyError(f"abort: no request {rid!r} in this run")
        if st.finished:
            raise KeyError(f"abort: request {rid!r} has already finished")
        self._finish(st)
        st.aborted = True

    def _finish(self, st: RequestState) -> None:
        st.finished = True
        if st in self.running:
            self.running.remove(st)
            self._free(st)
        elif st in self.queue:
            self.queue.remove(st)
        self.done.append(st)

    def build(self) -> ScheduledBatch | None:
        """Admit, pick rows, spend the host cost and return the padded batch (None: no row)."""
        self._admit()
        self._retract_over_budget()
        budget = self.cfg.prefill_budget
        prefill: list[tuple[RequestState, int]] = []
        for st in self.running:
            if budget == 0:
                break
            if not st.prefill_done:
                chunk = min(len(st.prefix) - st.prefilled, budget)
                prefill.append((st, chunk))
                budget -= chunk
        decode = [st for st in self.running if st.wants_decode]
        if prefill and not self.cfg.mixed:
            decode = []  # no MIXED batches: a prefill step runs alone, decodes wait
        if not prefill and not decode:
            return None
        self.host_cost()
        if not decode:
            mode = fm_jax.ForwardMode.EXTEND
        elif not prefill:
            mode = fm_jax.ForwardMode.DECODE
        else:
            mode = fm_jax.ForwardMode.MIXED
        return self._assemble(mode, prefill, decode)

    def _assemble(
        self,
        mode: fm_jax.ForwardMode,
        prefill: list[tuple[RequestState, int]],
        decode: list[RequestState],
    ) -> ScheduledBatch:
        """Fill the host arrays and advance each row's host-side counters."""
        n_rows = len(prefill) + len(decode)
        # A verify feeds K + 1 tokens; a MIXED batch's running rows one (their bonus).
        per_decode = self.draft_tokens + 1 if mode == fm_jax.ForwardMode.DECODE else 1
        n_tok = sum(c for _, c in prefill) + len(decode) * per_decode
        b = _bucket(n_rows, self.cfg.batch_buckets, "batch rows")
        t = _bucket(n_tok, self.cfg.token_buckets, "batch tokens")
        slots = np.zeros(b, np.int32)
        seq_lens = np.zeros(b, np.int32)
        ext = np.zeros(b, np.int32)
        last = np.zeros(b, np.int32)
        ids = np.zeros(t, np.int32)
        tok_rows = np.zeros(t, np.int32)
        tok_slots = np.zeros(t, np.int32)
        tok_off = np.zeros(t, np.int32)
        relay = np.zeros(t, np.int32)
        temperature = np.zeros(b, np.float32)
        seed = np.zeros(b, np.int32)
        extra = HostRows(self.features, b)
        rows: list[Row] = []
        pos = 0
        for i, (st, chunk) in enumerate(prefill):
            lo = st.prefilled
            ids[pos : pos + chunk] = st.prefix[lo : lo + chunk]
            self._row(i, st, chunk, pos, slots, ext, last, tok_rows, tok_slots, tok_off)
            seq_lens[i] = lo + chunk
            temperature[i], seed[i] = st.req.temperature, st.req.seed
            extra.set(i, st.req.sampling, len(st.req.prompt), fresh=lo == 0)
            st.prefilled += chunk
            final = st.prefill_done
            if final:  # the last chunk samples the next output token
                st.pending_steps += 1
                st.scheduled = len(st.output) + 1
                st.seq_len_cpu = len(st.prefix) + 1
            rows.append(Row(st, final))
            pos += chunk
        for j, st in enumerate(decode, start=len(prefill)):
            if self.draft_tokens:  # ids, lengths and drafts all resolved on the device
                self._row(j, st, per_decode, pos, slots, ext, last, tok_rows, tok_slots, tok_off)
                if mode == fm_jax.ForwardMode.MIXED:  # its bonus gathered at its slot
                    relay[pos] = st.slot
                seq_lens[j] = st.seq_len_cpu  # a lower bound; the step gathers the real one
                st.seq_len_cpu += 1
                st.scheduled += 1  # at least one output per verify
                st.pending_steps += 1
                rows.append(Row(st, True))
                pos += per_decode
                continue
            self._row(j, st, 1, pos, slots, ext, last, tok_rows, tok_slots, tok_off)
            temperature[j], seed[j] = st.req.temperature, st.req.seed
            extra.set(j, st.req.sampling, len(st.req.prompt), fresh=False)
            if self.gather:
                # No id: resolve gathers it at the row's slot (DECODE: req_pool_indices;
                # MIXED: relay_slots). The host's length is exact (one more per step).
                relay[pos] = st.slot if mode == fm_jax.ForwardMode.MIXED else 0
                seq_lens[j] = st.seq_len_cpu
            elif self.overlap:
                ids[pos] = -st.slot  # sentinel: resolved from the relay on device
                # a MIXED batch carries host lengths; only DECODE restores them on device
                seq_lens[j] = -st.slot if mode == fm_jax.ForwardMode.DECODE else st.seq_len_cpu
            else:
                ids[pos] = st.output[-1]
                seq_lens[j] = st.seq_len_cpu
            st.seq_len_cpu += 1
            st.scheduled += 1
            st.pending_steps += 1
            rows.append(Row(st, True))
            pos += 1
        inputs = StepInputs(
            forward_mode=np.int32(int(mode)),
            req_pool_indices=slots,
            input_ids=ids,
            seq_lens=seq_lens,
            extend_lens=ext,
            token_rows=tok_rows,
            token_slots=tok_slots,
            token_offsets=tok_off,
            last_token=last,
            relay_slots=relay,
            temperature=temperature,
            sample_seed=seed,
            extra=extra.arrays,
        )
        return ScheduledBatch(inputs, rows, mode, n_tok, sum(c for _, c in prefill))

    @staticmethod
    def _row(
        i: int,
        st: RequestState,
        n: int,
        pos: int,
        slots: np.ndarray,
        ext: np.ndarray,
        last: np.ndarray,
        tok_rows: np.ndarray,
        tok_slots: np.ndarray,
        tok_off: np.ndarray,
    ) -> None:
        """Write row i's slot and the layout of its n tokens starting at flat index pos."""
        slots[i] = st.slot
        ext[i] = n
        last[i] = pos + n - 1
        tok_rows[pos : pos + n] = i
        tok_slots[pos : pos + n] = st.slot
        tok_off[pos : pos + n] = np.arange(n)

    # -------------------------------------------------------------------------- results
    def process(self, batch: ScheduledBatch, tokens: np.ndarray, logprobs: Any = None) -> int:
        """Take a finished step's sampled tokens (and logprobs: the sampled token's [B], the
        top ids [B, N], their logprobs [B, N]; speculative: `(drafts [B, K],)`, the drafts
        the step stashed for each row's next verify): append outputs, stream them, apply
        stops, retire; returns the number of output tokens taken.

        A row whose request already finished (overlap: its stop was read one step late, after
        this step was dispatched; or it was aborted) is discarded. Retirement frees the slot
        for the next build. A retracted request's row is taken (its token is right: the
        step ran on its own cache), then it waits in the queue to be resumed.
        """
        taken = 0
        for i, row in enumerate(batch.rows):
            st = row.state
            st.pending_steps -= row.samples
            if not row.samples or st.finished:
                continue
            if self.draft_tokens:
                if logprobs is not None and st.matcher is not None:
                    st.drafts = logprobs[0][i]
                taken += self._take_spec(st, tokens[i], batch.mode, row.dead_at)
                continue
            tok = int(tokens[i])
            st.output.append(tok)
            n = st.req.sampling.logprobs
            if n and logprobs is not None:
                chosen, top_ids, top_lp = logprobs
                st.logprobs.append(
                    (
                        float(chosen[i]),
                        tuple(int(t) for t in top_ids[i, :n]),
                        tuple(float(x) for x in top_lp[i, :n]),
                    )
                )
            taken += 1
            if self.on_token is not None:
                self.on_token(st, tok)
            if st.finished:  # aborted by the callback
                continue
            if st.matcher is not None and self._grammar_done(st, tok):
                continue
            if (
                tok in self.stop_ids
                or len(st.output) == st.req.max_new_tokens
                or self._stop_string(st)
            ):
                self._finish(st)
        return taken

    # ------------------------------------------------------------------ structured output
    def _grammar_done(self, st: RequestState, tok: int) -> bool:
        """Advance the request's matcher with its new token; finish it (with the reason)
        when the grammar is complete or refuses the token."""
        if not st.matcher.consume_token(tok) or st.matcher.is_error():
            st.reason = f"grammar refused token {tok}: {st.matcher.get_error()}"
        elif st.matcher.is_stopped():
            st.reason = "grammar complete"
        else:
            return False
        self._finish(st)
        return True

    def constrained(self, batch: ScheduledBatch) -> bool:
        """Whether a row of `batch` samples for a request with a grammar (the step splits)."""
        return any(r.samples and r.state.matcher is not None for r in batch.rows)

    def masks(self, batch: ScheduledBatch, rows: int) -> np.ndarray:
        """The rows' token bitmasks [rows, ceil(V / 32)] int32 from their matchers as they
        stand (every token read so far consumed); all ones for a row without a grammar. A
        request whose mask allows no token finishes now ("grammar dead end").
        Speculative: [rows, K + 1, W] for a verify (`_spec_masks`), [rows, 1, W] else."""
        assert self.matchers is not None
        if self.draft_tokens:
            return self._spec_masks(batch, rows)
        out = np.full((rows, self.matchers.words), -1, np.int32)
        for i, r in enumerate(batch.rows):
            st = r.state
            if not r.samples or st.matcher is None or st.finished:
                continue
            why = self.matchers.fill(st.matcher, out[i])
            if why:
                st.reason = why
                self._finish(st)
                out[i] = -1
        return out

    def _spec_masks(self, batch: ScheduledBatch, rows: int) -> np.ndarray:
        """Speculative masks [rows, P, W] (P = K + 1 for a verify, 1 for a prefill): a
        verify row's position j gets the mask after its matcher (every token read so far
        consumed, the bonus token last) advances over the row's first j drafts
        (`RequestState.drafts`, read back with its last step) on a copy (an llguidance
        rollback fails once a mask found a dead end; the copy leaves the matcher as it
        was whatever the drafts do). Past the
        first draft the grammar refuses (it is never accepted) or once the grammar is
        complete, positions get all ones: no output reaches them. An empty mask at
        position 0 finishes the request now ("grammar dead end"); at j > 0 it marks the
        row (`Row.dead_at`)."""
        assert self.matchers is not None
        verify = batch.mode == fm_jax.ForwardMode.DECODE
        k = self.draft_tokens if verify else 0
        out = np.full((rows, k + 1, self.matchers.words), -1, np.int32)
        for i, r in enumerate(batch.rows):
            st, m = r.state, r.state.matcher
            if not r.samples or m is None or st.finished:
                continue
            why = self.matchers.fill(m, out[i, 0])
            if why:
                st.reason = why
                self._finish(st)
                out[i, 0] = -1
                continue
            if not k:
                continue
            assert st.drafts is not None, "a verify row's drafts are read with its last step"
            drafts = [int(t) for t in st.drafts]
            valid = m.validate_tokens(drafts)
            ahead = m.deep_copy() if valid else m  # advanced over the drafts, then dropped
            for j in range(1, valid + 1):
                ahead.consume_token(drafts[j - 1])
                if ahead.is_stopped():
                    break
                if self.matchers.fill(ahead, out[i, j]):
                    r.dead_at = j
                    out[i, j] = -1
                    break
        return out

    def _take_spec(
        self,
        st: RequestState,
        row: np.ndarray,
        mode: fm_jax.ForwardMode,
        dead_at: int | None = None,
    ) -> int:
        """Take one spec row's outputs (`row`: [K + 1], -1 past them) up to a stop, a
        grammar's end, or (`dead_at`) the position where its grammar allowed no token."""
        made = [int(t) for t in row if t >= 0]
        if mode == fm_jax.ForwardMode.DECODE:
            self.drafts_proposed += self.draft_tokens
            self.drafts_accepted += len(made) - 1
            st.accepted += len(made) - 1
        taken = 0
        for j, tok in enumerate(made):
            if j == dead_at:
                st.reason = DEAD_END
                self._finish(st)
                break
            st.output.append(tok)
            taken += 1
            if self.on_token is not None:
                self.on_token(st, tok)
            if st.finished:
                break
            if st.matcher is not None and self._grammar_done(st, tok):
                break
            if tok in self.stop_ids or len(st.output) == st.req.max_new_tokens:
                self._finish(st)
                break
        st.scheduled = max(st.scheduled, len(st.output))
        return taken

    def _stop_string(self, st: RequestState) -> bool:
        """Whether the output's text now holds one of the request's stop strings (its tail
        only: a character takes at most 4 byte tokens, and an earlier hit already ended it)."""
        stops = st.req.sampling.stop
        if not stops or self.decode is None:
            return False
        window = 4 * max(len(s) for s in stops) + 4
        text = self.decode(st.output[-window:])
        return any(s in text for s in stops)
