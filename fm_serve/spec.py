"""Speculative decoding with a model-free n-gram drafter (prompt lookup), through the relay.

The drafter proposes, for a request whose sequence (prompt and outputs) is h[0..L), the K
tokens that followed the latest earlier occurrence of its last n tokens (n from
`max_ngram` down to 1, the longest that occurs), extended periodically past the end
(a repetition "abcab" then proposes "cab..."); with no occurrence it repeats the last
token. It runs on the device from a per-slot token history, so the step that accepts
tokens also drafts the next step's K tokens without the host.

Per-slot device state, donated through the step beside the KV cache: `history` [R, S]
int32, the slot's token at each position. Invariant: after a step, positions [0, L) of a
live slot hold its verified sequence, L its published length (the bonus token at L - 1);
positions >= L hold stale tokens nothing reads (`propose` reads below L only).

One step (`make_spec_step`), a `fm_jax.FutureMap` engine step on a spec map of the gather
protocol whose `SpecConfig` relays the bonus tokens and an engine field `draft_tokens` [K]:
- EXTEND (a prefill chunk): writes the chunk's ids into the history, samples greedily at
  the chunk's last token, writes that token at position `seq_len`, publishes
  `seq_len + 1` and stashes the token as the bonus with the drafts proposed from it.
- DECODE (verify): resolve gathers each row's published length L, bonus token b and
  drafts d[0..K) at its slot (`draft_indices`); the forward feeds b at position L - 1 and
  d at L .. L + K - 1 (K + 1 positions in one forward), takes the greedy target t[j] at
  each, accepts the longest prefix a with d[j] == t[j] (j < a), and outputs t[0..a]:
  a + 1 tokens, t[a] the new bonus. It writes them at positions L .. L + a, publishes
  L + a + 1, and stashes t[a] with the drafts proposed from the updated history.
- MIXED (prefill chunks, then running rows): a running row feeds only its bonus token,
  gathered at its slot (`token_slots`), at position L - 1, and samples one token as a
  prefill's last token does (no drafts verified that step); its length, which resolve
  binds to the published one + 1, is taken back to L (`spec_forward`).
Rejected drafts leave K/V rows at positions >= L + a + 1; the next step writes from
L + a on before any token attends there (attention reads positions up to its own).

Tokens for the host: [B, K + 1] int32, each row's outputs then -1, and the drafts just
stashed [B, K] (a host that constrains the output advances its grammar over them).
Positions past the
model's `max_seq_len` (drafts of a request near its cap, or rows of a request already
finished but still in flight) are fed as padding (slot 0) and never accepted into the
history; the host keeps only outputs within the request's cap.

Greedy only (verification compares against the argmax): requests with a temperature or a
sampling feature are refused when speculative decoding is on.

With a grammar (`grammar`), a batch with a constrained row runs the step in two halves
around the class's resolve and finish (`make_spec_split`): the forward first; then the
host, once it has read the previous step's tokens and drafts, advances each constrained
request's matcher over its bonus token and tentatively over its drafts, one token bitmask
per verified position (`Scheduler._spec_masks`); the greedy choice at each position keeps
to its mask, and a draft is accepted only where it equals that choice, so every output
token is one the grammar allows after the tokens before it.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax
from fm_serve.served import ServedModel
from fm_serve.step import TOKEN_LAYOUT_INPUTS, allowed, host_out

MAX_DRAFT_TOKENS = 16
"""The most draft tokens per step (K)."""
MAX_NGRAM = 8
"""The longest n-gram the drafter looks up."""
DRAFT_FIELD = "draft_tokens"
"""The engine relay field that carries each slot's next drafts."""


class Ngram(NamedTuple):
    """The n-gram drafter's settings.

    Attributes:
      draft_tokens: K, tokens drafted and verified per step, in [1, MAX_DRAFT_TOKENS].
      max_ngram: the longest suffix looked up, in [1, MAX_NGRAM].
    """

    draft_tokens: int
    max_ngram: int = 3

    def check(self) -> Ngram:
        """Self, or ValueError naming the setting out of range."""
        k, n = self.draft_tokens, self.max_ngram
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"draft tokens (K) must be an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}"
            )
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NGRAM:
            raise ValueError(f"max n-gram must be an integer in [1, {MAX_NGRAM}], got {n!r}")
        return self

    def spec_config(self) -> fm_jax.SpecConfig:
        """The map's relay: bonus tokens and the drafts [K] (no top-k, no hidden states)."""
        return fm_jax.SpecConfig(
            topk=0, extra=(fm_jax.RelayField(DRAFT_FIELD, (self.draft_tokens,)),)
        )


def init_history(pool_size: int, max_seq_len: int) -> jax.Array:
    """The zeroed per-slot token history [R, S] int32."""
    return jnp.zeros((pool_size, max_seq_len), jnp.int32)


def propose(history: jax.Array, slots: jax.Array, lens: jax.Array, ngram: Ngram) -> jax.Array:
    """Each row's K drafts [B, K] from its slot's history h[0..L) (module docstring).

    Costs O(B * S * max_ngram) compares: every start position is matched at once.
    """
    k, n_max = ngram.draft_tokens, ngram.max_ngram
    h = history[slots]  # [B, S]
    s = h.shape[1]
    lens = jnp.clip(lens, 1, s)
    best_j = jnp.full(lens.shape, -1, jnp.int32)
    best_n = jnp.ones(lens.shape, jnp.int32)
    for n in range(n_max, 0, -1):
        if n >= s:
            continue
        starts = jnp.arange(s - n + 1, dtype=jnp.int32)
        eq = jnp.ones((h.shape[0], s - n + 1), bool)
        for i in range(n):
            want = jnp.take_along_axis(h, jnp.clip(lens - n + i, 0, s - 1)[:, None], axis=1)
            eq = eq & (h[:, i : s - n + 1 + i] == want)
        # An earlier occurrence: it ends before the suffix's last token (j + n <= L - 1).
        valid = starts[None, :] <= (lens - 1 - n)[:, None]
        j = jnp.max(jnp.where(eq & valid, starts[None, :], -1), axis=1)
        take = (best_j < 0) & (j >= 0)
        best_j = jnp.where(take, j, best_j)
        best_n = jnp.where(take, n, best_n)
    found = best_j >= 0
    start = best_j + best_n  # <= L - 1: the first token after the occurrence
    period = jnp.maximum(lens - best_n - best_j, 1)  # the suffix repeats with this period
    m = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    over = m >= lens[:, None]
    m = jnp.where(over, m - period[:, None] * ((m - lens[:, None]) // period[:, None] + 1), m)
    m = jnp.where(found[:, None], m, (lens - 1)[:, None])
    return jnp.take_along_axis(h, jnp.clip(m, 0, s - 1), axis=1)


def _write(history: jax.Array, slots: jax.Array, positions: jax.Array, ids: jax.Array, ok: Any):
    """history[slot, position] = id where `ok` (elsewhere nothing: out-of-range rows drop)."""
    r, s = history.shape
    where = jnp.where(ok & (slots > 0) & (positions >= 0) & (positions < s), slots, r)
    return history.at[where, jnp.clip(positions, 0, s - 1)].set(ids, mode="drop")


SPEC_INPUTS = TOKEN_LAYOUT_INPUTS
"""The spec step's own host arrays (the token layout, no sampling inputs: greedy only)."""


def check_spec_map(fm: fm_jax.FutureMap, ngram: Ngram) -> None:
    """ValueError naming what is missing when `fm` cannot relay this drafter's payload: a
    spec config (bonus tokens and a `draft_tokens` field of K ints), the gather protocol."""
    spec = fm.spec
    if spec is None:
        raise ValueError(
            "the n-gram drafter needs a spec map: this FutureMap was built without a "
            f"SpecConfig (build it with spec={ngram.spec_config()!r})"
        )
    fields = {f.name: f for f in spec.extra}
    field = fields.get(DRAFT_FIELD)
    if not spec.bonus_tokens or field is None or tuple(field.shape) != (ngram.draft_tokens,):
        raise ValueError(
            f"the n-gram drafter needs a spec map relaying bonus tokens and a "
            f"'{DRAFT_FIELD}' field of shape ({ngram.draft_tokens},); this map's spec is {spec}"
        )
    if fm.protocol != "gather":
        raise ValueError(f"the n-gram drafter needs the gather protocol, got {fm.protocol!r}")


def spec_forward(
    model: ServedModel,
    k: int,
    decode: bool,
    params: Any,
    cache: Any,
    history: jax.Array,
    inputs: dict[str, jax.Array],
    ids: jax.Array,
    lens: jax.Array,
    draft: fm_jax.DraftPayload | None,
    relay_slots: jax.Array | None = None,
) -> tuple[Any, jax.Array, jax.Array, jax.Array]:
    """The spec step's forward on resolved ids, lengths and draft: (cache, history,
    logits, lengths) with logits [B * (K + 1), V] (DECODE: each row's K + 1 verified
    positions, row-major) or [B, V] (EXTEND, MIXED: each row's last token). A prefill
    writes its ids into the history here; the sampled tokens are written by `spec_accept`.

    MIXED (`relay_slots`, each token's relay slot, nonzero at a running row's one token):
    resolve bound a running row's length to the published one + 1 (fm_jax's rule: its
    published length leaves out the bonus token), while this step publishes lengths that
    hold it; the lengths returned (and used here) are the running rows' published ones,
    so the row feeds its bonus token at L - 1 as a verify would, and samples one token.
    """
    rows, tok_slots, off = inputs["token_rows"], inputs["token_slots"], inputs["token_offsets"]
    s_max = model.max_seq_len
    if relay_slots is not None:
        running = jnp.zeros(lens.shape, bool).at[rows].max(relay_slots > 0)
        lens = jnp.where(running, lens - 1, lens)
    if decode:
        assert draft is not None and draft.extras is not None
        bonus: Any = draft.bonus_tokens
        drafts: Any = draft.extras[DRAFT_FIELD]
        ids = jnp.where(off == 0, bonus[rows], drafts[rows, jnp.clip(off - 1, 0, k - 1)])
        pos = (lens - 1)[rows] + off
    else:
        pos = (lens - inputs["extend_lens"])[rows] + off
    live = (tok_slots > 0) & (pos >= 0) & (pos < s_max)
    fed_slots, fed_pos = jnp.where(live, tok_slots, 0), jnp.where(live, pos, 0)
    if decode:
        first = jnp.clip(inputs["last_token"] - k, 0, None)
        at = (first[:, None] + jnp.arange(k + 1)[None, :]).reshape(-1)
        logits, cache = model.forward(params, cache, ids, fed_slots, fed_pos, at)
    else:
        history = _write(history, tok_slots, pos, ids, live)
        logits, cache = model.forward(params, cache, ids, fed_slots, fed_pos, inputs["last_token"])
    return cache, history, logits, lens


def spec_accept(
    ngram: Ngram,
    decode: bool,
    logits: jax.Array,
    masks: jax.Array | None,
    slots: jax.Array,
    lens: jax.Array,
    draft: fm_jax.DraftPayload | None,
    history: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The spec step's greedy choice and verification (module docstring): (history,
    tokens [B, K + 1], new lengths [B], bonus tokens [B], next drafts [B, K]).

    `masks`: None, or token bitmasks [B, K + 1, ceil(V / 32)] (DECODE: one per verified
    position) or [B, 1, ceil(V / 32)] (EXTEND) that the greedy choice keeps to (logits
    outside a mask are -inf). A draft is accepted where it equals the masked choice."""
    k = ngram.draft_tokens
    if masks is not None:
        words = masks.reshape(-1, masks.shape[-1])
        logits = jnp.where(allowed(words, logits.shape[-1]), logits, -jnp.inf)
    if decode:
        assert draft is not None and draft.extras is not None
        drafts: Any = draft.extras[DRAFT_FIELD]
        b = slots.shape[0]
        target = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(b, k + 1)
        agree = (drafts == target[:, :k]).astype(jnp.int32)
        accepted = jnp.sum(jnp.cumprod(agree, axis=1), axis=1)  # a in [0, K]
        keep = jnp.arange(k + 1)[None, :] <= accepted[:, None]
        where = lens[:, None] + jnp.arange(k + 1)[None, :]
        history = _write(
            history, jnp.broadcast_to(slots[:, None], where.shape), where, target, keep
        )
        new_lens = lens + accepted + 1
        new_bonus = jnp.take_along_axis(target, accepted[:, None], axis=1)[:, 0]
        tokens = jnp.where(keep, target, -1)
    else:
        new_bonus = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        history = _write(history, slots, lens, new_bonus, True)
        new_lens = lens + 1
        pad = jnp.full((slots.shape[0], k), -1, jnp.int32)
        tokens = jnp.concatenate([new_bonus[:, None], pad], axis=1)
    drafts_next = propose(history, slots, new_lens, ngram)
    return history, tokens, new_lens, new_bonus, drafts_next


def _is_decode(batch: Any, res: fm_jax.Resolved) -> bool:
    # A DECODE batch without drafts is never served (warm-up compiles one): it runs as a
    # prefill of the ids it brings.
    return int(batch.forward_mode) == int(fm_jax.ForwardMode.DECODE) and res.draft is not None


def make_spec_step(model: ServedModel, fm: fm_jax.FutureMap, ngram: Ngram) -> fm_jax.EngineStep:
    """The speculative step: `step(batch, params, cache, history, inputs=layout) ->
    StepResult(out=(cache, history, tokens [B, K + 1], (drafts [B, K],)))`, one dispatch
    with the cache, the history and the map's state donated (module docstring). The
    drafts are the ones stashed for the next step, copied for a host that advances a
    grammar over them (`SpecSplit`).

    Raises:
      ValueError: `fm` is not a spec map of the gather protocol relaying this drafter's
        payload (`check_spec_map`).
    """
    ngram = ngram.check()
    check_spec_map(fm, ngram)
    k = ngram.draft_tokens

    def forward(
        res: fm_jax.Resolved,
        batch: Any,
        inputs: dict[str, jax.Array],
        params: Any,
        cache: Any,
        history: jax.Array,
    ) -> fm_jax.StepOutput:
        decode, slots = _is_decode(batch, res), batch.req_pool_indices
        mixed = int(batch.forward_mode) == int(fm_jax.ForwardMode.MIXED)
        relay = batch.token_slots if mixed else None
        cache, history, logits, lens = spec_forward(
            model,
            k,
            decode,
            params,
            cache,
            history,
            inputs,
            res.input_ids,
            res.seq_lens,
            res.draft,
            relay,
        )
        history, tokens, new_lens, bonus, drafts_next = spec_accept(
            ngram, decode, logits, None, slots, lens, res.draft, history
        )
        payload = fm_jax.DraftPayload(bonus_tokens=bonus, extras={DRAFT_FIELD: drafts_next})
        return fm_jax.StepOutput(new_lens, payload, (cache, history, tokens, (drafts_next,)))

    return fm.engine_step(
        forward,
        inputs=SPEC_INPUTS,
        donate_argnums=(1, 2),
        host_out=host_out,
        compiler_options={},
    )


class SpecSplit(NamedTuple):
    """The speculative step in two jitted halves around the class's resolve and finish,
    split at the greedy choice (a constrained batch, `grammar`):

    `forward(params, cache, history, inputs, ids, lens, draft, relay_slots, decode=) ->
    (cache, history, logits, lens)` (`spec_forward`; cache and history donated) and
    `accept(logits,
    masks, slots, lens, draft, history, decode=) -> (history, tokens, new lens, bonus,
    drafts)` (`spec_accept`; history donated); `inputs` the `SPEC_INPUTS` padded to
    resolve's shapes, `decode` static.
    """

    forward: Any
    accept: Any


@functools.cache
def make_spec_split(model: ServedModel, ngram: Ngram) -> SpecSplit:
    """The split speculative step (`SpecSplit`), cached per model and drafter."""
    ngram = ngram.check()
    k = ngram.draft_tokens

    def forward(params, cache, history, inputs, ids, lens, draft, relay, decode):  # type: ignore[no-untyped-def]
        return spec_forward(
            model, k, decode, params, cache, history, inputs, ids, lens, draft, relay
        )

    def accept(logits, masks, slots, lens, draft, history, decode):  # type: ignore[no-untyped-def]
        return spec_accept(ngram, decode, logits, masks, slots, lens, draft, history)

    return SpecSplit(
        jax.jit(forward, donate_argnums=(1, 2), static_argnames="decode"),
        jax.jit(accept, donate_argnums=(5,), static_argnames="decode"),
    )


def spec_inputs(inputs: Any, b: int, t: int) -> dict[str, np.ndarray]:
    """The spec step's declared inputs of a scheduled batch's `StepInputs`, real rows only."""
    return {
        "extend_lens": inputs.extend_lens[:b],
        "last_token": inputs.last_token[:b],
        "token_rows": inputs.token_rows[:t],
        "token_slots": inputs.token_slots[:t],
        "token_offsets": inputs.token_offsets[:t],
    }
