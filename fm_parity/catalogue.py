"""The named scenarios. Each builder returns a Scenario; `size` scales the request count."""

from __future__ import annotations

import random
from collections.abc import Callable

from fm_parity.scenario import Policy, Request, Scenario, SpecShape


def steady_decode(size: int = 1, seed: int = 0) -> Scenario:
    """Requests prefilled once, then a long steady run of DECODE batches."""
    n = 6 * size
    reqs = tuple(Request(i, 3 + i % 5, 40) for i in range(n))
    pol = Policy(max_running=n, max_prefill_rows=n, max_prefill_tokens=64)
    return Scenario(
        "steady_decode",
        "prefill once, then steady decode",
        reqs,
        n + 1,
        pol,
        batch_buckets=(8 * size,),
        token_buckets=(64 + 8 * size,),
    )


def prefill_then_decode(size: int = 1, seed: int = 0) -> Scenario:
    """Staggered arrivals: each request's EXTEND gives its first DECODE token and length."""
    reqs = tuple(Request(i, 1 + (7 * i) % 13, 2 + i % 6, arrival=2 * i) for i in range(8 * size))
    return Scenario(
        "prefill_then_decode",
        "staggered prefill, then decode",
        reqs,
        6,
        Policy(max_running=5, max_prefill_tokens=32),
        batch_buckets=(8,),
        token_buckets=(32, 128),
    )


def chunked_prefill(size: int = 1, seed: int = 0) -> Scenario:
    """Long prompts split into many chunks; intermediate chunks' stashes are never read."""
    reqs = tuple(Request(i, 23 + 9 * i, 5, arrival=3 * i) for i in range(4 * size))
    pol = Policy(chunk=6, max_prefill_rows=2, max_prefill_tokens=12, max_running=4)
    return Scenario(
        "chunked_prefill",
        "prompts over several chunks",
        reqs,
        5,
        pol,
        batch_buckets=(4,),
        token_buckets=(16,),
    )


def mixed_batches(size: int = 1, seed: int = 0) -> Scenario:
    """Chunked prefill merged with running decodes: MIXED batches with sentinel tails."""
    reqs = tuple(Request(i, 5 + (11 * i) % 17, 6 + i % 9, arrival=i) for i in range(10 * size))
    pol = Policy(mixed=True, chunk=5, max_prefill_rows=2, max_prefill_tokens=10, max_running=6)
    return Scenario(
        "mixed_batches",
        "chunked prefill + decode in one batch",
        reqs,
        7,
        pol,
        batch_buckets=(8,),
        token_buckets=(32,),
    )


def retire_reuse(size: int = 1, seed: int = 0) -> Scenario:
    """Short requests through a tiny pool: every retirement hands its slot over at once."""
    reqs = tuple(Request(i, 2 + i % 4, 1 + (5 * i) % 7, arrival=i // 3) for i in range(24 * size))
    return Scenario(
        "retire_reuse",
        "retire and immediate slot reuse",
        reqs,
        4,
        Policy(max_running=3, max_prefill_tokens=8),
        batch_buckets=(4,),
        token_buckets=(16,),
    )


def abort_reuse(size: int = 1, seed: int = 0) -> Scenario:
    """Requests aborted mid-stream, their last step in flight: each slot goes at once to a
    waiting request, whose prefill writes it after the aborted request's last step."""
    reqs = tuple(
        Request(i, 2 + i % 5, 6 + i % 4, arrival=i // 2, abort_after=(1 + i % 4) * (i % 3 != 2))
        for i in range(18 * size)
    )
    return Scenario(
        "abort_reuse",
        "aborts mid-stream, slots reused at once",
        reqs,
        4,
        Policy(max_running=3, max_prefill_tokens=8),
        batch_buckets=(4,),
        token_buckets=(16,),
    )


def retract_resume(size: int = 1, seed: int = 0) -> Scenario:
    """Preemption: requests retracted mid-stream (their slots reused at once) and resumed
    by recomputing their prefix, prompt and own tokens, in chunks beside running decodes."""
    reqs = tuple(
        Request(i, 3 + (5 * i) % 9, 7 + i % 5, arrival=i, retract_after=2 + i % 4 if i % 2 else 0)
        for i in range(10 * size)
    )
    pol = Policy(mixed=True, chunk=5, max_prefill_rows=2, max_prefill_tokens=10, max_running=4)
    return Scenario(
        "retract_resume",
        "retraction mid-stream, resumed by recomputing",
        reqs,
        5,
        pol,
        batch_buckets=(8,),
        token_buckets=(32,),
    )


def prefill_burst(size: int = 1, seed: int = 0) -> Scenario:
    """A request waits through 100 prefill batches before its first decode.

    The other requests generate one token each (finished by their prefill) and cycle
    through the remaining slots, so the waiting request's slot is the only one that
    keeps its relay entry across the burst.
    """
    first = Request(0, 5, 12)
    burst = tuple(Request(i, 1 + i % 3, 1, arrival=1) for i in range(1, 101))
    pol = Policy(max_prefill_rows=1, max_prefill_tokens=8, max_running=3)
    return Scenario(
        "prefill_burst",
        "100 prefill batches before a first decode",
        (first,) + burst,
        4,
        pol,
        batch_buckets=(4,),
        token_buckets=(16,),
    )


def idle_steps(size: int = 1, seed: int = 0) -> Scenario:
    """Idle data-parallel steps: forced IDLE batches and gaps between arrivals."""
    reqs = tuple(Request(i, 3, 4 + i % 3, arrival=12 * i) for i in range(4 * size))
    return Scenario(
        "idle_steps",
        "IDLE batches (empty indices)",
        reqs,
        4,
        Policy(max_running=3, max_prefill_tokens=4, idle_every=3),
        batch_buckets=(4,),
        token_buckets=(8,),
    )


def padded_batches(size: int = 1, seed: int = 0) -> Scenario:
    """Coarse buckets: most rows and tokens are slot-0 padding that writes garbage."""
    reqs = tuple(Request(i, 1 + i % 6, 3 + i % 8, arrival=i % 5) for i in range(12 * size))
    return Scenario(
        "padded_batches",
        "batches padded with slot-0 rows",
        reqs,
        10,
        Policy(max_running=9, max_prefill_rows=3, max_prefill_tokens=16),
        batch_buckets=(4, 16),
        token_buckets=(16, 64),
    )


def prebuilt_bootstrap(size: int = 1, seed: int = 0) -> Scenario:
    """Disaggregated decode: PREBUILT requests bootstrapped by publish + stash."""
    reqs = tuple(
        Request(i, 4 + i % 5, 3 + i % 4, arrival=2 * i, prebuilt=i % 3 != 2)
        for i in range(9 * size)
    )
    return Scenario(
        "prebuilt_bootstrap",
        "publish + stash bootstrap, then decode",
        reqs,
        5,
        Policy(max_running=4, max_prefill_tokens=8),
        batch_buckets=(4,),
        token_buckets=(16,),
    )


def spec_decode(size: int = 1, seed: int = 0) -> Scenario:
    """EAGLE-like spec decode: variable accept lengths, top-k and bf16 hidden states."""
    reqs = tuple(Request(i, 3 + i % 7, 12 + 3 * (i % 5), arrival=i) for i in range(8 * size))
    return Scenario(
        "spec_decode",
        "spec decode with top-k and bf16 hidden",
        reqs,
        6,
        Policy(max_running=5, max_prefill_rows=2, max_prefill_tokens=16),
        spec=SpecShape(topk=4, hidden=8),
        batch_buckets=(8,),
        token_buckets=(32,),
    )


def spec_verified(size: int = 1, seed: int = 0) -> Scenario:
    """Spec decode relaying verified ids: spec prefill, PREBUILT bootstrap, slot reuse.

    The verify hashes each row's gathered verified id, so a lost or stale one (also one
    left by a slot's previous request) changes every later token. Small on purpose: no
    hidden states (spec_decode covers them), top-k 2, one batch bucket.
    """
    reqs = tuple(
        Request(i, 2 + i % 4, 5 + 2 * (i % 3), arrival=i, prebuilt=i % 3 == 1)
        for i in range(6 * size)
    )
    spec = SpecShape(topk=2, hidden=0, verified_id=True)
    return _small_spec("spec_verified", "spec decode relaying verified ids", reqs, spec)


def _small_spec(
    name: str, description: str, reqs: tuple[Request, ...], spec: SpecShape
) -> Scenario:
    """A small spec scenario: three live slots (a retired request's reused at once), three
    requests running, one batch bucket."""
    return Scenario(
        name,
        description,
        reqs,
        4,
        Policy(max_running=3, max_prefill_rows=2, max_prefill_tokens=8),
        spec=spec,
        batch_buckets=(4,),
        token_buckets=(16,),
    )


def spec_sglang_eagle(size: int = 1, seed: int = 0) -> Scenario:
    """SGLang's EAGLE relay payload today: the standard fields plus draft probabilities
    (float32 with NaN payloads) and DSA top-k indices, declared as an engine's own fields.
    The verify hashes both, so a field lost or read from another slot changes every later
    token. Spec prefill, PREBUILT bootstrap and slot reuse."""
    reqs = tuple(
        Request(i, 2 + i % 5, 6 + 2 * (i % 3), arrival=i, prebuilt=i % 4 == 1)
        for i in range(6 * size)
    )
    spec = SpecShape(topk=2, hidden=4, payload="sglang_eagle")
    return _small_spec(
        "spec_sglang_eagle", "spec decode relaying SGLang's EAGLE payload", reqs, spec
    )


def spec_partial(size: int = 1, seed: int = 0) -> Scenario:
    """Partial stashes (SGLang's `stash` keeping the rows a payload leaves out) between
    full ones: SGLang's EAGLE payload with verified ids, where every third DECODE stash
    carries only the bonus token (`stash_bonus_tokens`), the one after leaves out hidden
    states and draft probabilities, and no stash carries the DSA indices (a resolve gathers
    them as None in both twins). The verify hashes what it gathers, kept rows included.
    Spec prefill, PREBUILT bootstrap and slot reuse."""
    reqs = tuple(
        Request(i, 2 + i % 5, 7 + 2 * (i % 3), arrival=i, prebuilt=i % 4 == 2)
        for i in range(6 * size)
    )
    spec = SpecShape(topk=2, hidden=4, verified_id=True, payload="sglang_eagle", stashes="partial")
    return _small_spec("spec_partial", "spec decode with partial stashes", reqs, spec)


def spec_ngram(size: int = 1, seed: int = 0) -> Scenario:
    """SGLang's n-gram relay payload: no bonus token and no top-k relayed, only each row's
    accepted tokens and accept length (zero-filled: a row never stashed reads length 0).
    The verify takes its last token from them. Spec prefill, PREBUILT bootstrap and slot
    reuse."""
    reqs = tuple(
        Request(i, 2 + i % 4, 5 + 3 * (i % 3), arrival=i, prebuilt=i % 3 == 2)
        for i in range(6 * size)
    )
    spec = SpecShape(topk=3, hidden=0, payload="ngram")
    return _small_spec("spec_ngram", "spec decode relaying SGLang's n-gram payload", reqs, spec)


def spec_confidence(size: int = 1, seed: int = 0) -> Scenario:
    """The confidence relay (DSpark): every spec DECODE step publishes a confidence row per
    row with its lengths and first reads its rows of two such publishes back from the host
    ring, with the generations snapshotted then. Short requests through three live slots:
    a retired request's slot is taken at once, so reads meet rows of a slot's previous
    request (older generation) beside the new one's own; PREBUILT and prefill publishes
    carry no confidence (the rows stay)."""
    reqs = tuple(
        Request(i, 2 + i % 3, 4 + 2 * (i % 3), arrival=i, prebuilt=i % 4 == 3)
        for i in range(7 * size)
    )
    spec = SpecShape(topk=2, hidden=0, confidence=3)
    return _small_spec("spec_confidence", "spec decode with the confidence relay", reqs, spec)


def spec_mixed(size: int = 1, seed: int = 0) -> Scenario:
    """Spec decode with chunked prefill merged into running spec rows (gather protocol):
    the host plans each MIXED batch before the last verify's accept lengths land, and
    resolve binds its running rows' lengths from the published ones (SGLang's
    `resolve_mixed_spec_tails`). Arrivals keep prefill chunks coming beside the decodes."""
    reqs = tuple(
        Request(i, 4 + (5 * i) % 9, 6 + 2 * (i % 4), arrival=2 * i) for i in range(6 * size)
    )
    pol = Policy(mixed=True, chunk=3, max_prefill_rows=1, max_prefill_tokens=6, max_running=4)
    return Scenario(
        "spec_mixed",
        "spec decode with MIXED batches (gather protocol)",
        reqs,
        5,
        pol,
        spec=SpecShape(topk=2, hidden=4),
        batch_buckets=(4,),
        token_buckets=(16,),
        protocols=("gather",),
    )


def spec_mixed_reuse(size: int = 1, seed: int = 0) -> Scenario:
    """Spec MIXED batches through a tiny pool (gather protocol): each retirement's slot is
    reused at once, PREBUILT bootstraps and idle steps come between. Debug consumes every
    verified length a spec DECODE reads and holds each host read of lengths to a fresh
    publish; the host rebinds each MIXED batch's running rows (seq_lens_cpu, seq_lens_sum,
    prefix_lens) and learns their lengths from it."""
    reqs = tuple(
        Request(i, 3 + (3 * i) % 5, 4 + 2 * (i % 3), arrival=i, prebuilt=i % 5 == 3)
        for i in range(7 * size)
    )
    pol = Policy(
        mixed=True, chunk=2, max_prefill_rows=1, max_prefill_tokens=4, max_running=3, idle_every=6
    )
    return Scenario(
        "spec_mixed_reuse",
        "spec MIXED batches, slot reuse, bootstraps and idle steps (gather protocol)",
        reqs,
        4,
        pol,
        spec=SpecShape(topk=2, hidden=0, verified_id=True),
        batch_buckets=(4,),
        token_buckets=(8,),
        protocols=("gather",),
    )


def random_mix(size: int = 1, seed: int = 0) -> Scenario:
    """A seeded random mix of every feature above (non-spec)."""
    rng = random.Random(seed)
    n = rng.randint(4, 12) * size
    pool = rng.randint(3, 9)
    reqs = tuple(
        Request(
            i,
            rng.randint(1, 30),
            rng.randint(1, 12),
            rng.randint(0, 3 * n),
            prebuilt=rng.random() < 0.2,
        )
        for i in range(n)
    )
    pol = Policy(
        mixed=rng.random() < 0.6,
        chunk=rng.choice([None, 3, 7]),
        max_prefill_rows=rng.randint(1, 3),
        max_prefill_tokens=rng.choice([8, 16, 24]),
        idle_every=rng.choice([0, 0, 5, 7]),
        max_running=pool - 1,
    )
    return Scenario(
        f"random_mix[{seed}]",
        "seeded mix of all features",
        reqs,
        pool,
        pol,
        batch_buckets=(4, 8),
        token_buckets=(16, 64),
    )


def random_spec_mix(size: int = 1, seed: int = 0) -> Scenario:
    """A seeded random mix for spec decode: chunks, PREBUILT, idle steps, reuse."""
    rng = random.Random(seed + 7919)
    n = rng.randint(3, 9) * size
    pool = rng.randint(3, 7)
    reqs = tuple(
        Request(
            i,
            rng.randint(1, 20),
            rng.randint(1, 25),
            rng.randint(0, 2 * n),
            prebuilt=rng.random() < 0.25,
        )
        for i in range(n)
    )
    pol = Policy(
        chunk=rng.choice([None, 4]),
        max_prefill_rows=rng.randint(1, 3),
        max_prefill_tokens=16,
        idle_every=rng.choice([0, 6]),
        max_running=pool - 1,
    )
    spec = SpecShape(topk=rng.choice([1, 2, 4]), hidden=rng.choice([0, 4]))
    return Scenario(
        f"random_spec_mix[{seed}]",
        "seeded spec mix",
        reqs,
        pool,
        pol,
        spec=spec,
        batch_buckets=(8,),
        token_buckets=(32,),
    )


def dp_overlap(size: int = 1, seed: int = 0) -> Scenario:
    """Data-parallel ranks out of step: each seed arrives, mixes and idles at its own steps.

    On a mesh rank d runs seed d, so at one step some ranks are IDLE while others run, and
    busy ranks differ in kind (DECODE beside EXTEND or MIXED). The pool size does not
    depend on the seed: every rank fits one sharded map.
    """
    rng = random.Random(seed + 31337)
    reqs = tuple(
        Request(i, rng.randint(1, 6), rng.randint(1, 5), arrival=rng.randint(0, 14))
        for i in range(12 * size)
    )
    pol = Policy(
        mixed=True,
        max_prefill_rows=3,
        max_prefill_tokens=12,
        idle_every=5,
        idle_phase=seed % 5,
        max_running=7,
    )
    return Scenario(
        "dp_overlap",
        "DP ranks idle and mix kinds at different steps",
        reqs,
        8,
        pol,
        batch_buckets=(4, 8),
        token_buckets=(16, 32),
    )


def long_run(size: int = 1, seed: int = 0) -> Scenario:
    """1,000+ steps with 256 requests running at once (size scales nothing: it is long)."""
    rng = random.Random(seed + 104729)
    reqs = tuple(
        Request(i, rng.randint(1, 24), rng.randint(150, 420), arrival=rng.randint(0, 600))
        for i in range(620)
    )
    pol = Policy(mixed=True, chunk=16, max_prefill_rows=8, max_prefill_tokens=128, max_running=256)
    return Scenario(
        "long_run",
        "1000+ steps, 256 concurrent requests",
        reqs,
        257,
        pol,
        batch_buckets=(256,),
        token_buckets=(512,),
        max_steps=1200,
    )


def one_row(size: int = 1, seed: int = 0) -> Scenario:
    """One request at a time in batches of one row (batch bucket 1): each op's one-row
    path, slots reused as requests retire."""
    reqs = tuple(Request(i, 1 + (3 * i) % 5, 2 + i % 3, arrival=i) for i in range(4 * size))
    return Scenario(
        "one_row",
        "batches of one row",
        reqs,
        3,
        Policy(max_running=1, max_prefill_rows=1, max_prefill_tokens=6),
        batch_buckets=(1,),
        token_buckets=(1, 8),
    )


def one_row_spec(size: int = 1, seed: int = 0) -> Scenario:
    """Spec decode in batches of one row: the draft fields read and written one row at a
    time."""
    reqs = tuple(Request(i, 2 + i % 3, 6 + i % 4, arrival=i) for i in range(3 * size))
    return Scenario(
        "one_row_spec",
        "spec decode, batches of one row",
        reqs,
        3,
        Policy(max_running=1, max_prefill_rows=1, max_prefill_tokens=6),
        spec=SpecShape(topk=2, hidden=4),
        batch_buckets=(1,),
        token_buckets=(1, 8),
    )


def owned_relay(size: int = 1, seed: int = 0) -> Scenario:
    """The engine owns the relay's lengths and tokens buffers (fm_torch adopts them and
    skips the writes the engine already made), with slot reuse and idle steps."""
    reqs = tuple(Request(i, 2 + i % 5, 3 + (5 * i) % 6, arrival=i // 2) for i in range(8 * size))
    return Scenario(
        "owned_relay",
        "engine-owned relay buffers",
        reqs,
        5,
        Policy(max_running=4, max_prefill_tokens=12, idle_every=7),
        batch_buckets=(4,),
        token_buckets=(16,),
        owned_relay=True,
    )


Builder = Callable[[int, int], Scenario]

CATALOGUE: dict[str, Builder] = {
    "steady_decode": steady_decode,
    "prefill_then_decode": prefill_then_decode,
    "chunked_prefill": chunked_prefill,
    "mixed_batches": mixed_batches,
    "retire_reuse": retire_reuse,
    "abort_reuse": abort_reuse,
    "retract_resume": retract_resume,
    "prefill_burst": prefill_burst,
    "idle_steps": idle_steps,
    "padded_batches": padded_batches,
    "prebuilt_bootstrap": prebuilt_bootstrap,
    "spec_decode": spec_decode,
    "spec_verified": spec_verified,
    "spec_sglang_eagle": spec_sglang_eagle,
    "spec_partial": spec_partial,
    "spec_ngram": spec_ngram,
    "spec_confidence": spec_confidence,
    "spec_mixed": spec_mixed,
    "spec_mixed_reuse": spec_mixed_reuse,
    "random_mix": random_mix,
    "random_spec_mix": random_spec_mix,
    "dp_overlap": dp_overlap,
    "long_run": long_run,
    "one_row": one_row,
    "one_row_spec": one_row_spec,
    "owned_relay": owned_relay,
}
"""Scenario name -> builder(size, seed). The default run takes every entry at size 1."""


def build(name: str, *, size: int = 1, seed: int = 0) -> Scenario:
    """The named scenario; ValueError listing the names when `name` is unknown."""
    if name not in CATALOGUE:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(CATALOGUE)}")
    return CATALOGUE[name](size, seed)


def runs_under(name: str, protocol: str) -> bool:
    """Whether the named scenario runs under `protocol` (`Scenario.protocols`)."""
    return protocol in build(name).protocols
