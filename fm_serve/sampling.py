"""Sampling settings, the per-slot sampler state kept on the device, and logit processing.

A request's settings (`Sampling`): presence, frequency and repetition penalties, banned
token sequences (bad words), top-k and top-p, logprobs, stop strings. Which of the device
features a run needs is static (`Features`, one compiled step per set): a feature no
request uses is not in the step at all, so it costs nothing.

Per-slot device state (`SamplerState`), donated through the step like the KV cache and
updated by the step itself, never by the host:
  - `counts` [R, V] int32: how often each token occurs among the slot's output tokens;
  - `seen` [R, V] int8: whether each token occurs in the slot's prompt or outputs;
  - `recent` [R, K] int32: the slot's token at position p is `recent[slot, p % K]`.
Each step first writes every input token of its rows into them (a decode row's input is
the token the previous step sampled, resolved on the device by the relay), then reads
them to process its logits. So step N+1 reads counts and recent tokens that include
step N's token although the host has not seen it yet, and a request resumed by
recomputing its prefix (prompt + outputs) rebuilds its counts by the same writes: a
token at a position >= the original prompt's length is an output.

Stale state: the first prefill chunk of a request in a slot (`fresh`) zeroes the slot's
`counts` and `seen` before the step's writes. `recent` needs no reset: a row at length p
reads positions p-1 .. p-K+1 only, which its own request wrote (every position below p
is written by a step the row's request ran, in device order, before the read).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax

MAX_LOGPROBS = 20
"""The most top logprobs a request may ask for."""
MAX_BAD_WORD_TOKENS = 8
"""The longest bad word, in tokens."""


@dataclass(frozen=True)
class Sampling:
    """A request's sampling settings beyond temperature and seed (defaults: all off).

    Attributes:
      presence_penalty: subtracted from the logit of every token already in the output,
        in [-2, 2].
      frequency_penalty: subtracted once per occurrence in the output, in [-2, 2].
      repetition_penalty: divides a positive logit (multiplies a negative one) of every
        token in the prompt or output, in (0, 2]; 1 is off.
      top_k: keep the k most likely tokens when sampling (0: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches p,
        in (0, 1]; 1 is off.
      logprobs: return the sampled token's logprob and the top `logprobs` (0..20), of the
        model's logits before any processing (log-softmax of the raw logits).
      bad_words: token sequences never produced: when the sequence's tokens but the last
        are the latest tokens (prompt and output), its last token is banned.
      stop: texts that end the request once its output text contains one (needs the
        engine's `decode`); the tokens up to the one that completed it are kept.
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    logprobs: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()
    stop: tuple[str, ...] = ()

    @property
    def penalised(self) -> bool:
        """Some penalty is on."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def filtered(self) -> bool:
        """Top-k or top-p is on."""
        return self.top_k != 0 or self.top_p != 1.0

    def check(self, vocab: int, temperature: float = 0.0, seed: int = 0) -> None:
        """Raise ValueError naming the first setting out of range."""

        def bad(name: str, value: Any, want: str) -> None:
            raise ValueError(f"{name} must be {want}, got {value!r}")

        def finite(v: Any) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        if not finite(temperature) or temperature < 0:
            bad("temperature", temperature, "a finite number >= 0")
        if not isinstance(seed, int) or not 0 <= seed < 2**31:
            bad("seed", seed, "an integer in [0, 2**31)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not finite(v) or not -2.0 <= v <= 2.0:
                bad(name, v, "a finite number in [-2, 2]")
        r = self.repetition_penalty
        if not finite(r) or not 0.0 < r <= 2.0:
            bad("repetition_penalty", r, "a finite number in (0, 2]")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= vocab:
            bad("top_k", self.top_k, f"an integer in [0, {vocab}] (0: off)")
        if not finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "a finite number in (0, 1]")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", self.logprobs, f"an integer in [0, {MAX_LOGPROBS}]")
        for w in self.bad_words:
            if not 1 <= len(w) <= MAX_BAD_WORD_TOKENS:
                bad("bad word", w, f"1 to {MAX_BAD_WORD_TOKENS} token ids")
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in w):
                bad("bad word", w, f"token ids in [0, {vocab})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop string", s, "a non-empty string")


DEFAULT_SAMPLING = Sampling()
"""Every setting off."""


class Features(NamedTuple):
    """What the compiled step does beyond greedy and seeded sampling (static).

    Attributes:
      penalties: the `counts` and `seen` state and the penalty rows.
      bad_words: (most words per request, most tokens per word); (0, 0): off.
      logprobs: top logprobs computed per row (0: none; else the sampled token's too).
      filtered: top-k / top-p.
    """

    penalties: bool = False
    bad_words: tuple[int, int] = (0, 0)
    logprobs: int = 0
    filtered: bool = False

    @staticmethod
    def of(settings: Sequence[Sampling]) -> Features:
        """The least features that serve every one of `settings`."""
        words = max((len(s.bad_words) for s in settings), default=0)
        length = max((len(w) for s in settings for w in s.bad_words), default=0)
        return Features(
            penalties=any(s.penalised for s in settings),
            bad_words=(words, length) if words else (0, 0),
            logprobs=max((s.logprobs for s in settings), default=0),
            filtered=any(s.filtered for s in settings),
        )

    def serves(self, s: Sampling) -> str | None:
        """None when these features serve `s`, else the setting they lack."""
        if s.penalised and not self.penalties:
            return "penalties"
        words, length = self.bad_words
        if len(s.bad_words) > words or any(len(w) > length for w in s.bad_words):
            return f"bad words (the engine holds {words} of up to {length} tokens)"
        if s.logprobs > self.logprobs:
            return f"logprobs {s.logprobs} (the engine computes {self.logprobs})"
        if s.filtered and not self.filtered:
            return "top-k / top-p"
        return None

    @property
    def ring(self) -> int:
        """K, recent tokens kept per slot (bad words only)."""
        return max(self.bad_words[1] - 1, 1)


NO_FEATURES = Features()
"""Greedy and seeded sampling only."""


class SamplerState(NamedTuple):
    """The per-slot device state (module docstring); a field is None when its feature is off."""

    counts: Any = None
    seen: Any = None
    recent: Any = None


def init_state(features: Features, pool_size: int, vocab: int) -> SamplerState:
    """Zeroed state for a pool of `pool_size` slots (None where no feature needs it)."""
    counts = seen = recent = None
    if features.penalties:
        counts = jnp.zeros((pool_size, vocab), jnp.int32)
        seen = jnp.zeros((pool_size, vocab), jnp.int8)
    if features.bad_words[0]:
        recent = jnp.zeros((pool_size, features.ring), jnp.int32)
    return SamplerState(counts, seen, recent)


def step_inputs(features: Features) -> tuple[fm_jax.StepInput, ...]:
    """The per-row host arrays the features need, declared to the engine step."""
    out: list[fm_jax.StepInput] = []
    if features.penalties:
        out += [
            fm_jax.StepInput("presence", "row", dtype=np.float32),
            fm_jax.StepInput("frequency", "row", dtype=np.float32),
            fm_jax.StepInput("repetition", "row", dtype=np.float32),
            fm_jax.StepInput("prompt_len", "row"),
            fm_jax.StepInput("fresh", "row"),
        ]
    words, length = features.bad_words
    if words:
        out += [
            fm_jax.StepInput("bad_words", "row", shape=(words, length)),
            fm_jax.StepInput("bad_len", "row", shape=(words,)),
        ]
    if features.filtered:
        out += [
            fm_jax.StepInput("top_k", "row"),
            fm_jax.StepInput("top_p", "row", dtype=np.float32),
        ]
    return tuple(out)


class HostRows:
    """The feature rows of one batch on the host, padded to `rows` (padding: zeros)."""

    def __init__(self, features: Features, rows: int) -> None:
        self.features = features
        self.arrays = {d.name: np.zeros((rows, *d.shape), d.dtype) for d in step_inputs(features)}
        if "repetition" in self.arrays:
            self.arrays["repetition"][:] = 1.0
        if "top_p" in self.arrays:
            self.arrays["top_p"][:] = 1.0

    def set(self, i: int, s: Sampling, prompt_len: int, fresh: bool) -> None:
        """Row i serves a request with settings `s`, original prompt length `prompt_len`;
        `fresh`: this is its first prefill chunk in its slot."""
        a = self.arrays
        if self.features.penalties:
            a["presence"][i] = s.presence_penalty
            a["frequency"][i] = s.frequency_penalty
            a["repetition"][i] = s.repetition_penalty
            a["prompt_len"][i] = prompt_len
            a["fresh"][i] = int(fresh)
        if self.features.bad_words[0]:
            for j, w in enumerate(s.bad_words):
                a["bad_words"][i, j, : len(w)] = w
                a["bad_len"][i, j] = len(w)
        if self.features.filtered:
            a["top_k"][i] = s.top_k
            a["top_p"][i] = s.top_p


def update_state(
    state: SamplerState,
    features: Features,
    inputs: Any,
    slots: jax.Array,
    ids: jax.Array,
    positions: jax.Array,
    seq_lens: jax.Array,
) -> SamplerState:
    """Write the step's input tokens into the state (module docstring).

    `inputs` holds the feature rows by name; `slots` [B] are the rows' slots, `ids` [T] the
    resolved input ids, `positions` [T] their positions, `seq_lens` [B] the rows' lengths
    after this step; `inputs["token_rows"]` / `["token_slots"]` lay the tokens out.
    """
    counts, seen, recent = state
    tok_slots, tok_rows = inputs["token_slots"], inputs["token_rows"]
    real = tok_slots > 0
    pool = None
    if features.penalties:
        pool = counts.shape[0]
        fresh = jnp.where(inputs["fresh"] > 0, slots, pool)  # out of range: dropped
        counts = counts.at[fresh].set(0, mode="drop")
        seen = seen.at[fresh].set(0, mode="drop")
        output = real & (positions >= inputs["prompt_len"][tok_rows])
        counts = counts.at[tok_slots, ids].add(output.astype(jnp.int32), mode="drop")
        seen = seen.at[tok_slots, ids].max(real.astype(jnp.int8), mode="drop")
    if features.bad_words[0]:
        k = recent.shape[1]
        # Only a row's last K tokens of the step: positions distinct mod K, so no two
        # writes of one slot collide; the earlier ones are never read.
        keep = real & (positions >= seq_lens[tok_rows] - k)
        where = jnp.where(keep, tok_slots, recent.shape[0])
        recent = recent.at[where, positions % k].set(ids, mode="drop")
    return SamplerState(counts, seen, recent)


def process_logits(
    logits: jax.Array,
    state: SamplerState,
    features: Features,
    inputs: Any,
    slots: jax.Array,
    seq_lens: jax.Array,
) -> jax.Array:
    """Penalties and bad words applied to the rows' logits [B, V] (float32)."""
    if features.penalties:
        counts = state.counts[slots]
        seen = state.seen[slots] > 0
        rep = inputs["repetition"][:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - inputs["frequency"][:, None] * counts.astype(jnp.float32)
        logits = logits - inputs["presence"][:, None] * (counts > 0).astype(jnp.float32)
    words, length = features.bad_words
    if words:
        k = state.recent.shape[1]
        back = jnp.arange(1, length)  # [L-1]: the tokens 1, 2, ... positions back
        pos = seq_lens[:, None] - back[None, :]  # [B, L-1]
        prev = state.recent[slots[:, None], pos % k]  # [B, L-1]
        n = inputs["bad_len"]  # [B, W]
        w = inputs["bad_words"]  # [B, W, L]
        want = jnp.take_along_axis(
            w, jnp.clip(n[:, :, None] - 1 - back[None, None, :], 0, length - 1), axis=2
        )  # [B, W, L-1]: the word's token j positions before its last
        ok = (back[None, None, :] >= n[:, :, None]) | (
            (pos[:, None, :] >= 0) & (prev[:, None, :] == want)
        )
        hit = (n > 0) & jnp.all(ok, axis=2)  # [B, W]
        banned = jnp.take_along_axis(w, jnp.clip(n - 1, 0, length - 1)[:, :, None], axis=2)
        rows = jnp.arange(logits.shape[0])[:, None]
        value = jnp.where(hit, -jnp.inf, jnp.inf).astype(logits.dtype)
        logits = logits.at[rows, banned[:, :, 0]].min(value)
    return logits


def _filtered(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k, then top-p, over the rows' temperature-scaled logits: the rest set to -inf."""
    v = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, top_k, v)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=1)  # [B, 1]
    desc = jnp.where(jnp.arange(v)[None, :] < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each rank
    keep = (before < top_p[:, None]) & (jnp.arange(v)[None, :] < k[:, None])
    last = jnp.sum(keep, axis=-1) - 1  # the lowest kept rank (rank 0 is always kept)
    floor = jnp.maximum(jnp.take_along_axis(desc, last[:, None], axis=1), kth)
    return jnp.where(scaled >= floor, scaled, -jnp.inf)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    seeds: jax.Array,
    positions: jax.Array,
    filters: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """One token per row [B] int32: argmax where temperature is 0, else a Gumbel-max draw
    keyed by (seed, position), after top-k / top-p when `filters` = (top_k, top_p) is
    given. Draws are computed only when some row samples."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn() -> jax.Array:
        scaled = logits / jnp.maximum(temperature, jnp.float32(1e-6))[:, None]
        if filters is not None:
            scaled = _filtered(scaled, *filters)

        def row(hot: jax.Array, seed: jax.Array, pos: jax.Array) -> jax.Array:
            key = jax.random.fold_in(jax.random.PRNGKey(seed), pos)
            noise = jax.random.gumbel(key, hot.shape, jnp.float32)
            return jnp.argmax(hot + noise).astype(jnp.int32)

        got = jax.vmap(row)(scaled, seeds, positions)
        return jnp.where(temperature > 0, got, greedy).astype(jnp.int32)

    return jax.lax.cond(jnp.any(temperature > 0), drawn, lambda: greedy)


def logprobs(raw: jax.Array, tokens: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the sampled tokens' logprobs [B], the top n ids [B, n], their logprobs [B, n]) of the
    log-softmax of the raw logits."""
    lp = jax.nn.log_softmax(raw, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, n)
    return chosen, top_ids.astype(jnp.int32), top_lp
