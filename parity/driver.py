"""The overlap driver: SPEC.md's step protocol against one FutureMap twin, traced per op.

Per step, in host order: build the batch (decode rows carry the sentinels the last
invalidate left; MIXED decode rows get the host's seq_lens_cpu), spec only
`resolve_seq_lens_cpu`, then `resolve`, the forward, `publish`, `stash`, `invalidate`.
A PREBUILT step bootstraps with publish + stash and no forward; an IDLE step runs every
op with empty indices. After each op the driver records what the op touched: buffers
(slots 1..R-1), resolved ids and lengths, gathered spec extras, the sentinels, and at
the end of the step the host's seq_lens_cpu. Per-row and per-token fields keep live rows
and tokens only: padding rows are garbage by contract, and a twin may pad an empty (IDLE)
batch to a bucket where the other keeps it empty.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from parity import host_batch
from parity import toy_model as tm
from parity.scenario import Kind, Row, Scenario, Scheduler, StepPlan
from parity.trace import Field, OpRecord, RunResult
from parity.twin import Twin

DRAFT_FIELDS = ("bonus_tokens", "topk_p", "topk_index", "hidden_states")


def token_offset(dtype: str) -> int:
    """Token ids sit above 2**32 in int64 runs (see toy_model.WIDE_OFFSET)."""
    return tm.WIDE_OFFSET if dtype == "int64" else 0


def append_streams(
    streams: dict[int, list[int]], plan: StepPlan, token: np.ndarray, accept: np.ndarray | None
) -> None:
    """Add what each row produced to its request's stream (intermediate chunks add nothing)."""
    toks = token.tolist()
    acc = None if accept is None else accept.tolist()
    for i, row in enumerate(plan.rows):
        if row.phase == "prefill" and not row.final:
            continue
        s = streams.setdefault(row.rid, [])
        if acc is not None and row.phase == "decode":
            s.append(acc[i])
        s.append(toks[i])


def bootstrap_rows(
    plan: StepPlan, sched: Scheduler, scenario: Scenario, dtype: np.dtype, offset: int, rows: int
) -> tuple[np.ndarray, np.ndarray, tm.Draft | None]:
    """A PREBUILT step's padded (lengths, tokens, draft) as a prefill node hands them over."""
    spec = None if scenario.spec is None else (scenario.spec.topk, scenario.spec.hidden)
    lens = np.zeros(rows, dtype=dtype)
    toks = np.zeros(rows, dtype=dtype)
    drafts = []
    for i, row in enumerate(plan.rows):
        req = sched.request(row.rid)
        tok, d = tm.bootstrap(row.rid, req.prompt_len, row.slot, spec, offset, dtype)
        lens[i], toks[i] = row.seq_len, tok
        drafts.append(d)
    if spec is None:
        return lens, toks, None
    pad = rows - len(plan.rows)

    def cat(k: int) -> Any:
        parts = [d[k] for d in drafts if d is not None]
        if parts[0] is None:
            return None  # no hidden states (H == 0)
        zeros = np.zeros((pad,) + parts[0].shape[1:], dtype=parts[0].dtype)
        return np.concatenate(parts + [zeros])

    return lens, toks, tm.Draft(toks, cat(1), cat(2), cat(3))


class _Recorder:
    """Appends OpRecords; `extras` turns on spec-buffer recording (see buffers_recorded)."""

    def __init__(self, twin: Twin, pool_size: int, result: RunResult) -> None:
        self.twin = twin
        self.buf_slots = np.arange(1, pool_size)
        self.result = result
        self.extras = False

    def op(
        self, step: int, op: str, fields: dict[str, tuple[Any, np.ndarray]], buffers: bool = True
    ) -> None:
        rec = {k: Field(v, s) for k, v_s in fields.items() for v, s in [v_s]}
        if buffers:
            for k, v in self.twin.buffers(self.extras).items():
                rec[k] = Field(v, self.buf_slots)
        self.result.records.append(OpRecord(step, op, rec))


def run_overlap(
    scenario: Scenario, twin: Twin, dtype: str, max_steps: int | None = None
) -> RunResult:
    """Run `scenario` through `twin` with the overlap protocol; return trace and streams.

    Spec buffers (top-k, hidden) are recorded from the first non-empty draft stash on:
    the torch twin shapes them lazily there. A FutureMap error (debug violation or
    rejected input) stops the run and is kept in the result.
    """
    offset, npdt = token_offset(dtype), np.dtype(dtype)
    sched = Scheduler(scenario, max_steps)
    result = RunResult()
    rec = _Recorder(twin, scenario.pool_size, result)
    sentinel: dict[int, tuple[int, int]] = {}
    try:
        while (plan := sched.next_step()) is not None:
            result.steps = step = plan.step

            def placeholder(row: Row, plan: StepPlan = plan) -> tuple[int, int]:
                ids, lens = sentinel[row.rid]
                return ids, (row.seq_len if plan.kind is Kind.MIXED else lens)

            hb = host_batch.build(plan, scenario, npdt, offset, placeholder)
            n, live = hb.n_rows, hb.live_slots
            tok_slots = hb.token_slots[: hb.n_tokens]
            rids = [r.rid for r in plan.rows]
            res = None
            if plan.kind is Kind.PREBUILT:
                lens, toks, d = bootstrap_rows(plan, sched, scenario, npdt, offset, len(hb.slots))
                twin.publish(hb.slots, lens)
                rec.op(step, "publish", {})
                twin.stash(hb.slots, toks if d is None else twin.draft_payload(toks, d))
                rec.extras = rec.extras or d is not None
                rec.op(step, "stash", {})
                append_streams(result.streams, plan, toks, None)
            else:
                if hb.spec_decode:
                    host_lens = twin.resolve_seq_lens_cpu(live)
                    rec.op(
                        step,
                        "resolve_seq_lens_cpu",
                        {"seq_lens": (np.array(host_lens), live)},
                        buffers=False,
                    )
                    sched.observe(dict(zip(rids, host_lens.tolist(), strict=True)))
                res = twin.resolve(hb)
                f = {
                    "input_ids": (twin.snap(res.input_ids, hb.n_tokens), tok_slots),
                    "seq_lens": (twin.snap(res.seq_lens, n), live),
                }
                if res.draft is not None:
                    for k in DRAFT_FIELDS:
                        v = getattr(res.draft, k)
                        if v is not None:
                            f[f"draft.{k}"] = (twin.snap(v, n), live)
                rec.op(step, "resolve", f)
                if plan.kind is Kind.IDLE:
                    empty = np.zeros(0, dtype=npdt)
                    twin.publish(hb.slots, empty)
                    rec.op(step, "publish", {})
                    twin.stash(hb.slots, empty)
                    rec.op(step, "stash", {})
                else:
                    out = twin.forward(res, hb, offset)
                    f = {
                        "token": (twin.snap(out.token, n), live),
                        "new_seq_lens": (twin.snap(out.new_lens, n), live),
                    }
                    if out.accept is not None:
                        f["accept"] = (twin.snap(out.accept, n), live)
                    if out.draft is not None:
                        for k in DRAFT_FIELDS[1:]:
                            v = getattr(out.draft, k)
                            if v is not None:
                                f[f"draft.{k}"] = (twin.snap(v, n), live)
                    rec.op(step, "forward", f, buffers=False)
                    twin.publish(hb.slots, out.new_lens)
                    rec.op(step, "publish", {})
                    twin.stash(hb.slots, out.payload)
                    rec.extras = rec.extras or out.draft is not None
                    rec.op(step, "stash", {})
                    acc = None if out.accept is None else twin.host(out.accept)
                    append_streams(result.streams, plan, twin.host(out.token), acc)
            ids_s, lens_s = twin.invalidate(hb, res)
            ids_h, lens_h = twin.host(ids_s), twin.host(lens_s)
            rec.op(
                step,
                "invalidate",
                {
                    "sentinel.input_ids": (ids_h[:n].copy(), live),
                    "sentinel.seq_lens": (lens_h[:n].copy(), live),
                },
                buffers=False,
            )
            sentinel.update(
                zip(rids, zip(ids_h.tolist(), lens_h.tolist(), strict=False), strict=False)
            )
            host = np.array(sched.host_lens(rids), dtype=np.int64)
            rec.op(step, "host", {"seq_lens_cpu": (host, live)}, buffers=False)
            twin.check()
    except twin.errors as e:
        result.error = f"{type(e).__name__}: {e}"
        result.error_kind = twin.error_kind(e)
    return result
