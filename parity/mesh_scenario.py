"""A deterministic data-parallel overlap scenario: each DP rank's host schedule, step by step.

Each rank runs its own scheduler over its own pool of R slots: requests arrive (EXTEND, or
MIXED when decode requests are running), decode for a few steps (DECODE, sentinels in ids
and lengths), retire, and their slots go to new arrivals at once. Ranks go quiet in turns,
so some steps find a rank IDLE (no rows) while others run.

The schedule depends on nothing the device computes: tokens flow only through the map
(`forward_tokens` is the stand-in model), so any driver can replay it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fm_jax import ForwardMode

VOCAB = 50_000


@dataclass(frozen=True)
class RankStep:
    """One rank's batch at one step, as its host scheduler builds it (before resolve).

    `input_ids` is flat: prefill rows contribute their prompts (positive ids), decode rows
    one sentinel each (-slot). `seq_lens` holds real lengths for prefill rows, the host's
    restored lengths for MIXED decode rows, and -slot for DECODE rows. `host_lens` is the
    host's own count of every row's length, to check resolved lengths against.
    """

    mode: ForwardMode
    slots: np.ndarray  # [B] int32, rank-local
    input_ids: np.ndarray  # [T] int32
    seq_lens: np.ndarray  # [B] int32
    row_tokens: np.ndarray  # [B] tokens each row contributes to input_ids
    host_lens: np.ndarray  # [B] int32


@dataclass(frozen=True)
class Scenario:
    """`steps[s][d]`: rank d's batch at step s; an IDLE step has no rows."""

    name: str
    dp: int
    pool_size: int
    steps: tuple[tuple[RankStep, ...], ...]

    def max_rows(self, step: int) -> int:
        """The largest rank's row count at `step` (what a DP sync agrees on)."""
        return max(r.slots.shape[0] for r in self.steps[step])

    def max_tokens(self, step: int) -> int:
        """The largest rank's token count at `step`."""
        return max(r.input_ids.shape[0] for r in self.steps[step])


def _empty() -> RankStep:
    z = np.zeros((0,), np.int32)
    return RankStep(ForwardMode.IDLE, z, z, z, z, z)


def data_parallel_scenario(
    dp: int, *, pool_size: int = 8, steps: int = 12, seed: int = 0, name: str = "dp_overlap"
) -> Scenario:
    """A reproducible DP overlap scenario (same arguments, same schedule).

    Args:
      dp: number of DP ranks.
      pool_size: R, slots per rank (R-1 live requests at most).
      steps: scheduler steps.
      seed: schedule seed; rank d draws from seed*1000 + d, so ranks differ.
      name: label for reports.

    Returns:
      Scenario whose ranks are idle in turns (rank d is quiet for steps where
      (step + d) % 5 == 4 and it has nothing running).
    """
    per_step: list[list[RankStep]] = [[] for _ in range(steps)]
    for d in range(dp):
        rng = np.random.default_rng(seed * 1000 + d)
        running: dict[int, list[int]] = {}  # slot -> [host length, decodes left]
        free = list(range(1, pool_size))
        for s in range(steps):
            quiet = (s + d) % 5 == 4
            arrivals: list[int] = []
            if not quiet and free:
                n_new = int(rng.integers(0, min(3, len(free)) + 1))
                if not running:
                    n_new = max(n_new, 1)
                arrivals = [free.pop(0) for _ in range(n_new)]
            decoding = sorted(running) if not quiet else []
            if not arrivals and not decoding:
                per_step[s].append(_empty())
                continue
            slots, ids, lens, row_tokens, host_lens = [], [], [], [], []
            for slot in arrivals:  # prefill rows first
                plen = int(rng.integers(1, 5))
                ids.extend(int(t) for t in rng.integers(0, VOCAB, plen))
                slots.append(slot)
                lens.append(plen)
                row_tokens.append(plen)
                host_lens.append(plen)
                running[slot] = [plen, int(rng.integers(1, 5))]
            mixed = bool(arrivals)
            for slot in decoding:
                slots.append(slot)
                ids.append(-slot)
                lens.append(running[slot][0] if mixed else -slot)
                row_tokens.append(1)
                host_lens.append(running[slot][0])
            mode = (
                ForwardMode.MIXED
                if arrivals and decoding
                else ForwardMode.EXTEND
                if arrivals
                else ForwardMode.DECODE
            )
            per_step[s].append(
                RankStep(
                    mode,
                    np.array(slots, np.int32),
                    np.array(ids, np.int32),
                    np.array(lens, np.int32),
                    np.array(row_tokens, np.int32),
                    np.array(host_lens, np.int32),
                )
            )
            for slot in slots:  # after this forward: one more token each
                running[slot][0] += 1
            for slot in decoding:
                running[slot][1] -= 1
                if running[slot][1] == 0:
                    del running[slot]
                    free.append(slot)
    return Scenario(name, dp, pool_size, tuple(tuple(r) for r in per_step))


def forward_tokens(
    step: RankStep, resolved_ids: np.ndarray, resolved_lens: np.ndarray, step_no: int
) -> tuple[np.ndarray, np.ndarray]:
    """The stand-in model: each row's next token from its last resolved input token.

    Returns (tokens [B], new_seq_lens [B]); new length = resolved length + 1 (non-spec).
    """
    ends = np.cumsum(step.row_tokens) - 1
    last = resolved_ids[ends].astype(np.int64)
    tokens = (last * 1_103_515 + step.slots.astype(np.int64) * 12_345 + step_no) % VOCAB
    return tokens.astype(np.int32), (resolved_lens + 1).astype(np.int32)
