"""The deterministic toy model, written once over a small array backend.

Integer-exact: every product stays below 2**31 (operands reduced mod P = 46337 first), so
int32 and int64 give the same numbers and no framework's overflow rule matters.

- Non-spec: next token = hash(last input id, position, slot) mod V; position is the
  resolved `seq_lens - 1`, so a wrong token or a wrong length changes everything after.
- Spec: accept length in [1, K + 1] and the next bonus token hash the gathered draft
  (bonus token, top-k ids, the raw bits of `topk_p` and of the bf16 `hidden_states`),
  the position and the slot. Draft floats are built from integer bit patterns through
  bitcasts, never by float arithmetic: the table includes quiet and signalling NaNs with
  payloads, -0.0, +-inf and denormals, so both frameworks produce identical bytes.
- Spec with an engine's own fields (`Layout.extras`, SGLang's payloads as
  fm_parity.payloads declares them): each is built from the draft's hash (floats through
  bitcasts of the same special table) and the verify hashes every value gathered (a
  field the map gathers as None, never stashed, is left out). An
  n-gram draft relays no bonus token: its accepted tokens (`accepted` columns, the bonus
  token last, 0 after) and its accept length (`accept_len`); the verify takes its last
  token from them.
- Spec with verified ids (asked for with `verified=True`): each draft also carries the
  row's verified id, the last token verified before its bonus token (a prefill's last
  prompt token; after a verify, the last accepted draft token, or the previous bonus
  token when no draft was accepted). It is a token like the others (offset included, so
  >= 0), and the verify hashes the gathered one: a wrong or stale verified id changes the
  accept length and every token after it. Without verified ids nothing changes.

Backends (numpy here, jax in toy_model_jax, torch in toy_model_torch) supply `where`,
`stack`, casts and bitcasts; the arithmetic below is shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import ml_dtypes  # numpy's bfloat16 (a dependency of jax)
import numpy as np

P = 46_337  # prime, P * P < 2**31
MUL = 40_503
VOCAB = 32_003
WIDE_OFFSET = 2**32
"""int64 runs shift every token id above 2**32, so a truncating cast cannot hide."""


def token_offset(dtype: str) -> int:
    """What every token id of a run in `dtype` is shifted by (WIDE_OFFSET for int64)."""
    return WIDE_OFFSET if dtype == "int64" else 0


F32_SPECIALS = (
    0x7FC0_0000,  # quiet NaN
    0x7FC0_1234,  # quiet NaN with payload
    -0x0040_0000,  # 0xFFC00000: negative quiet NaN
    -0x8000_0000,  # 0x80000000: -0.0
    0,  # +0.0
    0x7F80_0000,  # +inf
    -0x0080_0000,  # 0xFF800000: -inf
    1,  # smallest denormal
    0x3F80_0000,  # 1.0
    0x7F80_0001,  # signalling NaN
    0x7FBF_FFFF,  # signalling NaN, full payload
    -0x7FFF_FFFF,  # 0x80000001: negative denormal
)
BF16_SPECIALS = (
    0x7FC0,  # quiet NaN
    0x7FC1,  # quiet NaN with payload
    -0x0040,  # 0xFFC0: negative quiet NaN
    -0x8000,  # 0x8000: -0.0
    0,  # +0.0
    0x7F80,  # +inf
    -0x0080,  # 0xFF80: -inf
    1,  # denormal
    0x3F80,  # 1.0
    0x7F81,  # signalling NaN
)


class Backend(Protocol):
    """Array operations the model needs beyond +, *, % (floor modulo in all backends)."""

    def where(self, cond: Any, a: Any, b: Any) -> Any: ...
    def stack(self, xs: list[Any]) -> Any: ...  # along a new last axis
    def column(self, x: Any, k: int) -> Any: ...  # x[:, k]
    def take(self, x: Any, idx: Any) -> Any: ...  # x[idx]
    def to_int(self, x: Any, like: Any) -> Any: ...  # cast to like's int dtype
    def f32_from_bits(self, bits: Any) -> Any: ...  # int (values fit int32) -> float32
    def bf16_from_bits(self, bits: Any) -> Any: ...  # int (values fit int16) -> bfloat16
    def bits_of_f32(self, x: Any, like: Any) -> Any: ...  # float32 -> int32 bits, as like
    def bits_of_bf16(self, x: Any, like: Any) -> Any: ...  # bfloat16 -> int16 bits, as like


class Draft(NamedTuple):
    """A draft as the model writes it: bonus token, top-k (ids, probs), hidden states, the
    verified id when the run relays one, and the engine's own fields by name. As gathered
    for a verify, a field the map does not relay is None."""

    bonus: Any  # [B] int
    topk_p: Any  # [B, K] float32
    topk_index: Any  # [B, K] int
    hidden: Any  # [B, H] bfloat16, or None when H == 0
    verified: Any = None  # [B] int, or None when the run relays no verified ids
    extras: dict[str, Any] | None = None  # [B, width] (width 0: [B]) per Layout.extras


class Extra(NamedTuple):
    """An engine's own draft field: its name, width (0: one value per row) and what it
    holds: 'f32' (float bits from the special table), 'int' (ids >= 0), 'accepted' (the
    tokens a verify accepted, the bonus token last, 0 after) or 'accept_len' (how many)."""

    name: str
    width: int
    kind: str


class Layout(NamedTuple):
    """A spec run's draft: top-k width K (also the draft count: accept in [1, K + 1]),
    hidden width H, the engine's own fields, and whether the map relays the bonus token
    and the top-k fields (an n-gram draft relays only its own fields)."""

    topk: int
    hidden: int
    extras: tuple[Extra, ...] = ()
    relays_standard: bool = True


def mix(acc: Any, x: Any) -> Any:
    """One hashing step: (acc * MUL + x mod P) mod P; acc in [0, P) keeps it below 2**31."""
    return (acc * MUL + x % P) % P


def next_token(last_ids: Any, seq_lens: Any, slots: Any, offset: int) -> Any:
    """The token after `last_ids` at position `seq_lens - 1` in `slots`."""
    h = mix(mix(last_ids % P, seq_lens - 1), slots)
    return h % VOCAB + offset


def _pattern(b: Backend, u: Any, specials: tuple[int, ...], regular: Any) -> Any:
    """specials[u mod 32] when in range, else `regular` (all ints)."""
    sel = u % 32
    out = regular
    for i, v in enumerate(specials):
        out = b.where(sel == i, v, out)
    return out


def make_draft(
    b: Backend,
    bonus: Any,
    pos: Any,
    slots: Any,
    spec: Layout,
    offset: int,
    verified: Any = None,
    accept: Any = None,
) -> Draft:
    """The draft that follows `bonus` at `pos` in `slots`. `verified` (the rows' verified
    ids, or None) is carried as given: the other fields do not depend on it. `accept` (the
    verify's accept lengths; None: a prefill's, 1) shapes the n-gram fields.
    """
    k_width, h_width = spec.topk, spec.hidden
    g = mix(mix(bonus % P, pos), slots)
    ids, probs = [], []
    for k in range(k_width):
        u = mix(g, 1000 + k)
        ids.append(u % VOCAB + offset)
        v = mix(u, 77)
        probs.append(_pattern(b, v, F32_SPECIALS, v * 1024 + 0x3C00_0000))
    hidden = None
    if h_width:
        cols = []
        for j in range(h_width):
            w = mix(g, 2000 + j)
            cols.append(_pattern(b, w, BF16_SPECIALS, w % 1024 + 0x3C00))
        # Stack the integer bits, then bitcast once: XLA's CPU concatenate and scatter of
        # bf16 canonicalise NaN payloads, a bitcast does not.
        hidden = b.bf16_from_bits(b.stack(cols))
    extras = {e.name: _extra(b, e, g, bonus, offset, accept) for e in spec.extras} or None
    return Draft(bonus, b.f32_from_bits(b.stack(probs)), b.stack(ids), hidden, verified, extras)


def _extra(b: Backend, e: Extra, g: Any, bonus: Any, offset: int, accept: Any) -> Any:
    """Field `e` of the draft hashed `g` (see Extra for what each kind holds)."""
    n = accept if accept is not None else bonus * 0 + 1
    if e.kind == "accept_len":
        return b.to_int(n, bonus)
    cols = []
    for j in range(max(e.width, 1)):
        u = mix(g, 3000 + 100 * len(e.name) + j)
        if e.kind == "f32":
            cols.append(_pattern(b, u, F32_SPECIALS, u * 1024 + 0x3C00_0000))
        elif e.kind == "accepted":  # accepted drafts, then the bonus token, then 0
            tok = b.where(j == n - 1, bonus, b.where(j < n - 1, u % VOCAB + offset, 0))
            cols.append(b.to_int(tok, bonus))
        else:
            cols.append(b.to_int(u, bonus))
    col = b.stack(cols)
    out = b.f32_from_bits(col) if e.kind == "f32" else col
    return out if e.width else b.column(out, 0)


def _last_accepted(b: Backend, draft: Draft, spec: Layout) -> Any:
    """An n-gram draft's last accepted token (its bonus token): `accepted[accept_len - 1]`."""
    by_kind = {e.kind: (draft.extras or {})[e.name] for e in spec.extras}
    toks, n = by_kind["accepted"], by_kind["accept_len"]
    last = b.column(toks, 0)
    for j in range(1, toks.shape[1]):
        last = b.where(n == j + 1, b.column(toks, j), last)
    return last


def forward_tokens(
    ids: Any, seq_lens: Any, slots: Any, last_index: Any, b: Backend, offset: int
) -> tuple[Any, Any]:
    """Non-spec forward: (next token, new length = seq_lens + 1) per row.

    `last_index[i]` is the position in flat `ids` of row i's last token.
    """
    tokens = next_token(b.take(ids, last_index), seq_lens, slots, offset)
    return tokens, seq_lens + 1


def forward_spec_extend(
    ids: Any,
    seq_lens: Any,
    slots: Any,
    last_index: Any,
    b: Backend,
    spec: Layout,
    offset: int,
    verified: bool = False,
) -> tuple[Any, Any, Draft]:
    """Spec prefill: (accept = 1, new length = seq_lens + 1, first draft). With `verified`,
    the draft's verified id is the row's last prompt token."""
    last = b.take(ids, last_index)
    bonus = next_token(last, seq_lens, slots, offset)
    new_lens = seq_lens + 1
    vid = last if verified else None
    draft = make_draft(b, bonus, new_lens - 1, slots, spec, offset, vid)
    return new_lens - seq_lens, new_lens, draft


def forward_spec_decode(
    draft: Draft,
    seq_lens: Any,
    slots: Any,
    b: Backend,
    spec: Layout,
    offset: int,
    verified: bool = False,
) -> tuple[Any, Any, Draft]:
    """Spec verify: (accept in [1, K + 1], new length = seq_lens + accept, next draft).

    With `verified`, the gathered `draft.verified` enters the hash (right after the slot)
    and the next draft carries the last token verified before its bonus: the accepted
    draft token `topk_index[:, accept - 2]`, or the gathered bonus token when accept is 1.
    The engine's own fields enter the hash after the standard ones, in declared order.
    """
    k_width, h_width = spec.topk, spec.hidden
    bonus_in = draft.bonus if spec.relays_standard else _last_accepted(b, draft, spec)
    h = mix(mix(bonus_in % P, seq_lens - 1), slots)
    if verified:
        if draft.verified is None:
            raise ValueError("forward_spec_decode(verified=True) needs the draft's verified ids")
        h = mix(h, draft.verified)
    if spec.relays_standard:
        p_bits = b.bits_of_f32(draft.topk_p, h)
        for k in range(k_width):
            h = mix(h, b.column(draft.topk_index, k))
            h = mix(h, b.column(p_bits, k))
        if h_width:
            h_bits = b.bits_of_bf16(draft.hidden, h)
            for j in range(h_width):
                h = mix(h, b.column(h_bits, j))
    for e in spec.extras:
        v = (draft.extras or {}).get(e.name)
        if v is None:  # a field no stash has written: the map gathers none
            continue
        bits = b.bits_of_f32(v, h) if e.kind == "f32" else v
        for j in range(e.width):
            h = mix(h, b.column(bits, j))
        if not e.width:
            h = mix(h, bits)
    accept = h % (k_width + 1) + 1
    new_lens = seq_lens + accept
    bonus = mix(h, accept) % VOCAB + offset
    vid = None
    if verified:
        vid = draft.bonus
        for k in range(k_width):  # accept == k + 2: drafts 0..k accepted, k the last
            vid = b.where(accept == k + 2, b.column(draft.topk_index, k), vid)
    nd = make_draft(b, bonus, new_lens - 1, slots, spec, offset, vid, accept)
    return accept, new_lens, nd


class NumpyBackend:
    """The model on host numpy arrays (the reference loop and PREBUILT bootstraps)."""

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return np.where(cond, a, b)

    def stack(self, xs: list[Any]) -> Any:
        return np.stack(xs, axis=-1)

    def column(self, x: Any, k: int) -> Any:
        return x[:, k]

    def take(self, x: Any, idx: Any) -> Any:
        return x[idx]

    def to_int(self, x: Any, like: Any) -> Any:
        return np.asarray(x).astype(like.dtype)

    def f32_from_bits(self, bits: Any) -> Any:
        return np.asarray(bits).astype(np.int32).view(np.float32)

    def bf16_from_bits(self, bits: Any) -> Any:
        return np.asarray(bits).astype(np.int16).view(ml_dtypes.bfloat16)

    def bits_of_f32(self, x: Any, like: Any) -> Any:
        return np.ascontiguousarray(x).view(np.int32).astype(like.dtype)

    def bits_of_bf16(self, x: Any, like: Any) -> Any:
        return np.ascontiguousarray(x).view(np.int16).astype(like.dtype)


NUMPY = NumpyBackend()


def prompt_tokens(
    rid: int, start: int, end: int, offset: int, own_from: int = 0, own: Sequence[int] = ()
) -> list[int]:
    """Prompt tokens [start, end) of request `rid` (host data, as the tokenizer gave them).
    A resumed request's prompt (`own_from` > 0) holds its own tokens `own` (what it produced,
    in order) from position `own_from` on."""
    cut = min(max(start, own_from), end) if own_from else end
    out = [(rid * 7919 + j * 104_729 + 1) % VOCAB + offset for j in range(start, cut)]
    if own_from:
        out += [int(t) for t in own[cut - own_from : end - own_from]]
    return out


def bootstrap(
    rid: int,
    prompt_len: int,
    slot: int,
    spec: Layout | None,
    offset: int,
    dtype: np.dtype,
    verified: bool = False,
) -> tuple[int, Draft | None]:
    """What a prefill node hands a PREBUILT request: its first token (and spec: draft, with
    `verified` its verified id, the last prompt token, as a spec prefill gives it).

    Returns (token, draft with one row) computed on the host with the numpy model.
    """
    last = np.array(prompt_tokens(rid, prompt_len - 1, prompt_len, offset), dtype=dtype)
    lens = np.array([prompt_len], dtype=dtype)
    sl = np.array([slot], dtype=dtype)
    tok = next_token(last, lens, sl, offset)
    if spec is None:
        return int(tok[0]), None
    return int(tok[0]), make_draft(NUMPY, tok, lens, sl, spec, offset, last if verified else None)


def concat_drafts(drafts: list[Draft], pad: int = 0) -> Draft:
    """Host drafts (numpy rows) stacked row-wise, then `pad` zero rows; a field every
    draft leaves None stays None."""

    def cat(parts: list[Any]) -> Any:
        if parts[0] is None:
            return None
        zeros = np.zeros((pad,) + parts[0].shape[1:], dtype=parts[0].dtype)
        return np.concatenate(parts + [zeros])

    extras = None
    if drafts[0].extras:
        extras = {k: cat([d.extras[k] for d in drafts if d.extras]) for k in drafts[0].extras}
    return Draft(
        cat([d.bonus for d in drafts]),
        cat([d.topk_p for d in drafts]),
        cat([d.topk_index for d in drafts]),
        cat([d.hidden for d in drafts]),
        cat([d.verified for d in drafts]),
        extras,
    )
