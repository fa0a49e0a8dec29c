"""A StepPlan as the padded host arrays that a scheduler hands the FutureMap and the forward."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fm_parity.scenario import Kind, Row, Scenario, StepPlan
from fm_parity.toy_model import prompt_tokens

# ForwardMode values shared by fm_jax and fm_torch (docs/CONTRACT.md, 'Batch kinds').
MODE = {Kind.EXTEND: 0, Kind.DECODE: 1, Kind.MIXED: 2, Kind.IDLE: 3, Kind.PREBUILT: 0}

Placeholder = Callable[[Row], tuple[int, int]]
"""A decode row's (input id, seq_len) as the batch carries it before resolve."""

Produced = Callable[[int], Sequence[int]]
"""Request id -> the tokens it has produced so far, as the host read them (a resumed
request's recomputed prompt ends with them)."""


@dataclass(frozen=True)
class HostBatch:
    """Padded host arrays of one step. Live rows come first; padding rows hold slot 0.

    Attributes:
      mode: ForwardMode value.
      slots: [B] req_pool_indices (padded to a batch bucket).
      input_ids: [T] flat ids (padded to a token bucket with token 0).
      seq_lens: [B] lengths (padding rows: 0).
      last_index: [B] index into input_ids of each row's last token (padding rows: 0).
      token_slots: [T] slot of each token, for reports (padding: 0).
      n_rows, n_tokens: live rows and live tokens.
      spec_decode: a spec DECODE batch (it carries a draft input at `slots`).
      running: [M] a MIXED batch's running (decode) rows' slots, in row order; their
        tokens are the last M of the live tokens (gather protocol: the slots resolve
        gathers them at). Empty for other kinds.
      prefix_lens: [B] the host's prefix lengths (tokens already cached): a prefill
        row's chunk start, a decode row's host length - 1 (spec: a step old), a bootstrap
        row's length; padding rows 0. A spec MIXED resolve rebinds its running rows'.
    """

    plan: StepPlan
    mode: int
    slots: np.ndarray
    input_ids: np.ndarray
    seq_lens: np.ndarray
    last_index: np.ndarray
    token_slots: np.ndarray
    n_rows: int
    n_tokens: int
    spec_decode: bool
    running: np.ndarray
    prefix_lens: np.ndarray

    @property
    def live_slots(self) -> np.ndarray:
        """Slots of the live rows."""
        return self.slots[: self.n_rows]

    @property
    def n_prefill_tokens(self) -> int:
        """Live tokens before the running rows' (all of them but a MIXED batch's tail)."""
        return self.n_tokens - len(self.running)

    @property
    def mixed_token_slots(self) -> np.ndarray:
        """[T] the gather protocol's per-token slots: `running[i]` at the position of the
        i-th running row's token, 0 at prefill and padding positions (gathers nothing)."""
        out = np.zeros(len(self.input_ids), dtype=self.slots.dtype)
        out[self.n_prefill_tokens : self.n_tokens] = self.running
        return out


def bucket(n: int, buckets: tuple[int, ...], what: str) -> int:
    """The smallest bucket >= n (0 stays 0: an IDLE batch is empty)."""
    if n == 0:
        return 0
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} of {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def build(
    plan: StepPlan,
    scenario: Scenario,
    dtype: np.dtype,
    offset: int,
    placeholder: Placeholder,
    produced: Produced = lambda rid: (),
) -> HostBatch:
    """Lay out `plan` as padded arrays.

    Prefill rows carry their prompt chunk (a resumed request's: its own tokens from
    `produced` where its prompt holds them) and real length; decode rows carry
    `placeholder(row)`: sentinels in a sentinel-protocol run, the host's length (and no
    id, 0) in a gather-protocol run.
    """
    if plan.kind is Kind.DECODE:  # the common case, laid out in bulk
        held = [placeholder(row) for row in plan.rows]
        ids = [h[0] for h in held]
        lens = [h[1] for h in held]
        tok_slots = [row.slot for row in plan.rows]
        last = list(range(len(ids)))
        prefix = [row.seq_len - 1 for row in plan.rows]
    else:
        ids, lens, last, tok_slots, prefix = [], [], [], [], []
        for row in plan.rows:
            if row.phase == "prefill":
                own = produced(row.rid) if row.own_from else ()
                ids += prompt_tokens(row.rid, row.start, row.end, offset, row.own_from, own)
                tok_slots += [row.slot] * (row.end - row.start)
                lens.append(row.end)
                prefix.append(row.start)
            elif row.phase == "decode":
                tok, n = placeholder(row)
                ids.append(tok)
                tok_slots.append(row.slot)
                lens.append(n)
                prefix.append(row.seq_len - 1)
            else:  # bootstrap: no forward, no tokens
                lens.append(row.seq_len)
                prefix.append(row.seq_len)
            last.append(len(ids) - 1)
    n_rows, n_tokens = len(plan.rows), len(ids)
    rows = bucket(n_rows, scenario.batch_buckets, "batch rows")
    if plan.kind is Kind.PREBUILT:
        toks = 0
    elif plan.kind is Kind.DECODE:
        toks = rows  # one token per row, padding rows included (twins add rows to token buckets)
    else:
        toks = bucket(n_tokens, scenario.token_buckets, "batch tokens")
    pad_r, pad_t = rows - n_rows, toks - n_tokens
    return HostBatch(
        plan=plan,
        mode=MODE[plan.kind],
        slots=np.array([r.slot for r in plan.rows] + [0] * pad_r, dtype=dtype),
        input_ids=np.array(ids + [0] * pad_t, dtype=dtype),
        seq_lens=np.array(lens + [0] * pad_r, dtype=dtype),
        last_index=np.maximum(np.array(last + [0] * pad_r, dtype=np.int32), 0),
        token_slots=np.array(tok_slots + [0] * pad_t, dtype=dtype),
        n_rows=n_rows,
        n_tokens=n_tokens,
        spec_decode=scenario.spec is not None and plan.kind is Kind.DECODE,
        running=np.array(
            [r.slot for r in plan.rows if r.phase == "decode" and plan.kind is Kind.MIXED],
            dtype=dtype,
        ),
        prefix_lens=np.array(prefix + [0] * pad_r, dtype=np.int64),
    )
