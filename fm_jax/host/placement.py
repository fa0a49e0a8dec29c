"""Placement: what a caller passes, turned into one executable's key and arguments.

The one place where a batch (or a mapping DP rank -> Batch), the tail's slots, lengths and
payload, and an engine step's declared inputs become what an executable takes. Sizes,
modes and buckets are worked out here, once per call; the protocol's host rules are asked
here; a class call's arguments come out as placed arrays, an engine step's as one packed
host buffer (`packing`) and its device leaves. Nothing runs and nothing is written: a
refusal leaves the map as it was.

A call whose layout was seen before (the same op, field kinds, shapes and dtypes) takes
its recorded `Plan` (plans.py): only the value checks, the padding copy and one lookup.
A layout's first two calls take the general path; the second records the plan, which is
kept only if it reproduced the general path's arguments byte for byte on that call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from fm_jax.host.host_batch import BatchPlacement
from fm_jax.host.host_inputs import HostInputs, Rows, on_device, row_kind
from fm_jax.host.keys import Key
from fm_jax.host.plans import Placed, Plan, Role, signature
from fm_jax.host.validate import StepInput
from fm_jax.ops import errors
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import Protocol
from fm_jax.ops.types import (
    CONFIDENCE_DTYPE,
    Batch,
    DraftPayload,
    ForwardMode,
    SpecConfig,
    confidence_width,
    draft_payload,
    payload_rows,
)

MAX_LAYOUTS = 4096
"""Layouts a map remembers (seen once, or planned). A serving loop repeats a few hundred
(a decode batch's rows, a prefill's token count); past this many, new layouts take the
general path every time (each still placed correctly, only not planned)."""

_UNSEEN, _SEEN_ONCE = object(), object()
"""A layout never seen, and one seen once: planned the second time it comes, so a layout
that comes once (a prefill's odd token count) never pays for recording a plan."""


class Placement:
    """Placement for one map: its layout, pool, int dtype, buckets, protocol and spec.

    Args:
      inputs: the map's host-input forms and value checks.
      protocol: the map's relay protocol.
      spec: the map's spec fields, or None.
      debug: the map checks its invariants on the device.
    """

    def __init__(
        self,
        inputs: HostInputs,
        protocol: Protocol,
        spec: SpecConfig | None,
        *,
        debug: bool,
    ) -> None:
        self.inputs = inputs
        self.debug = debug
        # Debug: the jax array of slots the last resolve checked on the device (set by the
        # map): a tail op or the sentinels at those very slots need no check of their own.
        self.last_checked: Callable[[], Any] = lambda: None
        self.protocol = protocol
        self.spec = spec
        self.fields = spec.fields() if spec is not None else ()
        self.dp = inputs.dp
        self._batches = BatchPlacement(inputs, protocol, spec)
        self._plans: dict[Any, Any] = {}  # layout -> Plan, _SEEN_ONCE, or None (not planned)

    # ------------------------------------------------------------------ entry points
    def resolve(
        self,
        batch: Batch | Mapping[int, Batch],
        rows: int | None = None,
        tokens: int | None = None,
        *,
        step: Sequence[StepInput] | None = None,
        inputs: Mapping[str, Any] | None = None,
        general: bool = False,
    ) -> Placed:
        """A resolve, or (with `step`, the engine's declared inputs) an engine step.

        `general` (warm-up) takes the general path and leaves the layout unrecorded."""
        if general:
            return self._place_resolve(batch, rows, tokens, step, inputs)
        values = _resolve_values(batch, step, inputs)
        sig = signature("step" if step is not None else "resolve", values, rows, tokens)
        plan = self._plans.get(sig, _UNSEEN) if sig is not None else None
        if type(plan) is Plan:
            return plan.run(values)
        placed = self._place_resolve(batch, rows, tokens, step, inputs)
        if plan is _SEEN_ONCE:
            self._plans[sig] = self._resolve_plan(placed, values, step)
        elif plan is _UNSEEN and len(self._plans) < MAX_LAYOUTS:
            self._plans[sig] = _SEEN_ONCE
        return placed

    def tail(
        self,
        op: str,
        indices: Any,
        lens: Any,
        payload: Any,
        rows: int | None = None,
        *,
        general: bool = False,
        confidence: Any = None,
    ) -> Placed:
        """publish (`payload` None), stash (`lens` None) or finish: slots, lengths, payload
        and (publish, finish) confidence rows (`general` as for `resolve`). A call with
        confidence rows takes the general path."""
        if general or confidence is not None:
            return self._place_tail(op, indices, lens, payload, rows, confidence)
        values = (indices, lens, *_payload_values(self.fields, payload))
        sig = signature(op, values, rows, None, kinds=_payload_kind(payload))
        plan = self._plans.get(sig, _UNSEEN) if sig is not None else None
        if type(plan) is Plan:
            return plan.run(values)
        placed = self._place_tail(op, indices, lens, payload, rows)
        if plan is _SEEN_ONCE and not placed.idx.empty:
            self._plans[sig] = self._tail_plan(placed, values)
        elif plan is _UNSEEN and len(self._plans) < MAX_LAYOUTS:
            self._plans[sig] = _SEEN_ONCE
        return placed

    def slots_op(self, op: str, indices: Any, rows: int | None = None) -> Placed:
        """The sentinels or `seq_lens_at` of slots `indices`."""
        idx = self.inputs.slots("indices", indices, rows)
        checked = self._checked(idx, False) if op == "sentinels" else True
        return Placed(Key(op, idx.size, checked=checked), (idx.array,), None, idx)

    def _checked(self, idx: Rows, values_on_device: bool) -> bool:
        """Whether a debug map's tail op checks its slots on the device: always for values
        given as jax arrays (checked there), never for host slots (checked here), and for
        jax-array slots unless they are the very array the last resolve checked. A map
        without debug has one executable per op: True."""
        if not self.debug or values_on_device:
            return True
        return idx.counts is None and idx.array is not self.last_checked()

    # ------------------------------------------------------------------ the tail
    def _place_tail(
        self,
        op: str,
        indices: Any,
        lens: Any,
        payload: Any,
        rows: int | None,
        confidence: Any = None,
    ) -> Placed:
        inputs = self.inputs
        if confidence is not None and not confidence_width(self.spec):
            raise errors.confidence_not_declared()
        idx = inputs.slots("indices", indices, rows)
        if idx.empty:
            return Placed(Key(op, idx.size), (), None, idx)  # DP idle: nothing to relay
        args: list[Any] = [idx.array]
        placed_lens = None
        if op != "stash":
            placed_lens = inputs.matched("new_seq_lens", lens, idx, relayed=True)
            args.append(placed_lens)
        omits: tuple[str, ...] = ()
        if op != "publish":
            placed = self._payload(payload, idx)
            args.append(placed)
            if self.spec is not None:  # a partial stash: its own executable
                omits = tuple(f.name for f in self.fields if rf.get(placed, f.name) is None)
        if confidence is not None:
            args.append(inputs.matched("confidence", confidence, idx, CONFIDENCE_DTYPE))
        given = (lens, payload) if op == "finish" else lens if op == "publish" else payload
        given = (given, confidence)
        key = Key(
            op,
            idx.size,
            checked=self._checked(idx, on_device(given)),
            confidence=confidence is not None,
            omits=omits,
        )
        return Placed(key, tuple(args), None, idx, placed_lens)

    def _payload(self, payload: Any, idx: Rows) -> Any:
        """Stash's payload (tokens or a DraftPayload) laid out like `idx`."""
        inputs = self.inputs
        drafts = list(payload.values()) if isinstance(payload, Mapping) else [payload]
        if not drafts and self.spec is not None:
            raise errors.tokens_on_spec_map(per_rank=True)
        for p in drafts:  # each rank's payload: its kind and declared fields, as the ops judge
            payload_rows(self.spec, p)
        if self.spec is None:
            return inputs.matched("tokens", payload, idx, relayed=True)
        for p in drafts:  # the fields each rank's draft writes (rf.carried)
            rf.carried(self.fields, p)

        def field(f: rf.RelayField) -> Any:
            """The field's rows placed like `idx` (None where no rank gives it)."""
            name = f"draft.{f.name}"
            if isinstance(payload, Mapping):
                got = {r: rf.get(p, f.name) for r, p in payload.items()}
                if any(v is None for v in got.values()):
                    if all(v is None for v in got.values()):
                        return None
                    raise FutureMapError(f"{name} given on some ranks only")
                return inputs.matched(name, got, idx, f.dtype, relayed=f.consumed)
            value = rf.get(payload, f.name)
            if value is None:
                return None
            return inputs.matched(name, value, idx, f.dtype, relayed=f.consumed)

        return draft_payload({f.name: field(f) for f in self.fields})

    # ------------------------------------------------------------------ resolve
    def _place_resolve(
        self,
        batch: Batch | Mapping[int, Batch],
        rows: int | None,
        tokens: int | None,
        step: Sequence[StepInput] | None = None,
        inputs: Mapping[str, Any] | None = None,
    ) -> Placed:
        """The general path (`host_batch`) of a resolve or an engine step."""
        return self._batches.place(batch, rows, tokens, step, inputs)

    # ------------------------------------------------------------------ plans
    def _resolve_plan(
        self, placed: Placed, values: tuple[Any, ...], step: Sequence[StepInput] | None
    ) -> Plan | None:
        """The plan of a resolve's (or a step's) layout, if it rebuilds `placed`."""
        mode, key = values[0], placed.key
        if not (type(mode) is ForwardMode or isinstance(mode, jax.Array)):
            return None  # a plain int or per-rank modes: their values pick the executable
        if not self.inputs.single_process:
            return None
        rows, tokens = key.rows, key.tokens
        roles = [
            Role(None, "forward_mode", 0, keep=isinstance(mode, jax.Array)),
            Role("slots", "req_pool_indices", rows),
            Role("ids", "input_ids", tokens),
            Role("ints", "seq_lens", rows),
            Role("slots", "draft_indices", rows),
            Role("slots", "token_slots", tokens),
        ]
        for d, x in zip(step or (), values[6:], strict=True):
            if type(x) is np.ndarray and x.dtype != d.dtype:
                return None  # a cast input: the general path casts it
            size = rows if d.per == "row" else tokens
            roles.append(Role(row_kind(d.dtype, False), f"inputs[{d.name!r}]", size, into=d.dtype))
        names = [d.name for d in step or ()]

        def assemble(p: list[Any]) -> tuple[Any, ...]:
            batch = Batch(*p[:6])
            return (batch,) if step is None else (batch, dict(zip(names, p[6:], strict=True)))

        plan = Plan(
            key,
            placed.pack,
            roles,
            assemble,
            self.inputs,
            values,
            counts=placed.idx.counts,
            batch_check=placed.check,
        )
        return Plan.record(placed, values, plan)

    def _tail_plan(self, placed: Placed, values: tuple[Any, ...]) -> Plan | None:
        """The plan of a tail op's layout (publish, stash, finish), if it rebuilds `placed`."""
        if not self.inputs.single_process:
            return None
        op, rows = placed.key.op, placed.key.rows
        roles = [
            Role("slots", "indices", rows),
            Role("relayed", "new_seq_lens", rows, keep=op != "stash"),
        ]
        if self.spec is None or op == "publish":
            roles.append(Role("relayed", "tokens", rows, keep=op != "publish"))
        else:
            roles += [
                Role(row_kind(f.dtype, f.consumed), f"draft.{f.name}", rows, into=f.dtype)
                for f in self.fields
            ]
        names = [f.name for f in self.fields]

        def payload(p: list[Any]) -> Any:
            return (
                p[2] if self.spec is None else draft_payload(dict(zip(names, p[2:], strict=True)))
            )

        def assemble(p: list[Any]) -> tuple[Any, ...]:
            if op == "publish":
                return (p[0], p[1])
            return (p[0], payload(p)) if op == "stash" else (p[0], p[1], payload(p))

        on_dev = any(isinstance(v, jax.Array) for v in values[1:])
        plan = Plan(
            placed.key,
            placed.pack,
            roles,
            assemble,
            self.inputs,
            values,
            counts=placed.idx.counts,
            lens_at=None if op == "stash" else 1,
            checked=lambda idx: self._checked(idx, on_dev),
        )
        return Plan.record(placed, values, plan)


def _resolve_values(
    batch: Any, step: Sequence[StepInput] | None, inputs: Mapping[str, Any] | None
) -> tuple[Any, ...]:
    """A resolve call's values in plan order: the batch's fields, then the declared inputs
    (an empty tuple for a call no plan can take: a mapping of ranks, inputs not a dict)."""
    if type(batch) is not Batch:
        return ()
    head = tuple(batch)
    if step is None:
        return head
    if inputs is None:  # no inputs given: as `{}` (refused later if some are declared)
        inputs = {}
    if type(inputs) is not dict or len(inputs) != len(step):
        return ()
    try:
        return head + tuple(inputs[d.name] for d in step)
    except KeyError:
        return ()


def _payload_values(fields: tuple[rf.RelayField, ...], payload: Any) -> tuple[Any, ...]:
    """A tail call's payload leaves in plan order (a DraftPayload: its declared fields)."""
    if type(payload) is DraftPayload:
        if payload.extras is not None and type(payload.extras) is not dict:
            return (payload,)  # refused by the general path, named there
        return tuple(rf.get(payload, f.name) for f in fields)
    return (payload,)


def _payload_kind(payload: Any) -> Any:
    """What a payload is, for a plan's signature: tokens, or a DraftPayload's field set."""
    if type(payload) is DraftPayload:
        extras = () if payload.extras is None else tuple(sorted(payload.extras))
        return ("draft", extras)
    return "rows"
