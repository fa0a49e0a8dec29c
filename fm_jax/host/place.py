"""Placement: what a caller passes, turned into one executable's key and arguments; a
layout decided once (`decisions.Decision`), every call of it placed by running that."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from fm_jax.host.buckets import resolve_sizes
from fm_jax.host.decisions import (
    Decision,
    Key,
    Placed,
    Rows,
    constant,
    payload_kind,
    payload_values,
    resolve_values,
    signature,
)
from fm_jax.host.validate import (
    Given,
    StepInput,
    batch_values,
    given_batch,
    given_inputs,
    one_id_per_row,
)
from fm_jax.ops import errors
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import Protocol, Rules
from fm_jax.ops.relay_fields import draft_payload
from fm_jax.ops.types import CONFIDENCE_DTYPE, Batch, ForwardMode, SpecConfig, confidence_width

MAX_LAYOUTS = 4096
"""Layouts a map remembers (a serving loop repeats a few hundred); past this many, a new
layout is decided at each of its calls."""


class Placement:
    """Placement for one map: its host inputs, protocol and spec fields."""

    def __init__(self, inputs: Any, protocol: Protocol, spec: SpecConfig | None) -> None:
        self.inputs = inputs  # its HostInputs
        self.protocol = protocol
        self.spec = spec
        self.fields = spec.fields() if spec is not None else ()
        self.dp = inputs.dp
        self._decided: dict[Any, Decision] = {}

    def _remember(self, decided: dict[Any, Decision], sig: Any, decision: Decision) -> None:
        if sig is not None and self.inputs.single_process and len(decided) < MAX_LAYOUTS:
            decided[sig] = decision

    def resolve(
        self,
        batch: Batch | Mapping[int, Batch],
        rows: int | None = None,
        tokens: int | None = None,
        *,
        step: Sequence[StepInput] | None = None,
        inputs: Mapping[str, Any] | None = None,
        decided: dict[Any, Decision] | None = None,
    ) -> Placed:
        """A resolve, or (with `step`, the engine's declared inputs, and `decided`, that
        engine step's own layouts: another step declares other inputs) an engine step."""
        values = resolve_values(batch, step, inputs)
        sig = signature("step" if step is not None else "resolve", values, rows, tokens)
        if decided is None:
            decided = self._decided
        decision = decided.get(sig) if sig is not None else None
        if decision is not None:
            return decision.run(values)
        decision, given = self.decide(batch, rows, tokens, step, inputs)
        if sig is not None and (type(values[0]) is ForwardMode or isinstance(values[0], jax.Array)):
            self._remember(decided, sig, decision)  # a plain int or per-rank modes pick by value
        return decision.run(given)

    def tail(
        self,
        op: str,
        indices: Any,
        lens: Any,
        payload: Any,
        rows: int | None = None,
        *,
        confidence: Any = None,
    ) -> Placed:
        """publish (`payload` None), stash (`lens` None) or finish: slots, lengths, payload
        and (publish, finish) confidence rows."""
        values = (indices, lens, *payload_values(self.fields, payload), confidence)
        sig = signature(op, values, rows, None, kinds=payload_kind(payload))
        decision = self._decided.get(sig) if sig is not None else None
        if decision is not None:
            return decision.run(values)
        idx = self.inputs.flat("indices", indices, rows, slots=True)
        if idx.counts is not None and not any(idx.counts):  # DP idle: nothing to relay
            return Placed(Key(op, idx.size), (), None, idx.placed(indices))
        decision, given = self._decide_tail(op, idx, indices, lens, payload, confidence)
        self._remember(self._decided, sig, decision)
        return decision.run(given)

    def slots_op(self, op: str, indices: Any, rows: int | None = None) -> Placed:
        """`seq_lens_at` or (device slots) the sentinels of slots `indices`."""
        idx = self.inputs.flat("indices", indices, rows, slots=True).placed(indices)
        return Placed(Key(op, idx.size), (idx.array,), None, idx)

    def next_batch(self, batch: Any, indices: Any, idx: Rows, sentinels: Any = None) -> Any:
        """`batch` for the next step (docs/CONTRACT.md, 'Sentinels'): in the sentinel
        protocol its ids and lengths the sentinels of slots `indices`, host slots' made
        here, device slots' the `sentinels` made on the device."""
        protocol = self.protocol
        if not protocol.invalidates:
            return batch
        if idx.counts is not None and not idx.by_rank:  # host slots: their real rows
            sentinels = -np.asarray(indices, self.inputs.dtype)
        elif idx.counts is not None:
            sentinels = self.inputs.sentinels(indices, idx)
        ids, lens = sentinels if type(sentinels) is tuple else (sentinels, sentinels)
        b = batch  # rebuilt field by field: NamedTuple._replace costs ~1 us a step
        return type(b)(b.forward_mode, b.req_pool_indices, ids, lens, *b[4:])

    def decide(
        self,
        batch: Batch | Mapping[int, Batch],
        rows: int | None,
        tokens: int | None,
        step: Sequence[StepInput] | None,
        inputs: Mapping[str, Any] | None,
    ) -> tuple[Decision, tuple[Any, ...]]:
        """The decision of a resolve (or, with `step`, an engine step), and the values it
        places in decision order. Every refusal of a form, shape, count or bucket is here."""
        given = given_batch(batch, self.dp)
        rules = self.protocol.rules(self.spec, given.parts, by_rank=given.ranks is not None)
        ids = self._ids(given, rules)
        if ids is not None:
            rows, tokens = self._sizes(given.slots, ids, rows, tokens)
        modes = self._rank_modes(given)
        key, mode = self._mode_key(given.traced, modes, exact=step is not None)
        token_slots, draft = self._filled(given, ids)
        host = self.inputs
        idx = host.flat("req_pool_indices", given.slots, rows, slots=True)
        fid = None if ids is None else host.flat("input_ids", ids, tokens, slots=False)
        placers: list[Any] = [
            None if given.traced is not None else constant(mode),
            idx.place,
            None if fid is None else fid.place,
            host.matched("seq_lens", given.lens, idx),
            None,
            None,
        ]
        if given.ranks is None and ids is not given.ids:  # zeros, never read: placed once
            placers[2] = constant(None if fid is None else fid.placed(ids).array)
        if fid is not None and token_slots is not None:  # (a batch without ids has none)
            placers[5] = host.token_slots("token_slots", token_slots, fid).place
        if draft is not None:
            fdraft = host.flat("draft_indices", draft, idx.size, slots=True)
            if None not in (fdraft.counts, idx.counts) and fdraft.counts != idx.counts:
                raise FutureMapError(
                    f"draft_indices has {fdraft.counts} rows per rank, req_pool_indices "
                    f"{idx.counts}: one draft slot per row"
                )
            placers[4] = fdraft.place
        if fid is not None and given.traced is None:
            one_id_per_row(rules, modes, fid.counts, idx.counts)
        by_name = given_inputs(step, inputs) if step is not None else {}
        names = [d.name for d in step or ()]
        for d in step or ():
            like = idx if d.per == "row" or fid is None else fid
            placers.append(host.step_input(d, by_name[d.name], like))
        key = key._replace(
            op="resolve" if step is None else "step",
            rows=idx.size,
            tokens=idx.size if fid is None else fid.size,
            draft=draft is not None,
            slots=fid is not None and token_slots is not None,
            ids=fid is not None,
        )
        check = None
        if rules.zero_slots or rules.mixed_order:
            parts = None if given.ranks is None else [given.token_slots.get(r) for r in given.ranks]
            check = functools.partial(_batch_check, rules, modes, parts)

        def assemble(p: list[Any]) -> tuple[Any, ...]:
            b = Batch(*p[:6])
            return (b,) if step is None else (b, dict(zip(names, p[6:], strict=True)))

        decision = Decision(
            key, placers, assemble, idx=idx, idx_at=1, batch_check=check, packed=step is not None
        )
        head = (
            None if given.ranks is not None else batch.forward_mode,  # type: ignore[union-attr]
            given.slots,
            ids,
            given.lens,
            draft,
            token_slots if given.ranks is not None else given.token_slots,
        )
        return decision, head + tuple(by_name[n] for n in names)

    def _ids(self, given: Given, rules: Rules) -> Any:
        """The ids to place: as given, zeros (one per row) for the parts the rules say;
        None for a batch that places none (its ids gathered)."""
        if not rules.places_ids:
            return None
        dt = self.inputs.dtype
        if given.ranks is None:
            return _zeros(given.slots, dt) if rules.zero_ids else given.ids
        ids = dict(given.ids)
        for i in rules.zero_ids:
            r = given.ranks[i]
            ids[r] = _zeros(given.slots[r], dt)
        return ids

    def _sizes(
        self, slots: Any, ids: Any, rows: int | None, tokens: int | None
    ) -> tuple[int | None, int | None]:
        """A resolve's per-rank padded sizes (jax arrays keep the sizes they have)."""
        if isinstance(slots, jax.Array) or isinstance(ids, jax.Array):
            return rows, tokens
        batch_buckets, token_buckets = self.inputs.batch_buckets, self.inputs.token_buckets
        for size, buckets, what in (
            (rows, batch_buckets, "rows"),
            (tokens, token_buckets, "tokens"),
        ):
            if size is not None and size not in buckets:
                raise FutureMapError(f"{what}={size} is not one of the buckets {buckets}")
        n = rows if rows is not None else _rows_per_rank(slots, self.dp)
        t = tokens if tokens is not None else _rows_per_rank(ids, self.dp)
        if n is None or t is None:
            return rows, tokens  # not an array: placing it names the field
        return resolve_sizes(n, t, batch_buckets, token_buckets)

    def _rank_modes(self, given: Given) -> list[ForwardMode]:
        """The host modes, one per DP rank (a mapping's ranks left out are IDLE; a key that
        names no rank is refused placing its slots); for a Batch, its own."""
        if given.ranks is None:
            return list(given.modes)
        modes = [ForwardMode.IDLE] * self.dp
        for r, m in zip(given.ranks, given.modes, strict=True):
            if isinstance(r, int | np.integer) and not isinstance(r, bool) and 0 <= r < self.dp:
                modes[int(r)] = m
        return modes

    def _filled(self, given: Given, ids: Any) -> tuple[Any, Any]:
        """The token slots and draft slots to place: as given for a Batch; a mapping's for
        every rank (zeros where a rank gives none), None where no rank gives any (token
        slots: or no rank is MIXED)."""
        draft, slots = given.draft, given.token_slots
        if self.spec is None and (draft if given.ranks is not None else draft is not None):
            raise errors.draft_indices_on_plain_map()
        if given.ranks is None:
            return (slots if ids is not None else None), draft
        dt = self.inputs.dtype
        if slots and ForwardMode.MIXED in given.modes:
            slots = {r: slots.get(r, np.zeros(len(ids[r]), dt)) for r in given.ranks}
        else:
            slots = None
        if not draft:
            return slots, None
        for r, m in zip(given.ranks, given.modes, strict=True):
            if r not in draft and m == ForwardMode.DECODE:
                raise FutureMapError(
                    f"batch[rank {r}].draft_indices missing: beside ranks with a draft "
                    "input a spec DECODE rank brings its own (its lengths are gathered at "
                    "them)"
                )
        return slots, {r: draft.get(r, np.zeros(len(given.slots[r]), dt)) for r in given.ranks}

    @staticmethod
    def _mode_key(traced: Any, modes: list[ForwardMode], *, exact: bool) -> tuple[Key, Any]:
        """The resolve's key (its mode) and the mode the executable takes (None: fixed in
        it). A resolve's relay sees the kind only (DECODE or not); `exact` (an engine step,
        whose forward sees the mode): one executable per mode."""
        if traced is not None:
            return Key("resolve", 0, mode="traced"), traced  # rows not checked against it
        if exact:
            kinds: set[Any] = set(modes)
        else:
            kinds = {m == ForwardMode.DECODE for m in modes if m != ForwardMode.IDLE}
        if len(kinds) > 1:  # ranks differ: one executable with the modes traced
            return Key("resolve", 0, mode="traced"), np.asarray(modes, np.int32)
        if exact:
            return Key("resolve", 0, mode=ForwardMode(modes[0]).name.lower()), None
        return Key("resolve", 0, mode="decode" if kinds == {True} else "extend"), None

    def _decide_tail(
        self, op: str, idx: Rows, indices: Any, lens: Any, payload: Any, confidence: Any
    ) -> tuple[Decision, tuple[Any, ...]]:
        """A tail op's decision on slots `idx`, and the values it places in decision order
        (slots, lengths, the payload's leaves, confidence rows)."""
        inputs = self.inputs
        if confidence is not None and not confidence_width(self.spec):
            raise errors.confidence_not_declared()
        placers: list[Any] = [idx.place, None]
        if op != "stash":
            placers[1] = inputs.matched("new_seq_lens", lens, idx, relayed=True)
        leaves: tuple[Any, ...] = (None,) if self.spec is None else (None,) * len(self.fields)
        omits: tuple[str, ...] = ()
        if op != "publish":
            leaves, payload_placers = inputs.payload(payload, idx, self.spec, self.fields)
            placers += payload_placers
            if self.spec is not None:  # a partial stash: its own executable
                omits = tuple(f.name for f, v in zip(self.fields, leaves, strict=True) if v is None)
        else:
            placers += [None] * len(leaves)
        placers.append(
            None
            if confidence is None
            else inputs.matched("confidence", confidence, idx, CONFIDENCE_DTYPE)
        )
        key = Key(op, idx.size, confidence=confidence is not None, omits=omits)
        names = [f.name for f in self.fields]
        spec = self.spec

        def assemble(p: list[Any]) -> tuple[Any, ...]:
            conf = () if p[-1] is None else (p[-1],)
            if op == "publish":
                return (p[0], p[1], *conf)
            pay = p[2] if spec is None else draft_payload(dict(zip(names, p[2:-1], strict=True)))
            return (p[0], pay) if op == "stash" else (p[0], p[1], pay, *conf)

        decision = Decision(
            key,
            placers,
            assemble,
            idx=idx,
            idx_at=0,
            lens_at=None if op == "stash" else 1,
        )
        return decision, (indices, lens, *leaves, confidence)


def _batch_check(
    rules: Rules, modes: list[ForwardMode], parts: Any, values: Sequence[Any], placed: list[Any]
) -> None:
    """A batch's value rules (`validate.batch_values`) on a call."""
    given = (values[5],) if parts is None else parts
    batch_values(rules, modes, given, placed[1], placed[5])


def _zeros(rows: Any, dtype: np.dtype) -> Any:
    """Ids never read: zeros, one per row (None where `rows` has no length)."""
    try:
        return np.zeros(len(rows), dtype)
    except TypeError:
        return None


def _rows_per_rank(x: Any, dp: int) -> int | None:
    """Rows per DP rank of a host input (a mapping: its largest rank's); None: no length."""
    try:
        if isinstance(x, Mapping):
            return max((len(v) for v in x.values()), default=0)
        return len(x) // dp
    except TypeError:
        return None
