"""A non-spec overlap loop driven through fm_torch.FutureMap matches a plain synchronous loop.

Both loops run the same schedule (which request runs which prefill chunk or decode in which
step) with the same tiny deterministic integer "model":
    next token = (7 * input_id + 3 * position + 5 * slot) % 11,  position = seq_len - 1,
so tokens are often 0 (the token that must pass through resolve unchanged). The synchronous
loop knows every token on the host. The overlap loop never does: a decode row carries the
sentinels that `invalidate` left, and the forward sees only what `resolve` restored from the
buffers (ids, and for DECODE the lengths), exactly as docs/CONTRACT.md's 'One overlap step'
orders it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fm_torch import ForwardMode, FutureMap, ScheduleBatch

VOCAB = 11


def model(ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The tiny deterministic model: one next token per row."""
    return (7 * ids.to(torch.int64) + 3 * positions.to(torch.int64) + 5 * slots) % VOCAB


# A row of a step: ("prefill", request, slot, chunk_len) | ("decode", request, slot) | ("pad",).
Row = tuple
Step = list[Row]


@dataclass
class Request:
    prompt: list[int]
    prefilled: int = 0
    outputs: list[int] = field(default_factory=list)


def batch_mode(step: Step) -> ForwardMode:
    kinds = {row[0] for row in step if row[0] != "pad"}
    if not kinds:
        return ForwardMode.IDLE
    if kinds == {"prefill"}:
        return ForwardMode.EXTEND
    if kinds == {"decode"}:
        return ForwardMode.DECODE
    return ForwardMode.MIXED


def run_sync(prompts: dict[str, list[int]], schedule: list[Step]) -> dict[str, list[int]]:
    """Reference: every token is known on the host when the next batch is built."""
    reqs = {name: Request(list(p)) for name, p in prompts.items()}
    for step in schedule:
        for row in step:
            if row[0] == "pad":
                continue
            req, slot = reqs[row[1]], row[2]
            if row[0] == "prefill":
                req.prefilled += row[3]
                last_id, seq_len = req.prompt[req.prefilled - 1], req.prefilled
                final = req.prefilled == len(req.prompt)
            else:
                last_id, seq_len = req.outputs[-1], len(req.prompt) + len(req.outputs)
                final = True
            tok = model(torch.tensor([last_id]), torch.tensor([seq_len - 1]), torch.tensor([slot]))
            if final:  # an intermediate chunk's token is discarded
                req.outputs.append(int(tok[0]))
    return {name: r.outputs for name, r in reqs.items()}


def run_overlap(
    prompts: dict[str, list[int]],
    schedule: list[Step],
    pool_size: int,
    *,
    dtype: torch.dtype = torch.int64,
    debug: bool = True,
    map_type: type[FutureMap] = FutureMap,
) -> dict[str, list[int]]:
    """The overlap loop: decode rows are built from sentinels and resolved on 'device'."""
    fm = map_type(pool_size, dtype=dtype, debug=debug)
    reqs = {name: Request(list(p)) for name, p in prompts.items()}
    sentinel: dict[int, tuple[int, int]] = {}  # slot -> (input_id, seq_len) left by invalidate
    seq_lens_cpu: dict[str, int] = {}  # host-side length of each running request
    for step in schedule:
        mode = batch_mode(step)
        slots, ids, lens, extend_lens = [], [], [], []
        for row in step:  # prefill rows come first in a MIXED batch
            if row[0] == "prefill":
                req, n = reqs[row[1]], row[3]
                ids += req.prompt[req.prefilled : req.prefilled + n]
                lens.append(req.prefilled + n)
                extend_lens.append(n)
                req.prefilled += n
            elif row[0] == "decode":
                sid, slen = sentinel[row[2]]
                assert sid == -row[2] and slen == -row[2]
                ids.append(sid)
                # MIXED: running rows' lengths are restored from the host before the merge.
                lens.append(seq_lens_cpu[row[1]] if mode == ForwardMode.MIXED else slen)
                extend_lens.append(1)
            else:
                ids.append(0)
                lens.append(0)
                extend_lens.append(1)
            slots.append(0 if row[0] == "pad" else row[2])
        indices = torch.tensor(slots, dtype=torch.int64)
        batch = ScheduleBatch(
            mode, indices, torch.tensor(ids, dtype=dtype), torch.tensor(lens, dtype=dtype)
        )

        # --- forward: sees only the resolved batch ---
        fm.resolve(batch)
        # Padding rows' lengths are slot 0's garbage (in debug, at first, the poison).
        live = indices > 0
        assert bool((batch.input_ids >= 0).all()) and bool((batch.seq_lens[live] >= 0).all())
        last = torch.tensor(extend_lens, dtype=torch.int64).cumsum(0) - 1
        out = model(batch.input_ids[last], batch.seq_lens - 1, indices)
        fm.publish(indices, batch.seq_lens + 1)
        fm.stash(indices, out.to(dtype))
        fm.invalidate(batch, indices)
        for i, s in enumerate(slots):
            if s != 0:
                sentinel[s] = (int(batch.input_ids[i]), int(batch.seq_lens[i]))
            else:
                assert int(batch.input_ids[i]) == 0 and int(batch.seq_lens[i]) == 0

        # --- host result processing (one step late in a real engine; not used to schedule) ---
        for i, row in enumerate(step):
            if row[0] == "pad":
                continue
            req = reqs[row[1]]
            if row[0] == "prefill" and req.prefilled < len(req.prompt):
                continue
            req.outputs.append(int(out[i]))
            seq_lens_cpu[row[1]] = len(req.prompt) + len(req.outputs)
    return {name: r.outputs for name, r in reqs.items()}


# ------------------------------------------------------------------------- a fixed scenario
PROMPTS = {"A": [3, 1, 4, 1, 5], "B": [0, 2, 6], "C": [9, 0, 0, 2], "D": [1]}
SCHEDULE: list[Step] = [
    [("prefill", "A", 1, 5), ("prefill", "B", 2, 2)],  # EXTEND; B is an intermediate chunk
    [("prefill", "B", 2, 1), ("decode", "A", 1)],  # MIXED: B's last chunk + running A
    [("decode", "A", 1), ("decode", "B", 2), ("pad",)],  # DECODE with a padding row
    [],  # IDLE
    [("decode", "B", 2), ("decode", "A", 1)],  # DECODE, rows in another order
    [("decode", "A", 1), ("decode", "B", 2)],  # A retires after this step
    [("prefill", "C", 1, 4)],  # EXTEND: C reuses A's freed slot 1 at once; B waits
    [("prefill", "D", 3, 1), ("decode", "B", 2), ("decode", "C", 1)],  # MIXED
    [("decode", "C", 1), ("decode", "D", 3), ("decode", "B", 2), ("pad",), ("pad",)],
    [],  # IDLE
    [("decode", "D", 3), ("decode", "C", 1)],
]


def test_sync_reference_matches_hand_worked_first_tokens():
    """Pins: the reference loop itself drifting (the overlap comparison would then be moot)."""
    out = run_sync(PROMPTS, SCHEDULE)
    # A: last prompt id 5 at position 4 in slot 1: (35 + 12 + 5) % 11 = 8.
    # A's first decode: id 8 at position 5: (56 + 15 + 5) % 11 = 10.
    assert out["A"][:2] == [8, 10]
    # B: last prompt id 6 at position 2 in slot 2: (42 + 6 + 10) % 11 = 3.
    assert out["B"][0] == 3
    assert [len(out[r]) for r in "ABCD"] == [5, 6, 4, 3]
    # D: id 1 at position 0 in slot 3: (7 + 0 + 15) % 11 = 0, which its next decode reads back.
    assert out["D"][0] == 0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("debug", [True, False])
def test_overlap_loop_matches_sync_loop(dtype: torch.dtype, debug: bool):
    """Pins: any relay fault across prefill, chunked prefill, mixed, decode, idle, padding and
    slot reuse: a wrong slot, a lost or stale token, a lost length, a token 0 mistaken for a
    sentinel. In debug mode the whole run also passes the WRWR consume check."""
    assert run_overlap(PROMPTS, SCHEDULE, 4, dtype=dtype, debug=debug) == run_sync(
        PROMPTS, SCHEDULE
    )


def test_overlap_loop_notices_a_skipped_stash():
    """Pins: the comparison being unable to fail; dropping one stash must change the tokens."""

    class DroppingFutureMap(FutureMap):
        calls = 0

        def stash(self, indices, payload):  # type: ignore[no-untyped-def]
            DroppingFutureMap.calls += 1
            if DroppingFutureMap.calls != 3:
                super().stash(indices, payload)

    got = run_overlap(PROMPTS, SCHEDULE, 4, debug=False, map_type=DroppingFutureMap)
    assert got != run_sync(PROMPTS, SCHEDULE)


# ----------------------------------------------------------------------- random schedules
def random_schedule(
    rng: random.Random, pool_size: int, steps: int
) -> tuple[dict[str, list[int]], list[Step]]:
    """A valid random schedule: admissions into free slots (freed slots reused at once),
    chunked prefills, DECODE with padding, MIXED, IDLE, requests retiring."""
    prompts: dict[str, list[int]] = {}
    free = list(range(pool_size - 1, 0, -1))
    prefilling: dict[str, tuple[int, int]] = {}  # request -> (slot, tokens left)
    running: dict[str, tuple[int, int]] = {}  # request -> (slot, tokens still to generate)
    schedule: list[Step] = []
    for _ in range(steps):
        while free and rng.random() < 0.5:
            name = f"r{len(prompts)}"
            prompts[name] = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
            prefilling[name] = (free.pop(), len(prompts[name]))
        kinds = ["extend"] * bool(prefilling) + ["decode"] * bool(running)
        kinds += ["mixed"] * bool(prefilling and running)
        kind = "idle" if not kinds or rng.random() < 0.1 else rng.choice(kinds)
        step: Step = []
        if kind in ("extend", "mixed") and prefilling:
            for name in rng.sample(sorted(prefilling), k=min(2, len(prefilling))):
                slot, left = prefilling[name]
                n = rng.randint(1, left)
                step.append(("prefill", name, slot, n))
                if n == left:
                    del prefilling[name]
                    running[name] = (slot, rng.randint(0, 3))
                else:
                    prefilling[name] = (slot, left - n)
        if kind in ("decode", "mixed") and running:
            names = [n for n in sorted(running) if not any(r[1] == n for r in step)]
            chosen = [n for n in names if rng.random() < 0.8] or names[:1]
            rng.shuffle(chosen)
            for name in chosen:
                slot, left = running[name]
                step.append(("decode", name, slot))
                running[name] = (slot, left - 1)
            if kind == "decode" and chosen:
                step += [("pad",)] * rng.randint(0, 2)
        for name, (slot, left) in list(running.items()):
            if left <= 0:  # retire: the slot is free for the very next admission
                del running[name]
                free.append(slot)
        schedule.append(step)
    return prompts, schedule


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_overlap_loop_matches_sync_loop_on_random_schedules(seed: int, dtype: torch.dtype):
    """Pins: relay faults that only a particular interleaving of chunked prefills, mixed
    batches, idle steps, padding and immediate slot reuse would show."""
    prompts, schedule = random_schedule(random.Random(seed), pool_size=5, steps=12)
    want = run_sync(prompts, schedule)
    assert run_overlap(prompts, schedule, 5, dtype=dtype, debug=True) == want
