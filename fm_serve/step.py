"""The jitted forward step, in two flavours over the same served model.

- sync step: the host passes real token ids and real lengths; no FutureMap.
- overlap step: the same forward inside a `fm_jax.FutureMap`'s engine step (one dispatch):
  resolve builds the decode rows' ids at the head from the relay, publish and stash write
  the relay at the tail, and the map's state is donated together with the KV cache, so
  every write is in place. In the sentinel protocol decode rows carry `-slot` ids (and, in
  a DECODE batch, lengths) that resolve fills; in the gather protocol they carry no id and
  the host's lengths, and resolve gathers a DECODE batch's ids at its slots and a MIXED
  batch's running rows' ids at their `relay_slots` (docs/CONTRACT.md, 'Two protocols').
  With debug, the map's checks report through `FutureMap.check()`.

Token positions are computed on device from the resolved lengths, because in the sentinel
protocol a DECODE row's length is itself a sentinel until resolve: position = seq_len -
extend_len + offset.

Sampling (`sampling.py`): the step first writes its input tokens into the per-slot sampler
state (donated with the cache), then processes the logits (penalties, bad words) from it; a
row with temperature 0 takes the argmax, any other draws by Gumbel-max from the logits /
temperature (after top-k / top-p) with a key of (its request's seed, the sampled token's
position), so a request's draws do not depend on the batch it shares or the loop that
scheduled it. With logprobs, the step also returns the log-softmax of the raw logits at the
sampled token and the top N, which the host reads with the tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax
from fm_serve import sampling
from fm_serve.sampling import NO_FEATURES, Features, SamplerState
from fm_serve.served import ServedModel

Ints = Any
"""A host int array (np.ndarray) when built, a traced jax.Array inside the jitted step."""


class StepInputs(NamedTuple):
    """One scheduled batch as host arrays, padded to a batch bucket B and a token bucket T.

    Padding rows and padding tokens carry slot 0 (and id 0, length 0).
    """

    forward_mode: Ints  # int32 scalar, a fm_jax.ForwardMode
    req_pool_indices: Ints  # [B] slot of each row
    input_ids: Ints  # [T] flat ids; overlap decode rows: -slot
    seq_lens: Ints  # [B] length incl. this step's tokens; overlap DECODE: -slot
    extend_lens: Ints  # [B] tokens each row contributes (prefill chunk, or 1)
    token_rows: Ints  # [T] row of each token (padding tokens: 0)
    token_slots: Ints  # [T] slot of each token (padding tokens: 0)
    token_offsets: Ints  # [T] offset of each token within its row's tokens
    last_token: Ints  # [B] index of each row's last token (padding rows: 0)
    relay_slots: Ints  # [T] gather-protocol MIXED: a running row's slot at its token, else 0
    temperature: Any  # [B] float32 sampling temperature (0: greedy)
    sample_seed: Ints  # [B] the request's sampling seed
    extra: dict[str, Any]  # the sampling features' rows (`sampling.step_inputs`) by name


def _positions(inp: Any, seq_lens: jax.Array) -> jax.Array:
    """Each token's position in its slot's sequence; padding tokens sit at position 0."""
    start = seq_lens - inp.extend_lens  # [B]: first position this step writes per row
    pos = start[inp.token_rows] + inp.token_offsets
    return jnp.where(inp.token_slots > 0, pos, 0)


def _logits(
    params: Any,
    model: ServedModel,
    features: Features,
    cache: Any,
    state: SamplerState,
    inp: Any,
    input_ids: jax.Array,
    seq_lens: jax.Array,
) -> tuple[Any, SamplerState, jax.Array, jax.Array]:
    """The forward: (cache, sampler state, processed logits [B, V], raw logits [B, V])."""
    extra = {**inp.extra, "token_rows": inp.token_rows, "token_slots": inp.token_slots}
    slots = inp.req_pool_indices
    positions = jnp.clip(_positions(inp, seq_lens), 0, model.max_seq_len - 1)
    state = sampling.update_state(state, features, extra, slots, input_ids, positions, seq_lens)
    raw, cache = model.forward(params, cache, input_ids, inp.token_slots, positions, inp.last_token)
    logits = sampling.process_logits(raw, state, features, extra, slots, seq_lens)
    return cache, state, logits, raw


def _sample(
    features: Features, inp: Any, logits: jax.Array, raw: jax.Array, seq_lens: jax.Array
) -> tuple[jax.Array, Any]:
    """Sampling of processed logits: (tokens [B] int32, logprobs of the raw logits or None)."""
    filters = (inp.extra["top_k"], inp.extra["top_p"]) if features.filtered else None
    tokens = sampling.sample(logits, inp.temperature, inp.sample_seed, seq_lens, filters)
    lp = sampling.logprobs(raw, tokens, features.logprobs) if features.logprobs else None
    return tokens, lp


def _run_model(
    params: Any,
    model: ServedModel,
    features: Features,
    cache: Any,
    state: SamplerState,
    inp: Any,
    input_ids: jax.Array,
    seq_lens: jax.Array,
) -> tuple[Any, SamplerState, jax.Array, Any]:
    """Forward plus sampling: (cache, sampler state, tokens [B] int32, logprobs or None)."""
    cache, state, logits, raw = _logits(
        params, model, features, cache, state, inp, input_ids, seq_lens
    )
    tokens, lp = _sample(features, inp, logits, raw, seq_lens)
    return cache, state, tokens, lp


def allowed(mask: jax.Array, vocab: int) -> jax.Array:
    """[B, V] bool of a token bitmask [B, ceil(V / 32)] int32 (bit v % 32 of word v // 32)."""
    v = jnp.arange(vocab)
    return ((mask[:, v // 32] >> (v % 32)) & 1).astype(bool)


class SplitStep(NamedTuple):
    """A step in two dispatches, split at the sampling (structured output, `grammar`).

    `forward(params, cache, state, inp, ids, lens) -> (cache, state, logits, raw)`: the
    forward on resolved ids and lengths (cache and sampler state donated); `sample(inp,
    logits, raw, lens, mask) -> (tokens, logprobs, lens + 1)`: the sampling with the
    token bitmask [B, ceil(V / 32)] applied (-inf outside it). `inp` is a `ModelInputs` of
    device arrays padded like `ids` and `lens`.
    """

    forward: Callable[..., Any]
    sample: Callable[..., Any]


@functools.cache
def make_split_step(model: ServedModel, features: Features = NO_FEATURES) -> SplitStep:
    """The split step's two jitted halves (`SplitStep`), cached per model and features."""

    def forward(
        params: Any, cache: Any, state: SamplerState, inp: Any, ids: jax.Array, lens: jax.Array
    ) -> Any:
        return _logits(params, model, features, cache, state, inp, ids, lens)

    def sample(inp: Any, logits: jax.Array, raw: jax.Array, lens: jax.Array, mask: Any) -> Any:
        logits = jnp.where(allowed(mask, logits.shape[-1]), logits, -jnp.inf)
        tokens, lp = _sample(features, inp, logits, raw, lens)
        return tokens, lp, lens + 1

    return SplitStep(jax.jit(forward, donate_argnums=(1, 2)), jax.jit(sample))


@functools.cache
def make_sync_step(model: ServedModel, features: Features = NO_FEATURES) -> Callable[..., Any]:
    """The jitted synchronous step: (params, cache, state, inputs) -> (cache, state, tokens,
    logprobs); cache and sampler state donated.

    Assumes the host filled in real token ids and lengths (no sentinels). Cached per model
    and features, so engines with the same model share compiled executables.
    """

    def step(params: Any, cache: Any, state: SamplerState, inp: StepInputs) -> Any:
        return _run_model(params, model, features, cache, state, inp, inp.input_ids, inp.seq_lens)

    return jax.jit(step, donate_argnums=(1, 2))


TOKEN_LAYOUT_INPUTS = (
    fm_jax.StepInput("extend_lens", "row"),
    fm_jax.StepInput("last_token", "row"),
    fm_jax.StepInput("token_rows", "token"),
    fm_jax.StepInput("token_slots", "token"),
    fm_jax.StepInput("token_offsets", "token"),
)
"""The batch's token layout as host arrays: what every step of the model is sent."""

MODEL_INPUTS = TOKEN_LAYOUT_INPUTS + (
    fm_jax.StepInput("temperature", "row", dtype=np.float32),
    fm_jax.StepInput("sample_seed", "row"),
)
"""The model's own per-step host arrays, declared to the FutureMap's engine step: padded
there like the batch's rows or tokens and sent with the batch in one transfer (with the
sampling features' rows, `sampling.step_inputs`)."""


class ModelInputs(NamedTuple):
    """The model's per-step arrays (the `MODEL_INPUTS` by name) inside the step."""

    req_pool_indices: Any  # [B] the batch's slots, padded
    extend_lens: jax.Array
    last_token: jax.Array
    token_rows: jax.Array
    token_slots: jax.Array
    token_offsets: jax.Array
    temperature: jax.Array
    sample_seed: jax.Array
    extra: dict[str, jax.Array]


def make_overlap_step(
    model: ServedModel, fm: fm_jax.FutureMap, features: Features = NO_FEATURES
) -> fm_jax.EngineStep:
    """The overlap step: the model's forward inside `fm`'s engine step.

    `step(batch, params, cache, state, inputs=model inputs) -> StepResult(out=(cache, state,
    tokens, logprobs))`, one dispatch with the cache, the sampler state and the map's state
    donated. The map resolves the batch at the head (sentinel protocol: the decode rows'
    `-slot` ids and DECODE lengths; gather: a DECODE batch's ids at its slots, a MIXED
    batch's running rows' ids at its token slots) and publishes `seq_lens + 1` and stashes
    the sampled tokens at the tail (docs/CONTRACT.md, 'One overlap step'). Positions come
    from the resolved lengths, on the device.
    """
    names = {d.name for d in MODEL_INPUTS}

    def forward(
        res: fm_jax.Resolved,
        batch: fm_jax.Batch,
        inputs: dict[str, jax.Array],
        params: Any,
        cache: Any,
        state: SamplerState,
    ) -> fm_jax.StepOutput:
        inp = ModelInputs(
            req_pool_indices=batch.req_pool_indices,
            **{k: v for k, v in inputs.items() if k in names},
            extra={k: v for k, v in inputs.items() if k not in names},
        )
        cache, state, tokens, lp = _run_model(
            params, model, features, cache, state, inp, res.input_ids, res.seq_lens
        )
        return fm_jax.StepOutput(res.seq_lens + 1, tokens, (cache, state, tokens, lp))

    # XLA's defaults for the model (on CPU the map's option would keep its matmuls on the
    # calling thread).
    return fm.engine_step(
        forward,
        inputs=MODEL_INPUTS + sampling.step_inputs(features),
        donate_argnums=(1, 2),
        host_out=host_out,
        compiler_options={},
    )


def host_out(out: Any) -> tuple[Any, Any]:
    """What the host reads of a step, a step late (`EngineStep.read_host`): its tokens,
    and its logprobs (speculative: the drafts it stashed)."""
    return out[2], out[3]
