"""The relay between eSurge's steps: fm_jax's gather protocol over stable request slots.

eSurge's rows are not stable (requests move between rows every step), so each request gets a
slot of its own in an fm_jax pool for as long as the runner holds it. A step's sampled tokens
are stashed at their rows' slots at the sampler's tail; the next step's ids are resolved at
its head: where the host has a placeholder (a token still in flight) its `token_slots` entry
names the slot to gather from, everywhere else the host's id is taken as it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax


class RelayError(RuntimeError):
    """eSurge asked the relay for something it does not support, or broke one of its rules."""


@dataclass
class Timeline:
    """When each step was dispatched and when its tokens reached the host (monotonic s)."""

    dispatched: dict[int, float] = field(default_factory=dict)
    drained: dict[int, float] = field(default_factory=dict)
    host_s: dict[int, float] = field(default_factory=dict)  # host time of the dispatching call
    decode_rows: dict[int, int] = field(default_factory=dict)  # rows that gathered a token

    def overlapped_steps(self) -> list[int]:
        """Steps whose successor was dispatched before their tokens reached the host."""
        return [
            n
            for n in sorted(self.drained)
            if n + 1 in self.dispatched and self.dispatched[n + 1] < self.drained[n]
        ]


class Relay:
    """Slots, the fm_jax state, and the two jitted ops eSurge's step calls."""

    def __init__(self, max_num_seqs: int) -> None:
        # A request keeps its slot until it leaves the runner, which may be a step after a
        # new request took its row: twice the rows, plus padding slot 0, never runs out.
        self.pool_size = 2 * max_num_seqs + 1
        self.ops = fm_jax.future_map(self.pool_size, protocol="gather")
        self.state = self.ops.init()
        self.slots: dict[str, int] = {}
        self.free: list[int] = list(range(self.pool_size - 1, 0, -1))
        # request id -> position of its token still in flight (one step at most)
        self.pending: dict[str, int] = {}
        # AsyncPreResults of dispatched steps whose tokens the host has not applied yet
        self.deferred: list[Any] = []
        self.timeline = Timeline()
        # counters the tests and figures read
        self.allocations = 0
        self.slot_history: list[int] = []
        self.row_moves = 0
        self.gathered = 0
        self.penalty_corrections = 0
        self._rows: dict[str, int] = {}
        self.step = 0
        self.windows_this_step = 0
        self._ctx: tuple[np.ndarray, np.ndarray] | None = None
        ops = self.ops

        def resolve(state: Any, ids: jax.Array, row_slots: jax.Array, token_slots: jax.Array):
            batch = fm_jax.Batch(
                fm_jax.ForwardMode.MIXED,
                row_slots,
                ids.astype(jnp.int32),
                jnp.zeros_like(row_slots),
                token_slots=token_slots,
            )
            _, r = ops.resolve(state, batch)
            return r.input_ids.astype(ids.dtype)

        def stash(state: Any, row_slots: jax.Array, tokens: jax.Array, valid: jax.Array):
            slots = jnp.where(valid, row_slots, 0)
            return ops.stash(state, slots, tokens.astype(jnp.int32))

        def correct_counts(counts, state, rows, slots, placeholder):
            # rows whose last token is in flight were counted as the placeholder: move that
            # count to the token the relay holds for the row's slot
            tok = state.output_tokens[slots]
            live = slots > 0
            counts = counts.at[rows, placeholder].add(jnp.where(live, -1, 0).astype(counts.dtype))
            return counts.at[rows, tok].add(live.astype(counts.dtype))

        opts = fm_jax.compiler_options()
        self._resolve = jax.jit(resolve, compiler_options=opts)
        self._stash = jax.jit(stash, donate_argnums=0, compiler_options=opts)
        self._correct = jax.jit(correct_counts, compiler_options=opts)

    # -- slots ------------------------------------------------------------------------
    def slot_of(self, req_id: str) -> int:
        slot = self.slots.get(req_id)
        if slot is None:
            if not self.free:
                raise RelayError(
                    f"no free relay slot for request {req_id!r} ({self.pool_size - 1} in use)"
                )
            slot = self.slots[req_id] = self.free.pop()
            self.allocations += 1
            self.slot_history.append(slot)
        return slot

    def release_absent(self, live: Any) -> None:
        """Free the slots of requests the runner no longer holds."""
        for rid in [r for r in self.slots if r not in live]:
            self.free.append(self.slots.pop(rid))
            self.pending.pop(rid, None)
            self._rows.pop(rid, None)

    # -- one window: host side -----------------------------------------------------------
    def plan(
        self,
        req_ids: list[str | None],
        rows: np.ndarray,
        scheduled: np.ndarray,
        num_computed: np.ndarray,
        num_tokens: int,
        padded_num_reqs: int,
    ) -> None:
        """Token slots ([num_tokens]) and row slots ([padded_num_reqs]) for one window, in
        eSurge's packed layout: rows in order, each row's scheduled tokens contiguous."""
        token_slots = np.zeros(num_tokens, np.int32)
        row_slots = np.zeros(padded_num_reqs, np.int32)
        off = 0
        gathered = 0
        for i, rid in enumerate(req_ids):
            n = int(scheduled[i])
            if n <= 0 or rid is None:
                continue
            slot = self.slot_of(rid)
            row = int(rows[i])
            if self._rows.get(rid, row) != row:
                self.row_moves += 1
            self._rows[rid] = row
            if i < padded_num_reqs:
                row_slots[i] = slot
            pos = self.pending.get(rid)
            start = int(num_computed[i])
            if pos is not None and start <= pos < start + n:
                token_slots[off + pos - start] = slot
                gathered += 1
            off += n
        self._ctx = (row_slots, token_slots)
        self.timeline.decode_rows[self.step] = gathered
        self.gathered += gathered

    def clear(self) -> None:
        self._ctx = None

    # -- one window: device side -------------------------------------------------------
    def resolve_ids(self, ids: jax.Array) -> jax.Array:
        if self._ctx is None:
            raise RelayError("resolve called outside a planned window")
        row_slots, token_slots = self._ctx
        if ids.shape[0] != token_slots.shape[0]:
            pad = np.zeros(ids.shape[0], np.int32)
            n = min(ids.shape[0], token_slots.shape[0])
            if np.any(token_slots[n:]):
                raise RelayError(
                    f"token slots past the id buffer ({ids.shape[0]} ids, "
                    f"{token_slots.shape[0]} planned)"
                )
            pad[:n] = token_slots[:n]
            token_slots = pad
        return self._resolve(self.state, ids, row_slots, token_slots)

    def stash_tokens(self, tokens: jax.Array, valid: jax.Array) -> None:
        if self._ctx is None:
            raise RelayError("stash called outside a planned window")
        row_slots = self._ctx[0]
        b = tokens.shape[0]
        if b != row_slots.shape[0]:
            fitted = np.zeros(b, np.int32)
            n = min(b, row_slots.shape[0])
            fitted[:n] = row_slots[:n]
            row_slots = fitted
        self.state = self._stash(self.state, row_slots, tokens, valid)

    def correct_penalty_counts(self, counts: jax.Array, runner: Any, placeholder: int) -> jax.Array:
        """Counts rebuilt from the host's tokens hold `placeholder` at each in-flight position;
        swap it for the token in flight, read from the relay on the device."""
        rows, slots = [], []
        buf = runner.sequence_buffer
        for rid, pos in self.pending.items():
            row = buf.req_id_to_index.get(rid)
            if row is None or int(buf.num_tokens[row]) <= pos:
                continue
            rows.append(row)
            slots.append(self.slots[rid])
        if not rows:
            return counts
        size = 1 << (len(rows) - 1).bit_length()  # a few shapes, not one per count
        r = np.zeros(size, np.int32)
        s = np.zeros(size, np.int32)
        r[: len(rows)] = rows
        s[: len(slots)] = slots
        self.penalty_corrections += 1
        return self._correct(counts, self.state, r, s, placeholder)

    def now(self) -> float:
        return time.monotonic()
