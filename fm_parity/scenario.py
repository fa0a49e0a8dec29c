"""Framework-free scenarios: requests, a request pool with slot reuse, and a scheduler.

A `Scenario` is host data only. A `Scheduler` walks it step by step and yields a `StepPlan`
per step (which requests run, which prompt chunk, which kind of batch). It never sees a
device: it counts generated tokens on the host and, for speculative decoding, learns the
lengths that `resolve_seq_lens_cpu` reports (one step late, as an overlap scheduler does).
The overlap driver (one Scheduler per data-parallel rank) and the reference loop each walk
their own Scheduler over the same Scenario; identical observations give identical plans.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class Kind(enum.Enum):
    """What a step does (docs/CONTRACT.md, 'Batch kinds'). PREBUILT runs no forward."""

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"
    PREBUILT = "prebuilt"


@dataclass(frozen=True)
class Request:
    """One request: prompt length, tokens to generate, arrival step.

    `prebuilt` requests arrive with their prefill done elsewhere (disaggregated decode):
    the host bootstraps them with publish + stash in a PREBUILT step.
    For spec decoding, `output_len` counts tokens: the request runs until its length
    reaches prompt_len + output_len.
    `abort_after` (non-spec): the host aborts the request once it has scheduled this many of
    its tokens, the last of them still in flight; its slot is free at once (0: never).
    `retract_after` (non-spec): the host retracts it then instead (preemption): the slot is
    freed at once and the request resumes later by recomputing its prefix, its prompt then
    its own tokens (`resumed_from`: positions from there on are the request's own tokens;
    set by the scheduler on the resumed request).
    """

    rid: int
    prompt_len: int
    output_len: int
    arrival: int = 0
    prebuilt: bool = False
    abort_after: int = 0
    retract_after: int = 0
    resumed_from: int = 0


@dataclass(frozen=True)
class SpecShape:
    """Speculative extras: top-k width (also the draft count), hidden width (bf16), whether
    each draft relays a verified id (docs/CONTRACT.md, 'Relay fields'), which payload
    the drafts relay (fm_parity.payloads: 'eagle', 'sglang_eagle' or 'ngram'), the width
    of the confidence rows spec DECODE steps publish (0: none; fm_parity.confidence), and
    which stashes carry what: 'full' (every stash every field) or 'partial' (an SGLang
    EAGLE payload's stashes leave fields out by step, `payloads.omitted`)."""

    topk: int
    hidden: int
    verified_id: bool = False
    payload: str = "eagle"
    confidence: int = 0
    stashes: str = "full"

    def __post_init__(self) -> None:
        if self.payload not in ("eagle", "sglang_eagle", "ngram"):
            raise ValueError(f"unknown spec payload {self.payload!r}")
        if self.stashes not in ("full", "partial"):
            raise ValueError(f"unknown stash pattern {self.stashes!r}")
        if self.stashes == "partial" and self.payload != "sglang_eagle":
            raise ValueError(
                "partial stashes leave out SGLang EAGLE fields (payload='sglang_eagle')"
            )
        if self.payload == "ngram" and (self.hidden or self.verified_id):
            raise ValueError("an n-gram draft relays no hidden states and no verified ids")


@dataclass(frozen=True)
class Policy:
    """How the scheduler forms batches.

    Attributes:
      mixed: run pending prefill chunks together with running decodes (MIXED batches);
        otherwise prefill goes first and decodes wait (prefill-first).
      chunk: largest prompt chunk per row (None: whole prompt in one EXTEND row).
      max_prefill_rows: prefill rows per batch.
      max_prefill_tokens: prompt tokens per batch.
      idle_every: every this many steps the rank runs an IDLE batch (0: only when idle).
      idle_phase: shifts those steps: step s is idle when (s + idle_phase) % idle_every == 0
        (data-parallel ranks built with different phases go idle at different steps).
      max_running: requests holding a slot at once (<= pool_size - 1).
    """

    mixed: bool = False
    chunk: int | None = None
    max_prefill_rows: int = 4
    max_prefill_tokens: int = 256
    idle_every: int = 0
    idle_phase: int = 0
    max_running: int = 8


@dataclass(frozen=True)
class Scenario:
    """A named, deterministic workload for the FutureMap.

    Attributes:
      pool_size: R, request-pool rows; slot 0 is padding, live slots are 1..R-1.
      batch_buckets / token_buckets: padded batch sizes (rows / flat tokens).
      max_steps: the scheduler stops after this many steps even if requests remain.
      protocols: the relay protocols it runs under (spec MIXED batches: gather only).
      owned_relay: the engine owns the lengths and tokens buffers: fm_torch's maps adopt
        them (`fm_torch.RelayBuffers`) and the twin's engine writes each step's rows into
        them itself, so the maps' publish and stash skip their own writes (fm_jax's class
        has no such path; its twin runs as usual).
    """

    name: str
    description: str
    requests: tuple[Request, ...]
    pool_size: int
    policy: Policy
    spec: SpecShape | None = None
    batch_buckets: tuple[int, ...] = (4, 8, 16, 32)
    token_buckets: tuple[int, ...] = (8, 32, 128, 512)
    max_steps: int = 10_000
    protocols: tuple[str, ...] = ("sentinel", "gather")
    owned_relay: bool = False

    def __post_init__(self) -> None:
        p = self.policy
        if not 1 <= p.max_running <= self.pool_size - 1:
            raise ValueError(f"{self.name}: max_running must be in [1, pool_size - 1]")
        if p.max_running > max(self.batch_buckets):
            raise ValueError(f"{self.name}: max_running exceeds the largest batch bucket")
        if max(self.batch_buckets) + p.max_prefill_tokens > max(self.token_buckets):
            raise ValueError(f"{self.name}: a batch may overflow the largest token bucket")
        if self.spec is not None and p.mixed and "sentinel" in self.protocols:
            raise ValueError(
                f"{self.name}: spec MIXED batches are a gather-protocol feature "
                "(protocols=('gather',))"
            )
        if any(r.prompt_len < 1 or r.output_len < 1 for r in self.requests):
            raise ValueError(f"{self.name}: prompt_len and output_len must be >= 1")
        for r in self.requests:
            for what, n in (("abort_after", r.abort_after), ("retract_after", r.retract_after)):
                if n and (self.spec is not None or r.prebuilt or not 1 <= n < r.output_len):
                    raise ValueError(
                        f"{self.name}: request {r.rid}'s {what}={n}: a non-spec, non-PREBUILT "
                        f"request leaves after 1 to output_len - 1 ({r.output_len - 1}) tokens"
                    )
            if r.abort_after and r.retract_after:
                raise ValueError(f"{self.name}: request {r.rid} is both aborted and retracted")


class Row(NamedTuple):
    """One live batch row.

    prefill: prompt tokens [start, end) of `rid`; `final` when the chunk ends the prompt
    (a resumed request's prompt: from `own_from` on, its own tokens; 0: none).
    decode: one token; `seq_len` is the host's length (restored into MIXED rows; in a
    DECODE batch the device restores it, and for spec the host value may be a step old).
    bootstrap: a PREBUILT row; `seq_len` is the length to publish.
    """

    rid: int
    slot: int
    phase: str  # "prefill" | "decode" | "bootstrap"
    start: int = 0
    end: int = 0
    final: bool = False
    seq_len: int = 0
    own_from: int = 0


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: its kind and live rows (prefill rows before decode rows)."""

    step: int
    kind: Kind
    rows: tuple[Row, ...]


@dataclass
class _Live:
    req: Request
    slot: int
    prefilled: int = 0
    generated: int = 0
    host_len: int = 0  # seq_lens_cpu: the length the request's next decode sees
    bootstrapped: bool = False

    def prefill_done(self) -> bool:
        return self.req.prebuilt or self.prefilled >= self.req.prompt_len


@dataclass
class Scheduler:
    """Walks a Scenario: admission, retirement, immediate slot reuse, batch formation.

    Freed slots go on a stack, so the next admitted request takes the slot freed last:
    a retired, aborted or retracted request's slot is reused at once. `generation` counts
    each slot's requests (SGLang's `req_generation`: bumped when a slot goes to a new
    request). A retracted request is queued again for the next step, not this one: its last
    token, in flight when it left, has been read by then (an overlap host reads a step's
    tokens while the next step runs), so its recomputed prefix can hold it.
    """

    scenario: Scenario
    max_steps: int | None = None
    step: int = 0
    _free: list[int] = field(default_factory=list)
    _pending: list[Request] = field(default_factory=list)
    _running: dict[int, _Live] = field(default_factory=dict)  # admission order
    generation: list[int] = field(default_factory=list)
    aborted: list[int] = field(default_factory=list)  # request ids, in abort order
    retracted: list[int] = field(default_factory=list)  # request ids, one per retraction

    def __post_init__(self) -> None:
        self._free = list(range(self.scenario.pool_size - 1, 0, -1))  # pop() gives slot 1 first
        self.generation = [0] * self.scenario.pool_size
        self._pending = sorted(self.scenario.requests, key=lambda r: (r.arrival, r.rid))
        cap = self.scenario.max_steps
        self.max_steps = cap if self.max_steps is None else min(cap, self.max_steps)

    # -------------------------------------------------------------------------- lifecycle
    def _finished(self, lv: _Live) -> bool:
        if lv.generated == 0:
            return False
        if self.scenario.spec is None:
            return lv.generated >= lv.req.output_len
        return lv.host_len >= lv.req.prompt_len + lv.req.output_len

    def _retire_and_admit(self) -> None:
        for rid, lv in list(self._running.items()):
            req, leaves = lv.req, self._finished(lv)
            if req.abort_after and lv.generated >= req.abort_after:
                self.aborted.append(rid)
                leaves = True
            elif req.retract_after and lv.generated >= req.retract_after:
                self.retracted.append(rid)
                self._requeue(lv)
                leaves = True
            if leaves:
                self._free.append(self._running.pop(rid).slot)
        cap = self.scenario.policy.max_running
        while (
            self._pending
            and self._pending[0].arrival <= self.step
            and self._free
            and len(self._running) < cap
        ):
            req = self._pending.pop(0)
            slot = self._free.pop()
            self.generation[slot] += 1
            self._running[req.rid] = _Live(req, slot)

    def _requeue(self, lv: _Live) -> None:
        """Queue a retracted request again: its prompt now ends with the tokens it has
        (recomputed on resume), its output the tokens still to come."""
        req, done = lv.req, lv.generated
        resumed = Request(
            req.rid,
            req.prompt_len + done,
            req.output_len - done,
            arrival=self.step + 1,
            resumed_from=req.resumed_from or req.prompt_len,
        )
        self._pending.append(resumed)
        self._pending.sort(key=lambda r: (r.arrival, r.rid))

    def observe(self, lens: dict[int, int]) -> None:
        """Spec: host lengths reported by resolve_seq_lens_cpu (request id -> length)."""
        for rid, n in lens.items():
            self._running[rid].host_len = int(n)

    def host_lens(self, rids: list[int]) -> list[int]:
        """The host's seq_lens_cpu of the given running requests."""
        return [self._running[r].host_len for r in rids]

    def request(self, rid: int) -> Request:
        """The request behind a running request id."""
        return self._running[rid].req

    # --------------------------------------------------------------------------- planning
    def next_step(self) -> StepPlan | None:
        """Plan the next step, or None when every request is done (or max_steps reached)."""
        assert self.max_steps is not None
        if self.step >= self.max_steps:
            return None
        self.step += 1
        self._retire_and_admit()
        if not self._running and not self._pending:
            return None
        pol = self.scenario.policy
        if pol.idle_every and (self.step + pol.idle_phase) % pol.idle_every == 0:
            return StepPlan(self.step, Kind.IDLE, ())
        # One pass: every running request is unfinished here (retirement ran first).
        boot, prefill, decode = [], [], []
        for lv in self._running.values():
            if lv.req.prebuilt and not lv.bootstrapped:
                boot.append(lv)
            elif not lv.prefill_done():
                prefill.append(lv)
            elif lv.generated > 0:
                decode.append(lv)
        if boot:
            return self._bootstrap(boot[: max(self.scenario.batch_buckets)])
        if prefill and decode and pol.mixed:
            rows = self._prefill_rows(prefill, max(self.scenario.batch_buckets) - len(decode))
            return StepPlan(self.step, Kind.MIXED, rows + self._decode_rows(decode))
        if prefill:
            return StepPlan(self.step, Kind.EXTEND, self._prefill_rows(prefill, pol.max_running))
        if decode:
            return StepPlan(self.step, Kind.DECODE, self._decode_rows(decode))
        return StepPlan(self.step, Kind.IDLE, ())  # requests admitted later: nothing to run

    def _bootstrap(self, lives: list[_Live]) -> StepPlan:
        rows = []
        for lv in lives:
            lv.bootstrapped = True
            lv.generated = 1
            lv.host_len = lv.req.prompt_len + 1
            rows.append(Row(lv.req.rid, lv.slot, "bootstrap", seq_len=lv.host_len))
        return StepPlan(self.step, Kind.PREBUILT, tuple(rows))

    def _prefill_rows(self, lives: list[_Live], room: int) -> tuple[Row, ...]:
        pol = self.scenario.policy
        budget = pol.max_prefill_tokens
        rows: list[Row] = []
        for lv in lives:
            if len(rows) >= min(pol.max_prefill_rows, room) or budget <= 0:
                break
            n = lv.req.prompt_len - lv.prefilled
            if pol.chunk is not None:
                n = min(n, pol.chunk)
            n = min(n, budget)
            start, end = lv.prefilled, lv.prefilled + n
            final = end == lv.req.prompt_len
            own = lv.req.resumed_from
            rows.append(Row(lv.req.rid, lv.slot, "prefill", start, end, final, end, own))
            budget -= n
            lv.prefilled = end
            if final:
                lv.generated = 1
                lv.host_len = end + 1
        return tuple(rows)

    def _decode_rows(self, lives: list[_Live]) -> tuple[Row, ...]:
        rows = tuple(Row(lv.req.rid, lv.slot, "decode", 0, 0, False, lv.host_len) for lv in lives)
        exact = self.scenario.spec is None  # non-spec: the host knows a decode adds one token
        for lv in lives:
            lv.generated += 1
            if exact:
                lv.host_len += 1
        return rows
