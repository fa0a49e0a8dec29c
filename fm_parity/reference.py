"""The synchronous reference loop: the same scenario with no FutureMap, no overlap, no padding.

The oracle of both overlap runs. It shares only the scenario (its Scheduler) and the toy
model with the driver it checks: each request's last token (spec: its draft) and length
live in host dicts, every live row is computed on its own from them with the numpy model,
and what each request produces is appended here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from fm_parity import confidence, payloads
from fm_parity import toy_model as tm
from fm_parity.scenario import Kind, Scenario, Scheduler, StepPlan

Streams = dict[int, list[int]]
"""Request id -> non-spec: its tokens; spec: its first token, then accept length and bonus
token per decode step (as the overlap runs record them)."""


def run_reference(scenario: Scenario, dtype: str, max_steps: int | None = None) -> Streams:
    """Run `scenario` synchronously; return what each request produced, in order."""
    offset, npdt = tm.token_offset(dtype), np.dtype(dtype)
    spec = None if scenario.spec is None else payloads.layout(scenario.spec)
    verified = scenario.spec is not None and scenario.spec.verified_id
    sched = Scheduler(scenario, max_steps)
    streams: Streams = {}
    last: dict[int, int] = {}  # request -> its last token (spec: bonus token)
    length: dict[int, int] = {}  # request -> its length after its last forward
    drafts: dict[int, tm.Draft] = {}  # spec: request -> its draft, one row
    gamma = 0 if scenario.spec is None else scenario.spec.confidence
    ring = confidence.Ring(scenario.pool_size, gamma) if gamma else None

    def omitted(plan: StepPlan) -> tuple[str, ...]:
        """The fields the step's stash leaves out (the request keeps its earlier rows)."""
        assert scenario.spec is not None
        return payloads.omitted(scenario.spec, plan.kind, plan.step)

    while (plan := sched.next_step()) is not None:
        if plan.kind is Kind.IDLE:
            continue
        rows = plan.rows
        if plan.kind is Kind.PREBUILT:
            for row in rows:
                req = sched.request(row.rid)
                tok, d = tm.bootstrap(
                    row.rid, req.prompt_len, row.slot, spec, offset, npdt, verified
                )
                last[row.rid], length[row.rid] = tok, row.seq_len
                if d is not None:
                    drafts[row.rid] = _kept(drafts.get(row.rid), d, omitted(plan))
                streams.setdefault(row.rid, []).append(tok)
            continue
        ids, lens = [], []
        for row in rows:
            if row.phase == "prefill":
                own = streams.get(row.rid, ())
                ids += tm.prompt_tokens(row.rid, row.end - 1, row.end, offset, row.own_from, own)
                lens.append(row.end)
            else:
                ids.append(last[row.rid])
                # A spec MIXED batch's running rows: the published length plus the token
                # fed (the contract's late binding; a DECODE row's is the published one).
                bound = spec is not None and plan.kind is Kind.MIXED
                lens.append(length[row.rid] + bound)
        ids_a, lens_a = np.array(ids, npdt), np.array(lens, npdt)
        slots = np.array([row.slot for row in rows], npdt)
        every = np.arange(len(rows))
        accept = None
        seen = None
        if ring is not None and plan.kind is Kind.DECODE:  # a verify reads, then publishes
            gen = np.array(sched.generation, np.int64)
            seen = confidence.digest(ring.read(slots.astype(np.int64)), gen[slots])
        if spec is not None and plan.kind is Kind.MIXED:
            # The host rebinds its running rows from the published lengths (their prefix).
            sched.observe({row.rid: length[row.rid] for row in rows if row.phase == "decode"})
        if spec is None:
            token, new_lens = tm.forward_tokens(ids_a, lens_a, slots, every, tm.NUMPY, offset)
            draft = None
        elif plan.kind is Kind.DECODE:
            sched.observe({row.rid: length[row.rid] for row in rows})
            # What the map relays of each request's draft (its bonus token: the last one).
            held = tm.concat_drafts([drafts[row.rid] for row in rows])._replace(bonus=ids_a)
            gathered = payloads.gathered(payloads.to_payload(_Relayed, held, spec))
            accept, new_lens, draft = tm.forward_spec_decode(
                gathered, lens_a, slots, tm.NUMPY, spec, offset, verified
            )
            token = draft.bonus
            if ring is not None:
                conf = confidence.rows(token, new_lens, slots, gamma)
                ring.publish(slots.astype(np.int64), conf, np.array(sched.generation, np.int64))
        else:  # a spec prefill accepts nothing: its stream starts with the bonus token
            accept, new_lens, draft = tm.forward_spec_extend(
                ids_a, lens_a, slots, every, tm.NUMPY, spec, offset, verified
            )
            token = draft.bonus
        for i, row in enumerate(rows):
            if row.phase == "prefill" and not row.final:
                continue  # an intermediate chunk's token is never read
            last[row.rid], length[row.rid] = int(token[i]), int(new_lens[i])
            if draft is not None:  # the request's own row of every draft field it stashes
                drafts[row.rid] = _kept(drafts.get(row.rid), _row(draft, i), omitted(plan))
            s = streams.setdefault(row.rid, [])
            if seen is not None and row.phase == "decode":
                s.extend(seen[i])
            if accept is not None and row.phase == "decode":
                s.append(int(accept[i]))
            s.append(int(token[i]))
    return streams


class _Relayed(NamedTuple):
    """A relayed draft as the reference holds it: the fields a map would give, by the
    twins' DraftPayload names."""

    bonus_tokens: Any = None
    topk_p: Any = None
    topk_index: Any = None
    hidden_states: Any = None
    verified_id: Any = None
    extras: dict[str, Any] | None = None


_DRAFT_NAMES = {"topk_p": "topk_p", "topk_index": "topk_index", "hidden_states": "hidden"}
"""A relayed standard field's name in the toy model's Draft, where the stash can omit it."""


def _kept(held: tm.Draft | None, new: tm.Draft, omit: tuple[str, ...]) -> tm.Draft:
    """`new` with each field in `omit` as `held` has it (None when it has none): what a
    stash leaving those fields out keeps of the request's draft."""
    if not omit:
        return new
    std = {
        _DRAFT_NAMES[k]: None if held is None else getattr(held, _DRAFT_NAMES[k])
        for k in omit
        if k in _DRAFT_NAMES
    }
    extras = {k: v for k, v in (new.extras or {}).items() if k not in omit}
    for k in omit:
        old = None if held is None else (held.extras or {}).get(k)
        if old is not None:
            extras[k] = old
    return new._replace(**std, extras=extras or None)


def _row(draft: tm.Draft, i: int) -> tm.Draft:
    """Row `i` of every field of `draft`, kept 2-D ([1, ...])."""

    def one(x: Any) -> Any:
        return None if x is None else x[i : i + 1]

    d = draft
    extras = {k: one(v) for k, v in (d.extras or {}).items()} or None
    return tm.Draft(
        one(d.bonus), one(d.topk_p), one(d.topk_index), one(d.hidden), one(d.verified), extras
    )
