"""The request set (deterministic from a seed) and each request's host-side serving state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fm_serve.grammar import Grammar
from fm_serve.sampling import Sampling


@dataclass(frozen=True)
class Request:
    """A generation request: prompt ids and a cap on new tokens (a stop token or string may
    end it earlier), sampled greedily (temperature 0) or with a temperature and a seed, and
    the further settings of `sampling` (penalties, bad words, top-k/top-p, logprobs, stop),
    and optionally constrained by a `grammar` (regex or JSON schema)."""

    rid: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    sampling: Sampling = Sampling()
    grammar: Grammar | None = None


@dataclass
class RequestState:
    """What the host scheduler knows about one request while it is served.

    Invariants: `slot` is >= 1 from admission to retirement or retraction (0 while queued);
    `prefix` is what a prefill in the slot computes (the prompt, or after a retraction the
    prompt and the outputs read so far); `seq_len_cpu` is the length the next decode row
    will carry (prefix + tokens scheduled since); `scheduled` counts output tokens that
    dispatched steps will produce; `output` holds those already read back, `logprobs` their
    logprobs (when asked for). `finished` is set once, by a stop, the limit or an abort.
    """

    req: Request
    slot: int = 0
    prefilled: int = 0
    seq_len_cpu: int = 0
    scheduled: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, tuple[int, ...], tuple[float, ...]]] = field(default_factory=list)
    finished: bool = False
    aborted: bool = False
    retractions: int = 0
    prefix: tuple[int, ...] = ()
    matcher: Any = None  # the request's grammar matcher (llguidance), None: unconstrained
    reason: str = ""  # why a grammar finished it ("grammar complete", "grammar dead end")
    drafts: Any = None  # speculative, constrained: the drafts [K] its next verify checks
    accepted: int = 0  # speculative: drafts its verifies accepted (read back so far)
    pending_steps: int = 0  # dispatched steps that sample for it, not read back yet

    def __post_init__(self) -> None:
        if not self.prefix:
            self.prefix = self.req.prompt

    @property
    def prefill_done(self) -> bool:
        """All prefix tokens are in dispatched steps."""
        return self.prefilled == len(self.prefix)

    @property
    def in_flight(self) -> int:
        """Output tokens of dispatched steps not read back yet."""
        return self.scheduled - len(self.output)

    @property
    def wants_decode(self) -> bool:
        """Another decode row may be scheduled (not finished, cap not yet reached)."""
        return self.prefill_done and not self.finished and self.scheduled < self.req.max_new_tokens


def make_requests(
    n: int,
    *,
    vocab: int,
    seed: int = 0,
    prompt_len: tuple[int, int] = (8, 64),
    max_new: tuple[int, int] = (4, 48),
    reserved_ids: int = 2,
) -> list[Request]:
    """`n` requests with prompt lengths and output caps drawn uniformly from the given ranges.

    Prompt ids avoid the first `reserved_ids` ids (padding id 0 and EOS).
    """
    if n < 1 or prompt_len[0] < 1 or max_new[0] < 1:
        raise ValueError(f"need n >= 1 and positive lengths, got {n}, {prompt_len}, {max_new}")
    rng = np.random.default_rng(seed)
    out = []
    for rid in range(n):
        p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        m = int(rng.integers(max_new[0], max_new[1] + 1))
        ids = rng.integers(reserved_ids, vocab, size=p)
        out.append(Request(rid, tuple(int(i) for i in ids), m))
    return out
