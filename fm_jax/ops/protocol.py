"""The two relay protocols as objects: the rules that differ between them (docs/CONTRACT.md,
'Two protocols'): a batch's form, what a step's tail leaves, the resolve variants warm-up
compiles. The host's value check of ids is `host/validate`'s (a steady call runs no ops)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fm_jax.ops import errors
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.types import ForwardMode, SpecConfig

PROTOCOLS = ("sentinel", "gather")  # the public names


class Part(NamedTuple):
    """One part of a batch as the host knows it before placing it: a Batch, or one DP
    rank's Batch of a mapping."""

    modes: tuple[ForwardMode, ...] | None  # known on the host (one, or one per rank); None: traced
    scalar: bool  # one mode, not an array of one per rank
    ids: bool  # it brings input ids
    slots: bool  # it brings token slots
    where: str  # its prefix in refusals: "" for a Batch, "batch[rank r]." for a rank


class Rules(NamedTuple):
    """What a protocol's rules leave to a batch's placement once its layout passed them."""

    places_ids: bool = True  # False: a gathered DECODE places no ids (T = B)
    zero_ids: tuple[int, ...] = ()  # parts without ids that place zeros (never read)
    ids_per_row: bool = False  # a DECODE batch (or rank) carries one id per row
    # (part, where, its kinds) whose token slots must all be 0 (a jax array is refused)
    zero_slots: tuple[tuple[int, str, str], ...] = ()
    mixed_order: bool = False  # spec MIXED: running rows last, in token-slot order


class Protocol:
    """A relay protocol: the host's rules, the tail's output and the warm-up variants."""

    def __init__(self, name: str) -> None:
        self.name = name  # 'sentinel' or 'gather', as the public API spells it
        self.invalidates = name == "sentinel"  # the tail leaves -slot sentinels
        gather = not self.invalidates
        # Resolve gathers a DECODE batch's ids at its slots (a non-spec one brings none).
        self.gathers_decode_ids = gather
        self.takes_token_slots = gather  # a MIXED batch names its running rows' slots per token
        self.serves_spec_mixed = gather  # resolve binds a spec MIXED batch's running lengths

    def __repr__(self) -> str:
        return f"Protocol({self.name!r})"

    def rules(self, spec: SpecConfig | None, parts: Sequence[Part], *, by_rank: bool) -> Rules:
        """Every rule of this protocol on a batch's layout (`parts`: the batch, or each DP
        rank's of a mapping, `by_rank`), asked once before anything is placed: refuses
        what its kinds and fields break (docs/CONTRACT.md, 'Two protocols'), and returns
        the rules left for the host values. Gather: a non-spec DECODE batch known on the
        host places no ids; a DECODE rank of a mapping places zeros, never read."""
        mixed = any(ForwardMode.MIXED in (p.modes or ()) for p in parts)
        if self.invalidates:
            for p in parts:
                if p.slots:
                    raise errors.token_slots_in_sentinel_protocol(p.where or "batch.")
            if spec is not None and mixed:
                raise errors.spec_mixed_in_sentinel_protocol()
            return Rules(ids_per_row=spec is None)
        places_ids, zero_ids, zero_slots = True, [], []
        for i, p in enumerate(parts):
            if p.modes is None:  # traced: its kind is known only on the device
                if not p.ids:
                    raise errors.no_ids_with_traced_mode(p.where)
                continue
            decode = p.scalar and p.modes == (ForwardMode.DECODE,)
            if decode and p.ids and spec is None:
                raise FutureMapError(
                    f"{p.where}input_ids given for a DECODE batch: in the gather protocol its "
                    "ids are gathered at req_pool_indices (pass None)"
                )
            if decode and not by_rank and not p.ids:
                if p.slots:
                    raise errors.token_slots_for_decode(p.where)
                places_ids = False  # T = B: the ids are gathered on the device
                continue
            if not p.ids:  # only a DECODE batch (or rank) comes without ids
                kinds = set(p.modes) - (set() if p.scalar else {ForwardMode.IDLE})
                if kinds - {ForwardMode.DECODE}:
                    raise errors.no_ids_for_kind("/".join(sorted(k.name for k in kinds)), p.where)
                zero_ids.append(i)
            if not p.slots and ForwardMode.MIXED in p.modes:
                raise errors.mixed_without_token_slots(p.where)
            if p.slots and p.modes == (ForwardMode.DECODE,):
                raise errors.token_slots_for_decode(p.where)
            if p.slots and ForwardMode.MIXED not in p.modes:
                kinds_named = "/".join(sorted({m.name for m in p.modes}))
                zero_slots.append((i, p.where, kinds_named))
        return Rules(
            places_ids=places_ids,
            zero_ids=tuple(zero_ids),
            zero_slots=tuple(zero_slots),
            mixed_order=spec is not None and mixed,
        )

    def sentinels(self, indices: jax.Array, ids: int) -> Any:
        """Inside a step's tail, on one rank's `indices`: the next batch's `ids` ids and its
        lengths (gather: None); one array where they have the same size (one output)."""
        if not self.invalidates:
            return None
        lens = -jnp.asarray(indices)
        pad = ids - lens.shape[0]
        return lens if pad <= 0 else (jnp.pad(lens, (0, pad)), lens)

    def resolve_variants(
        self, spec: SpecConfig | None, tokens: int, decode_tokens: int, traced: bool
    ) -> list[tuple[str, bool]]:
        """The (resolve mode, with token slots) pairs serving reaches at a token bucket:
        mode 'extend' (fixed, not DECODE), 'decode' (fixed DECODE) or 'traced' (a non-spec
        gather DECODE places no ids: its own variant, per batch bucket)."""
        slots = [False] if self.invalidates else [False, True]
        decode = spec is not None or (self.invalidates and tokens <= decode_tokens)
        extend = [("extend", s) for s in slots]
        return extend + [("decode", False)] * decode + [("traced", s) for s in slots if traced]

    def step_modes(self, spec: SpecConfig | None, with_slots: bool) -> list[ForwardMode]:
        """The modes an engine step serves where a resolve's variant is 'extend': every mode
        not DECODE that this protocol takes with (or without) token slots."""
        if not self.invalidates:
            return [ForwardMode.MIXED] if with_slots else [ForwardMode.EXTEND, ForwardMode.IDLE]
        mixed = [ForwardMode.MIXED] if spec is None else []
        return [ForwardMode.EXTEND, *mixed, ForwardMode.IDLE]


SENTINEL, GATHER = Protocol("sentinel"), Protocol("gather")


def parse_protocol(protocol: object) -> Protocol:
    """The Protocol named `protocol`; FutureMapError otherwise."""
    if isinstance(protocol, str) and protocol in PROTOCOLS:
        return SENTINEL if protocol == "sentinel" else GATHER
    raise FutureMapError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
