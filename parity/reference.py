"""The synchronous reference loop: the same scenario with no FutureMap and no overlap.

Each request's last token (spec: its draft) and length live in host dicts and go
straight into the next batch; the numpy toy model runs the forward. What it produces per
request is the oracle for both overlap runs.
"""

from __future__ import annotations

import numpy as np

from parity import host_batch
from parity import toy_model as tm
from parity.driver import append_streams, bootstrap_rows, token_offset
from parity.scenario import Kind, Row, Scenario, Scheduler
from parity.trace import RunResult


def _stack_rows(parts: list[tuple], k: int, pad: int) -> np.ndarray | None:
    """Field k of each request's kept draft as one [B, ...] array, plus `pad` zero rows."""
    if parts[0][k] is None:
        return None
    x = np.stack([p[k] for p in parts])
    return np.concatenate([x, np.zeros((pad,) + x.shape[1:], dtype=x.dtype)])


def run_reference(scenario: Scenario, dtype: str, max_steps: int | None = None) -> RunResult:
    """Run `scenario` synchronously; return the per-request streams (no trace)."""
    offset, npdt = token_offset(dtype), np.dtype(dtype)
    spec = None if scenario.spec is None else (scenario.spec.topk, scenario.spec.hidden)
    sched = Scheduler(scenario, max_steps)
    result = RunResult()
    last: dict[int, int] = {}
    length: dict[int, int] = {}
    drafts: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}

    def keep(
        rows: tuple[Row, ...], token: np.ndarray, lens: np.ndarray, draft: tm.Draft | None
    ) -> None:
        for i, row in enumerate(rows):
            if row.phase == "prefill" and not row.final:
                continue
            last[row.rid], length[row.rid] = int(token[i]), int(lens[i])
            if draft is not None:
                h = None if draft.hidden is None else draft.hidden[i]
                drafts[row.rid] = (draft.topk_p[i], draft.topk_index[i], h)

    while (plan := sched.next_step()) is not None:
        result.steps = plan.step
        if plan.kind is Kind.IDLE:
            continue
        if plan.kind is Kind.PREBUILT:
            lens, toks, d = bootstrap_rows(plan, sched, scenario, npdt, offset, len(plan.rows))
            keep(plan.rows, toks, lens, d)
            append_streams(result.streams, plan, toks, None)
            continue
        hb = host_batch.build(
            plan, scenario, npdt, offset, lambda row: (last[row.rid], length[row.rid])
        )
        n, pad = hb.n_rows, len(hb.slots) - hb.n_rows
        accept = None
        if spec is None:
            token, new_lens = tm.forward_tokens(
                hb.input_ids, hb.seq_lens, hb.slots, hb.last_index, tm.NUMPY, offset
            )
            draft = None
        elif hb.spec_decode:
            rids = [r.rid for r in plan.rows]
            sched.observe({rid: length[rid] for rid in rids})
            parts = [drafts[r] for r in rids]

            gathered = tm.Draft(hb.input_ids, *(_stack_rows(parts, k, pad) for k in range(3)))
            accept, new_lens, draft = tm.forward_spec_decode(
                gathered, hb.seq_lens, hb.slots, tm.NUMPY, spec, offset
            )
            token = draft.bonus
        else:
            accept, new_lens, draft = tm.forward_spec_extend(
                hb.input_ids, hb.seq_lens, hb.slots, hb.last_index, tm.NUMPY, spec, offset
            )
            token = draft.bonus
            accept = None  # a prefill accepts nothing: its stream starts with the bonus
        keep(plan.rows, token, new_lens, draft)
        append_streams(result.streams, plan, token[:n], None if accept is None else accept[:n])
    return result
