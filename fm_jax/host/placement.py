"""Placement: what a caller passes, turned into one executable's key and arguments.

The one place where a batch (or a mapping DP rank -> Batch), the tail's slots, lengths and
payload, and an engine step's declared inputs become what an executable takes. A call's
layout (its op, sizes, and each value's kind, shape and dtype: `decisions.signature`) is
decided once: sizes, modes, buckets, the protocol's host rules, the key and each value's
placer (`host_batch` for a batch, here for the tail). Every call of a layout, its first
included, is placed by running that decision: the value checks, the padding and (an engine
step) the packing into one buffer. Nothing runs and nothing is written: a refusal leaves
the map as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from fm_jax.host.decisions import Decision, Field, Key, Placed, Rows, signature
from fm_jax.host.host_batch import BatchPlacement
from fm_jax.host.host_inputs import HostInputs
from fm_jax.host.validate import StepInput
from fm_jax.ops import errors
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import Protocol
from fm_jax.ops.relay_fields import DraftPayload, SpecConfig, draft_payload, payload_rows
from fm_jax.ops.types import CONFIDENCE_DTYPE, Batch, ForwardMode, confidence_width

MAX_LAYOUTS = 4096
"""Layouts a map remembers. A serving loop repeats a few hundred (a decode batch's rows, a
prefill's token count); past this many, a new layout is decided at each of its calls."""


class Placement:
    """Placement for one map: its layout, pool, int dtype, buckets, protocol and spec.

    Args:
      inputs: the map's host-input decisions.
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
        self._decided: dict[Any, Decision] = {}

    def _remember(self, sig: Any, decision: Decision) -> None:
        if sig is not None and self.inputs.single_process and len(self._decided) < MAX_LAYOUTS:
            self._decided[sig] = decision

    # ------------------------------------------------------------------ entry points
    def resolve(
        self,
        batch: Batch | Mapping[int, Batch],
        rows: int | None = None,
        tokens: int | None = None,
        *,
        step: Sequence[StepInput] | None = None,
        inputs: Mapping[str, Any] | None = None,
    ) -> Placed:
        """A resolve, or (with `step`, the engine's declared inputs) an engine step."""
        values = _resolve_values(batch, step, inputs)
        sig = signature("step" if step is not None else "resolve", values, rows, tokens)
        decision = self._decided.get(sig) if sig is not None else None
        if decision is not None:
            return decision.run(values)
        decision, given = self._batches.decide(batch, rows, tokens, step, inputs)
        if sig is not None and (type(values[0]) is ForwardMode or isinstance(values[0], jax.Array)):
            self._remember(sig, decision)  # a plain int or per-rank modes pick by value
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
        values = (indices, lens, *_payload_values(self.fields, payload), confidence)
        sig = signature(op, values, rows, None, kinds=_payload_kind(payload))
        decision = self._decided.get(sig) if sig is not None else None
        if decision is not None:
            return decision.run(values)
        idx = self.inputs.flat("indices", indices, rows, slots=True)
        if idx.counts is not None and not any(idx.counts):  # DP idle: nothing to relay
            return Placed(Key(op, idx.size), (), None, idx.rows(indices))
        decision, given = self._decide_tail(op, idx, indices, lens, payload, confidence)
        self._remember(sig, decision)
        return decision.run(given)

    def slots_op(self, op: str, indices: Any, rows: int | None = None) -> Placed:
        """The sentinels or `seq_lens_at` of slots `indices`."""
        idx = self.inputs.flat("indices", indices, rows, slots=True).rows(indices)
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
    def _decide_tail(
        self, op: str, idx: Field, indices: Any, lens: Any, payload: Any, confidence: Any
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
            leaves, payload_placers = self._payload(payload, idx)
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
        given = (lens, payload) if op == "finish" else lens if op == "publish" else payload
        on_dev = on_device((given, confidence))
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
            key_for=lambda rows: self._checked(rows, on_dev),
        )
        return decision, (indices, lens, *leaves, confidence)

    def _payload(self, payload: Any, idx: Field) -> tuple[tuple[Any, ...], list[Any]]:
        """Stash's payload (tokens or a DraftPayload, or a mapping of ranks of them) laid
        out like `idx`: its leaves (tokens, or each declared field's rows, None where no
        rank gives it) and their placers."""
        inputs = self.inputs
        drafts = list(payload.values()) if isinstance(payload, Mapping) else [payload]
        if not drafts and self.spec is not None:
            raise errors.tokens_on_spec_map(per_rank=True)
        for p in drafts:  # each rank's payload: its kind and declared fields, as the ops judge
            payload_rows(self.spec, p)
        if self.spec is None:
            return (payload,), [inputs.matched("tokens", payload, idx, relayed=True)]
        for p in drafts:  # the fields each rank's draft writes (rf.carried)
            rf.carried(self.fields, p)
        leaves, placers = [], []
        for f in self.fields:
            name = f"draft.{f.name}"
            if isinstance(payload, Mapping):
                value: Any = {r: rf.get(p, f.name) for r, p in payload.items()}
                if any(v is None for v in value.values()):
                    if not all(v is None for v in value.values()):
                        raise FutureMapError(f"{name} given on some ranks only")
                    value = None
            else:
                value = rf.get(payload, f.name)
            leaves.append(value)
            placers.append(
                None
                if value is None
                else inputs.matched(name, value, idx, f.dtype, relayed=f.consumed)
            )
        return tuple(leaves), placers


def on_device(x: Any) -> bool:
    """Whether `x` (an input as the caller gave it: rows, a DraftPayload, a mapping or a
    tuple of them) holds a jax array: not read on the host, so a debug map checks it on the
    device."""
    if type(x) is np.ndarray:  # the per-step case, kept short
        return False
    if isinstance(x, jax.Array):
        return True
    if isinstance(x, Mapping):
        x = list(x.values())
    return isinstance(x, tuple | list) and any(on_device(v) for v in x)


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
    """A tail call's payload leaves in decision order (a DraftPayload: its declared fields)."""
    if type(payload) is DraftPayload:
        if payload.extras is not None and type(payload.extras) is not dict:
            return (payload,)  # refused when decided, named there
        return tuple(rf.get(payload, f.name) for f in fields)
    if payload is None:  # a publish: no payload leaves
        return (None,) * max(len(fields), 1)
    return (payload,)


def _payload_kind(payload: Any) -> Any:
    """What a payload is, for a layout's signature: tokens, or a DraftPayload's field set."""
    if type(payload) is DraftPayload:
        extras = () if payload.extras is None else tuple(sorted(payload.extras))
        return ("draft", extras)
    return "rows"
