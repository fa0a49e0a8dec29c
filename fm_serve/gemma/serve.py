"""Serve text prompts on Gemma 3 in one mode (sync, overlap, debug overlap) and time it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fm_serve.config import engine_for
from fm_serve.engine import Engine, ServeResult
from fm_serve.gemma.load import Loaded
from fm_serve.grammar import Grammar, Matchers, gemma_tokenizer
from fm_serve.requests import Request
from fm_serve.sampling import DEFAULT_SAMPLING, Features, Sampling
from fm_serve.spec import Ngram

_MATCHERS: dict[int, Matchers] = {}


def grammar_matchers(loaded: Loaded) -> Matchers:
    """The grammar matchers of the loaded model's vocabulary (`grammar.gemma_tokenizer`,
    its end of turn ending an output), built once per tokenizer: llguidance's tokenizer
    over Gemma's 262K tokens takes a while."""
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError("structured output needs the model's tokenizer (not random weights)")
    key = id(tok)
    if key not in _MATCHERS:
        eos = loaded.model.stop_ids[-1] if loaded.model.stop_ids else tok.eos_id
        _MATCHERS[key] = Matchers(gemma_tokenizer(tok, eos), loaded.model.vocab)
    return _MATCHERS[key]


@dataclass
class PromptRun:
    """One mode's run over the prompts: completions, the serve result, warm-up time.

    `outputs[i]` are prompt i's new tokens (a stop token included when it ended the request),
    `texts[i]` their text with control tokens left out.
    """

    outputs: list[list[int]]
    texts: list[str]
    result: ServeResult
    warm_up_s: float
    logprobs: list[list[tuple[float, tuple[int, ...], tuple[float, ...]]]] = field(
        default_factory=list
    )

    @property
    def host_ms(self) -> float:
        """Mean host time per step (build and processing; overlap: the dispatch too)."""
        return 1e3 * statistics.fmean(self.result.host_s)

    @property
    def device_ms(self) -> float | None:
        """Sync only: mean step time, dispatch to tokens on the host (the device's step)."""
        s = self.result.step_s
        return 1e3 * statistics.fmean(s) if s else None

    @property
    def wall_ms(self) -> float:
        """Wall time per step."""
        return 1e3 * self.result.wall_s / self.result.steps

    def summary_line(self, mode: str) -> str:
        """The run in one line: tokens/s and the per-step times."""
        r = self.result
        dev = self.device_ms
        device = f"device {dev:.1f} ms" if dev is not None else f"wall {self.wall_ms:.1f} ms"
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r.modes.items()))
        if r.drafts_proposed:
            kinds += f"; drafts accepted {r.drafts_accepted}/{r.drafts_proposed}"
        return (
            f"{mode}: {r.tokens} tokens in {r.wall_s:.2f} s = {r.tok_s:.1f} tok/s; "
            f"{r.steps} steps ({kinds}); per step: host {self.host_ms:.2f} ms, {device}; "
            f"warm-up {self.warm_up_s:.1f} s"
        )

    def as_json(self) -> dict[str, Any]:
        """The run's figures and outputs."""
        r = self.result
        return {
            "tokens": r.tokens,
            "wall_s": r.wall_s,
            "tok_s": r.tok_s,
            "steps": r.steps,
            "modes": r.modes,
            "host_ms_per_step": self.host_ms,
            "device_ms_per_step": self.device_ms,
            "wall_ms_per_step": self.wall_ms,
            "warm_up_s": self.warm_up_s,
            "outputs": self.outputs,
            "texts": self.texts,
            "logprobs": self.logprobs,
            "retractions": r.retractions,
            "drafts_proposed": r.drafts_proposed,
            "drafts_accepted": r.drafts_accepted,
        }


def make_requests(
    loaded: Loaded,
    prompts: Sequence[str],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    settings: Sampling = DEFAULT_SAMPLING,
    bad_words: Sequence[str] = (),
    stop: Sequence[str] = (),
) -> list[Request]:
    """One request per prompt (tokenized, `<bos>` first); request i samples with seed + i.

    Every request takes `settings`, the `bad_words` texts (each tokenized as the tokenizer
    writes it, no `<bos>`) and the `stop` strings.

    Raises:
      ValueError: an empty bad word or stop string, or one the tokenizer writes as no token.
    """
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError("the model has no tokenizer (random weights): use random_requests")
    words = []
    for w in bad_words:
        ids = tuple(tok.encode(w, add_bos=False)) if w else ()
        if not ids:
            raise ValueError(f"bad word {w!r}: the tokenizer writes it as no token")
        words.append(ids)
    for s in stop:
        if not s:
            raise ValueError(f"stop string {s!r}: must not be empty")
    settings = replace(settings, bad_words=tuple(words), stop=tuple(stop))
    return [
        Request(i, tuple(tok.encode(p)), max_tokens, temperature, seed + i, settings)
        for i, p in enumerate(prompts)
    ]


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to the first of the stop strings it holds (all of it when none)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]


def random_requests(
    loaded: Loaded,
    n: int,
    max_tokens: int,
    *,
    prompt_len: tuple[int, int] = (8, 32),
    temperature: float = 0.0,
    seed: int = 0,
    first_id: int = 3,
) -> list[Request]:
    """`n` requests whose prompts are random token ids, no tokenizer needed (random weights).

    Prompt lengths are drawn uniformly from `prompt_len` (inclusive) and the ids from
    [first_id, vocab) (Gemma's pad, end of sequence and `<bos>` are 0, 1, 2), all from a
    numpy generator seeded with `seed`; request i samples with seed + i, as `make_requests`.
    """
    lo, hi = prompt_len
    if n < 1 or not 1 <= lo <= hi:
        raise ValueError(f"need n >= 1 and 1 <= prompt lengths, got {n}, {prompt_len}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    return [
        Request(
            i,
            tuple(int(t) for t in rng.integers(first_id, loaded.model.vocab, size=int(k))),
            max_tokens,
            temperature,
            seed + i,
        )
        for i, k in enumerate(lengths)
    ]


def serve_prompts(
    loaded: Loaded,
    prompts: Sequence[str],
    *,
    mode: str = "overlap",
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    max_running: int = 8,
    prefill_budget: int = 32,
    protocol: str = "gather",
    progress: bool = False,
    log: Callable[[str], None] = lambda _: None,
    settings: Sampling = DEFAULT_SAMPLING,
    bad_words: Sequence[str] = (),
    stop: Sequence[str] = (),
    kv_budget: int | None = None,
    on_text: Callable[[int, str], None] | None = None,
    speculative: Ngram | None = None,
    grammar: Grammar | None = None,
) -> PromptRun:
    """Warm up the mode's steps, then serve every prompt to `max_tokens` or a stop token.

    Args:
      loaded: the model (`load.load_model`).
      prompts: the texts, served together with continuous batching.
      mode: "sync", "overlap" or "debug" (overlap with fm_jax's device checks).
      max_tokens: new tokens per request.
      temperature, seed: sampling (0: greedy); request i uses seed + i.
      max_running: requests in a batch at once (the rest wait for a free slot).
      prefill_budget: prompt tokens per step (longer prompts are prefilled in chunks).
      protocol: the FutureMap relay protocol of the overlap modes.
      progress: show a progress bar of the output tokens.
      log: progress messages.
      settings: penalties, top-k / top-p and logprobs of every request (`Sampling`).
      bad_words, stop: texts never produced, and texts that end a request.
      kv_budget: KV positions the running requests may hold (preemption past it).
      on_text: streaming: called with (prompt index, the text of each new token).
      speculative: an n-gram drafter: speculative decoding (greedy requests only).
      grammar: structured output: every request's completion is constrained by it.
    """
    if mode not in ("sync", "overlap", "debug"):
        raise ValueError(f"mode must be sync, overlap or debug, got {mode!r}")
    requests = make_requests(
        loaded, prompts, max_tokens, temperature, seed, settings, bad_words, stop
    )
    if grammar is not None:
        requests = [replace(r, grammar=grammar) for r in requests]
    tok = loaded.tokenizer
    assert tok is not None
    cfg = engine_for(max_running, prefill_budget, loaded.model.row_tile, kv_budget)
    engine = Engine(
        loaded.model,
        loaded.params,
        cfg,
        debug=mode == "debug",
        protocol=protocol,
        features=Features.of([r.sampling for r in requests]),
        decode=tok.decode,
        speculative=speculative,
        grammar=None if grammar is None else grammar_matchers(loaded),
    )
    t0 = time.perf_counter()
    engine.warm_up(overlap=mode != "sync")
    warm = time.perf_counter() - t0
    log(f"{mode}: warm-up (compile or load every bucket's step) {warm:.2f} s")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests) * max_tokens, unit="tok", desc=mode, leave=False)
    run = engine.run_sync if mode == "sync" else engine.run_overlap
    stream = None
    if on_text is not None:
        show = on_text
        stream = lambda st, t: show(st.req.rid, tok.decode([t], skip_special=True))  # noqa: E731
    try:
        result = run(requests, progress=bar.update if bar is not None else None, on_token=stream)
    finally:
        if bar is not None:
            bar.close()
    outputs = [result.outputs[r.rid] for r in requests]
    texts = [cut_at_stop(tok.decode(o, skip_special=True), stop) for o in outputs]
    lps = [result.logprobs.get(r.rid, []) for r in requests]
    return PromptRun(outputs, texts, result, warm, lps)
