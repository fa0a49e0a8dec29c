"""The spec payloads parity relays, declared once for both twins (docs/guide.md, 'Relay
fields', has the same declarations for an engine).

- "eagle": the standard fields (bonus token, top-k probabilities and ids, bf16 hidden
  states, verified ids where the scenario asks for them).
- "sglang_eagle": SGLang's EAGLE `RelayPayload` today: the standard fields, then its
  draft probabilities ([K] float32) and DSA top-k indices (DSA_TOPK ints) as an engine's
  own fields.
- "ngram": SGLang's n-gram `RelayPayload`: no bonus token and no top-k, only its accepted
  tokens ([K + 1] ints) and accept length, zero-filled buffers (a row never stashed reads
  accept length 0).

A twin's DraftPayload (fm_jax's NamedTuple or fm_torch's dataclass) has the same field
names in both; `convert` maps one field by field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fm_parity import toy_model as tm
from fm_parity.scenario import Kind, SpecShape

DSA_TOPK = 4
"""Width of the toy's DSA top-k indices (SGLang's index top-k, scaled down)."""

STANDARD = ("bonus_tokens", "topk_p", "topk_index", "hidden_states", "verified_id")
"""A DraftPayload's standard fields, by their name in both twins."""


def layout(spec: SpecShape) -> tm.Layout:
    """The toy model's draft layout for a scenario's spec shape."""
    k = spec.topk
    if spec.payload == "eagle":
        return tm.Layout(k, spec.hidden)
    if spec.payload == "sglang_eagle":
        extras = (tm.Extra("draft_probs", k, "f32"), tm.Extra("dsa_topk_indices", DSA_TOPK, "int"))
        return tm.Layout(k, spec.hidden, extras)
    if spec.payload == "ngram":
        extras = (
            tm.Extra("accept_tokens", k + 1, "accepted"),
            tm.Extra("accept_lens", 0, "accept_len"),
        )
        return tm.Layout(k, 0, extras, relays_standard=False)
    raise ValueError(f"unknown spec payload {spec.payload!r}")


NEVER_STASHED = ("dsa_topk_indices",)
"""A partial scenario's fields no stash carries (a model without DSA relays no DSA
indices): every resolve gathers them as None (SGLang's DSA availability flag)."""


def omitted(spec: SpecShape, kind: Kind, step: int) -> tuple[str, ...]:
    """The fields a stash of a `kind` batch at scheduler step `step` leaves out (its rows
    keep what the slot held): none for full stashes. Partial ones: never the DSA indices;
    a DECODE batch's at every third step only its bonus token (and verified id: every
    consume-tracked field is in every stash), at the step after those no hidden states
    and draft probabilities. A prefill's (and a bootstrap's) carries the rest, so every
    field a verify reads was written by its own request."""
    if spec.stashes == "full":
        return ()
    if kind is not Kind.DECODE or step % 3 == 2:
        return NEVER_STASHED
    if step % 3 == 0:
        return ("topk_p", "topk_index", "hidden_states", "draft_probs", *NEVER_STASHED)
    return ("hidden_states", "draft_probs", *NEVER_STASHED)


def without(payload: Any, names: tuple[str, ...]) -> Any:
    """`payload` (a twin's DraftPayload) with the fields `names` left out (None)."""
    if not names:
        return payload
    kw = {k: None if k in names else getattr(payload, k) for k in STANDARD}
    extras = {k: v for k, v in (payload.extras or {}).items() if k not in names} or None
    return type(payload)(**kw, extras=extras)


def to_payload(payload_type: Any, draft: tm.Draft, spec: tm.Layout) -> Any:
    """The fields of `draft` the map relays, as `payload_type` (a twin's DraftPayload)."""
    extras = dict(draft.extras) if draft.extras else None
    if not spec.relays_standard:
        return payload_type(verified_id=draft.verified, extras=extras)
    return payload_type(
        draft.bonus,
        draft.topk_p,
        draft.topk_index,
        draft.hidden,
        verified_id=draft.verified,
        extras=extras,
    )


def gathered(payload: Any) -> tm.Draft:
    """What resolve gathered (a twin's DraftPayload) as the toy model's draft input."""
    extras = dict(payload.extras) if payload.extras else None
    return tm.Draft(
        payload.bonus_tokens,
        payload.topk_p,
        payload.topk_index,
        payload.hidden_states,
        payload.verified_id,
        extras,
    )


def convert(payload: Any, fn: Callable[[Any], Any]) -> Any:
    """`payload` (a twin's DraftPayload) with `fn` applied to every field given."""
    kw = {k: None if (v := getattr(payload, k)) is None else fn(v) for k in STANDARD}
    extras = {k: fn(v) for k, v in (payload.extras or {}).items()} or None
    return type(payload)(**kw, extras=extras)


def fields(payload: Any) -> dict[str, Any]:
    """Every field `payload` (a twin's DraftPayload) gives, by name (the engine's own by
    theirs)."""
    out = {k: v for k in STANDARD if (v := getattr(payload, k)) is not None}
    return out | dict(payload.extras or {})
