"""The overlap driver: the contract's step order against one FutureMap twin, traced per op.

One driver for one device, a mesh and many processes, and for both relay protocols
(docs/CONTRACT.md, 'Two protocols'; the twin's map fixes which): it steps the DP ranks it
is given (each its own Scenario and Scheduler) in lockstep, and every op of a step is one
twin call for all of them. Per step, in host order (docs/CONTRACT.md, 'One overlap step'):
build each rank's batch, spec only `resolve_seq_lens_cpu`, then `resolve`, the forward,
`publish`, `stash` and, in the sentinel protocol, `invalidate`. How the host lays out its
decode rows depends on the protocol:

- sentinel: decode rows carry the sentinels the last invalidate left (MIXED decode rows
  get the host's seq_lens_cpu);
- gather: decode rows carry no id (0) and the host's seq_lens_cpu (spec: a step old; the
  device gathers the verified lengths); a MIXED batch names its running rows' slots;
  nothing is invalidated, so the trace has no 'invalidate' records.

A PREBUILT rank bootstraps with publish + stash and no resolve or forward; an IDLE rank
takes part with empty indices; a rank whose scenario has ended sits out. After each op the
driver records, per rank, what the op touched: buffers (slots 1..R-1), resolved ids and
lengths, gathered spec extras, the sentinels, and at the end of the step the host's
seq_lens_cpu. Per-row and per-token fields keep live rows and tokens only: padding rows
are garbage by contract.

Across processes a `Sync` agrees each step's sizes (and whether any rank is still
running) with the other processes, as an engine's DP batch-size sync does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fm_parity import confidence, host_batch, payloads
from fm_parity import toy_model as tm
from fm_parity.host_batch import HostBatch
from fm_parity.scenario import Kind, Row, Scenario, Scheduler, StepPlan
from fm_parity.trace import Field, OpRecord, RunResult
from fm_parity.twin import ForwardOut, ResolvedOut, Sizes, Twin, check_protocol

Sync = Callable[[int, Sizes, bool], tuple[Sizes, bool]]
"""(step, this process's sizes, whether it has a running rank) -> (agreed sizes, whether
any process has one). Called once per step; the run ends when no process has one."""

Fields = dict[str, tuple[Any, np.ndarray]]


@dataclass
class _Lane:
    """One DP rank: its scenario, scheduler, and what the host carries between steps."""

    scenario: Scenario
    sched: Scheduler
    sentinel: dict[int, tuple[int, int]] = field(default_factory=dict)
    # The spec fields a stash has written on this rank: each one's buffer is recorded from
    # then on (fm_torch makes it there).
    stashed: frozenset[str] = frozenset()
    done: bool = False

    def plan(self) -> StepPlan | None:
        """The next step's plan, or None once the scenario has ended."""
        if not self.done:
            p = self.sched.next_step()
            self.done = p is None
            return p
        return None

    def placeholder(self, plan: StepPlan, protocol: str) -> host_batch.Placeholder:
        """A decode row's (id, length) before resolve. Sentinel protocol: the sentinels the
        host holds, with the host's length in a MIXED batch. Gather protocol: no id (0: a
        host id is never negative there) and the host's seq_lens_cpu."""

        def held(row: Row) -> tuple[int, int]:
            ids, lens = self.sentinel[row.rid]
            return ids, (row.seq_len if plan.kind is Kind.MIXED else lens)

        def host(row: Row) -> tuple[int, int]:
            return 0, row.seq_len

        return host if protocol == "gather" else held


def append_streams(
    streams: dict[tuple[int, int], list[int]],
    rank: int,
    plan: StepPlan,
    token: np.ndarray,
    accept: np.ndarray | None,
    seen: list[list[int]] | None = None,
) -> None:
    """Add what each row produced to its request's stream (intermediate chunks add nothing);
    `seen`: what each decode row's confidence read gave it (`confidence.digest`), first."""
    toks = token.tolist()
    acc = None if accept is None else accept.tolist()
    for i, row in enumerate(plan.rows):
        if row.phase == "prefill" and not row.final:
            continue
        s = streams.setdefault((rank, row.rid), [])
        if seen is not None and row.phase == "decode":
            s.extend(seen[i])
        if acc is not None and row.phase == "decode":
            s.append(acc[i])
        s.append(toks[i])


def bootstrap_rows(
    plan: StepPlan, sched: Scheduler, scenario: Scenario, dtype: np.dtype, offset: int, rows: int
) -> tuple[np.ndarray, np.ndarray, tm.Draft | None]:
    """A PREBUILT step's padded (lengths, tokens, draft) as a prefill node hands them over."""
    spec = None if scenario.spec is None else payloads.layout(scenario.spec)
    verified = scenario.spec is not None and scenario.spec.verified_id
    lens = np.zeros(rows, dtype=dtype)
    toks = np.zeros(rows, dtype=dtype)
    drafts = []
    for i, row in enumerate(plan.rows):
        req = sched.request(row.rid)
        tok, d = tm.bootstrap(row.rid, req.prompt_len, row.slot, spec, offset, dtype, verified)
        lens[i], toks[i] = row.seq_len, tok
        drafts.append(d)
    if spec is None:
        return lens, toks, None
    draft = tm.concat_drafts([d for d in drafts if d is not None], rows - len(plan.rows))
    return lens, toks, draft._replace(bonus=toks)


def _produced(streams: dict[tuple[int, int], list[int]], rank: int) -> host_batch.Produced:
    """What each request of `rank` has produced so far, as the host read it."""
    return lambda rid: streams.get((rank, rid), ())


class _Recorder:
    """Appends OpRecords per rank, with the rank's buffers after ops that write them."""

    def __init__(self, twin: Twin, lanes: Mapping[int, _Lane], result: RunResult) -> None:
        self.twin = twin
        self.lanes = lanes
        self.buf_slots = {r: np.arange(1, ln.scenario.pool_size) for r, ln in lanes.items()}
        self.result = result

    def op(self, step: int, op: str, fields: Mapping[int, Fields], buffers: bool = True) -> None:
        if not fields:
            return
        bufs = self.twin.buffers({r: self.lanes[r].stashed for r in fields}) if buffers else {}
        for rank, fs in fields.items():
            rec = {k: Field(v, s) for k, (v, s) in fs.items()}
            for k, v in bufs.get(rank, {}).items():
                rec[k] = Field(v, self.buf_slots[rank])
            self.result.records.append(OpRecord(step, op, rec, rank))


def _resolved_fields(twin: Twin, res: ResolvedOut, hb: HostBatch) -> Fields:
    n = hb.n_rows
    f: Fields = {
        "input_ids": (twin.snap(res.input_ids, hb.n_tokens), hb.token_slots[: hb.n_tokens]),
        "seq_lens": (twin.snap(res.seq_lens, n), hb.live_slots),
    }
    if res.draft is not None:
        for k, v in payloads.fields(res.draft).items():
            f[f"draft.{k}"] = (twin.snap(v, n), hb.live_slots)
    if res.tails is not None:  # a spec MIXED batch's host fields, running rows rebound
        seq, total, prefix = res.tails
        f["host.seq_lens_cpu"] = (np.array(seq[:n], np.int64), hb.live_slots)
        f["host.seq_lens_sum"] = (np.array([total], np.int64), hb.live_slots[:1])
        f["host.prefix_lens"] = (np.array(prefix[:n], np.int64), hb.live_slots)
    return f


def _forward_fields(twin: Twin, out: ForwardOut, hb: HostBatch) -> Fields:
    n, live = hb.n_rows, hb.live_slots
    f: Fields = {
        "token": (twin.snap(out.token, n), live),
        "new_seq_lens": (twin.snap(out.new_lens, n), live),
    }
    if out.accept is not None:
        f["accept"] = (twin.snap(out.accept, n), live)
    if out.draft is not None:
        for k, v in payloads.fields(out.draft).items():
            if k != "bonus_tokens":  # recorded as the token
                f[f"draft.{k}"] = (twin.snap(v, n), live)
    return f


def run_overlap(
    lanes: Mapping[int, Scenario],
    twin: Twin,
    dtype: str,
    max_steps: int | None = None,
    sync: Sync | None = None,
) -> RunResult:
    """Run each DP rank's scenario through `twin` with the overlap protocol, in lockstep.

    Args:
      lanes: DP rank -> the scenario that rank runs (one device: {0: scenario}); the ranks
        must be among `twin.ranks`.
      twin: the FutureMap twin; its map's protocol (`twin.protocol`) decides how the host
        lays out decode rows and whether it invalidates.
      dtype: 'int32' or 'int64' (token ids of int64 runs sit above 2**32).
      max_steps: stop each rank after this many scheduler steps.
      sync: agrees sizes across processes (see `Sync`); None: this process alone.

    Returns:
      The trace and streams of every rank. Each spec buffer (top-k, hidden, verified ids,
      an engine's own) is recorded from the first non-empty draft stash on a rank that
      carries its field on (the torch twin makes it there).
      A FutureMap error (debug violation or rejected input) stops the run and is kept.
      The device-to-host transfers the twin saw inside its map ops (`Twin.transfers`: the
      'sync' check) are kept in `syncs`; they do not stop the run.
    """
    offset, npdt = tm.token_offset(dtype), np.dtype(dtype)
    protocol = check_protocol(twin.protocol)
    state = {r: _Lane(s, Scheduler(s, max_steps)) for r, s in sorted(lanes.items())}
    result = RunResult()
    rec = _Recorder(twin, state, result)
    step = 0
    try:
        while True:
            step += 1
            plans = {r: p for r, ln in state.items() if (p := ln.plan()) is not None}
            hbs = {
                r: host_batch.build(
                    p,
                    state[r].scenario,
                    npdt,
                    offset,
                    state[r].placeholder(p, protocol),
                    _produced(result.streams, r),
                )
                for r, p in plans.items()
            }
            sizes = Sizes(
                max((len(hb.slots) for hb in hbs.values()), default=0),
                max((len(hb.input_ids) for hb in hbs.values()), default=0),
            )
            more = bool(plans)
            if sync is not None:
                sizes, more = sync(step, sizes, more)
            if not more:
                break
            if plans:
                result.steps = step
                res = _step(step, plans, hbs, state, twin, sizes, rec, npdt, offset)
                if protocol == "sentinel":
                    _invalidate(step, plans, hbs, res, state, twin, sizes, rec)
                _host(step, plans, hbs, state, rec)
                _syncs(step, twin, result)
                twin.check()
    except twin.errors as e:
        _syncs(step, twin, result)
        result.error = f"{type(e).__name__}: {e}"
        result.error_kind = twin.error_kind(e)
        while sync is not None and sync(step, Sizes(0, 0), False)[1]:
            step += 1  # stay in the per-step sync until every process has stopped
    return result


def _step(
    step: int,
    plans: Mapping[int, StepPlan],
    hbs: Mapping[int, HostBatch],
    lanes: Mapping[int, _Lane],
    twin: Twin,
    sizes: Sizes,
    rec: _Recorder,
    npdt: np.dtype,
    offset: int,
) -> dict[int, ResolvedOut]:
    """One overlap step of every running rank, up to its stash (`_invalidate` and `_host`
    end it). Returns what resolve handed each resolving rank (invalidate's input)."""
    streams = rec.result.streams
    kind = {r: p.kind for r, p in plans.items()}
    resolving = {r: hb for r, hb in hbs.items() if kind[r] is not Kind.PREBUILT}
    running = [r for r in resolving if kind[r] is not Kind.IDLE]

    spec_decode = {r: hb.live_slots for r, hb in resolving.items() if hb.spec_decode}
    if spec_decode:
        host_lens = twin.resolve_seq_lens_cpu(spec_decode, sizes)
        rec.op(
            step,
            "resolve_seq_lens_cpu",
            {r: {"seq_lens": (np.array(host_lens[r]), s)} for r, s in spec_decode.items()},
            buffers=False,
        )
        for r in spec_decode:
            rids = [row.rid for row in plans[r].rows]
            lanes[r].sched.observe(dict(zip(rids, host_lens[r].tolist(), strict=True)))

    seen = _read_confidence(step, resolving, lanes, twin, rec)

    res = twin.resolve(resolving, sizes) if resolving else {}
    rec.op(step, "resolve", {r: _resolved_fields(twin, res[r], hbs[r]) for r in resolving})
    for r, got in res.items():  # spec MIXED: the host learns its running rows' lengths
        if got.tails is not None:
            prefix = got.tails[2]
            rows = plans[r].rows
            lanes[r].sched.observe(
                {row.rid: int(prefix[i]) for i, row in enumerate(rows) if row.phase == "decode"}
            )

    outs = {r: twin.forward(r, res[r], hbs[r], offset) for r in running}
    rec.op(step, "forward", {r: _forward_fields(twin, outs[r], hbs[r]) for r in running}, False)

    lens: dict[int, Any] = {}
    payload: dict[int, Any] = {}
    for r, hb in hbs.items():
        spec = lanes[r].scenario.spec
        omit = () if spec is None else payloads.omitted(spec, kind[r], plans[r].step)
        if r in outs:
            lens[r], payload[r] = outs[r].new_lens, outs[r].payload
            if spec is not None:  # a partial stash leaves fields out
                payload[r] = payloads.without(payload[r], omit)
        elif kind[r] is Kind.PREBUILT:
            ln = lanes[r]
            lens[r], toks, d = bootstrap_rows(
                plans[r], ln.sched, ln.scenario, npdt, offset, len(hb.slots)
            )
            payload[r] = toks if d is None else payloads.without(twin.draft_payload(toks, d), omit)
            append_streams(streams, r, plans[r], toks, None)
        else:  # IDLE: empty indices, nothing to relay
            none = np.zeros(0, dtype=npdt)
            lens[r] = payload[r] = none
            spec = lanes[r].scenario.spec
            if spec is not None:  # a spec map stashes drafts only: an empty one
                vid = none if spec.verified_id else None  # every declared field, no rows
                layout = payloads.layout(spec)
                draft = tm.make_draft(tm.NUMPY, none, none, none, layout, offset, vid)
                payload[r] = payloads.without(twin.draft_payload(none, draft), omit)
    slots = {r: hb.slots for r, hb in hbs.items()}
    conf, gens = {}, {}
    for r in running:
        gamma = _confidence_width(lanes[r])
        if gamma and hbs[r].spec_decode:  # a verify publishes confidence (DSpark)
            out = outs[r]
            host = (twin.host(out.token), twin.host(out.new_lens), hbs[r].slots)
            conf[r] = confidence.rows(*host, gamma)
            gens[r] = np.array(lanes[r].sched.generation, np.int64)
    if conf:
        twin.publish(slots, lens, sizes, confidence=conf, generation=gens)
    else:
        twin.publish(slots, lens, sizes)
    rec.op(step, "publish", {r: {} for r in hbs})
    twin.stash(slots, payload, sizes)
    for r in hbs:  # the fields a rank's draft stashes write: their buffers exist from now
        ln = lanes[r]
        if ln.scenario.spec is not None and kind[r] is not Kind.IDLE:
            ln.stashed |= set(payloads.fields(payload[r])) - {"bonus_tokens"}
    rec.op(step, "stash", {r: {} for r in hbs})
    for r in running:
        acc = outs[r].accept
        append_streams(
            streams,
            r,
            plans[r],
            twin.host(outs[r].token),
            None if acc is None else twin.host(acc),
            seen.get(r),
        )
    return res


def _confidence_width(lane: _Lane) -> int:
    """gamma of the lane's confidence relay; 0 without one."""
    spec = lane.scenario.spec
    return 0 if spec is None else spec.confidence


def _read_confidence(
    step: int,
    resolving: Mapping[int, HostBatch],
    lanes: Mapping[int, _Lane],
    twin: Twin,
    rec: _Recorder,
) -> dict[int, list[list[int]]]:
    """Each spec DECODE rank with a confidence relay reads its live slots' rows (waiting for
    the ring entry: deterministic); recorded, and returned as each row's stream entries."""
    want = {
        r: hb.live_slots
        for r, hb in resolving.items()
        if hb.spec_decode and _confidence_width(lanes[r])
    }
    if not want:
        return {}
    reads = twin.resolve_confidence_cpu(want)
    fields: dict[int, Fields] = {}
    seen = {}
    for r, s in want.items():
        got = reads[r]
        f: Fields = {"ready": (np.array([got is not None], np.int8), s[:1])}
        if got is not None:
            f["confidence"] = (got[0], s)
            f["generation"] = (got[1], s)
        fields[r] = f
        seen[r] = confidence.digest(got, np.array(lanes[r].sched.generation, np.int64)[s])
    rec.op(step, "resolve_confidence_cpu", fields, buffers=False)
    return seen


def _syncs(step: int, twin: Twin, result: RunResult) -> None:
    """Keep the device-to-host transfers the twin saw inside its map ops this step."""
    result.syncs += [f"step {step}: {t}" for t in twin.transfers()]


def _invalidate(
    step: int,
    plans: Mapping[int, StepPlan],
    hbs: Mapping[int, HostBatch],
    res: Mapping[int, ResolvedOut],
    lanes: Mapping[int, _Lane],
    twin: Twin,
    sizes: Sizes,
    rec: _Recorder,
) -> None:
    """Sentinel protocol: invalidate every rank's batch; its sentinels are what the host's
    next batch carries in those requests' decode rows."""
    sentinels = twin.invalidate(hbs, res, sizes)
    fields: dict[int, Fields] = {}
    for r, hb in hbs.items():
        ids, lns = (twin.host(x) for x in sentinels[r])
        live = hb.live_slots
        n = hb.n_rows
        fields[r] = {
            "sentinel.input_ids": (ids[:n].copy(), live),
            "sentinel.seq_lens": (lns[:n].copy(), live),
        }
        rids = [row.rid for row in plans[r].rows]
        lanes[r].sentinel.update(
            zip(rids, zip(ids.tolist(), lns.tolist(), strict=False), strict=False)
        )
    rec.op(step, "invalidate", fields, buffers=False)


def _host(
    step: int,
    plans: Mapping[int, StepPlan],
    hbs: Mapping[int, HostBatch],
    lanes: Mapping[int, _Lane],
    rec: _Recorder,
) -> None:
    """Record each rank's host seq_lens_cpu at the end of the step."""
    host = {
        r: {
            "seq_lens_cpu": (
                np.array(lanes[r].sched.host_lens([row.rid for row in p.rows]), np.int64),
                hbs[r].live_slots,
            )
        }
        for r, p in plans.items()
    }
    rec.op(step, "host", host, buffers=False)
