"""Random op sequences, good and bad, through every implementation against a model.

A hypothesis rule-based state machine drives publish / stash / resolve /
resolve_seq_lens_cpu / invalidate calls (each either good or with one fault: a slot out
of range, a live slot twice, a negative token or length, a sentinel naming no slot, a
DECODE batch with more ids than rows, a forward mode that is none; and, as good input, a
sentinel naming a slot outside its batch) through three implementations at once, all in
debug mode:
- fm_jax's FutureMap class (host numpy rows);
- fm_jax's pure ops, jitted once per op at fixed padded shapes, under checkify;
- fm_torch (CPU tensors).
`Model` below is the contract in plain Python (dicts, docs/CONTRACT.md's words). After every call
each implementation must give the model's outputs, hold the model's live slots in every
buffer, and refuse (FutureMapError naming the field) or report (InvariantViolation
naming the invariant) exactly what the model says. Slot 0 is padding: garbage, never
compared.

Where the implementations differ by design, the model says how: a refused call changes
nothing anywhere (the pure ops, which cannot read values when traced, must report it as
a violation instead; their result is dropped). A debug violation on valid input: the
fm_jax ops run on and write their poison; fm_torch on CPU raises before writing, so the
test writes the same poison into its buffer (what fm_torch's CUDA path, which asserts on
the device, would hold) and all three go on alike.

Reproducing a failure: hypothesis prints the failing call sequence and a
`@reproduce_failure` blob; the run's seed is printed too (set FM_CONTRACT_SEED to rerun
with it). Nothing is saved to an example database.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test, initialize, rule
from jax.experimental import checkify

import fm_jax as fj
import fm_torch as ft

R = 5  # live slots 1..4
ROWS = TOKENS = 4  # the one bucket: every call compiles once
LIVE = list(range(1, R))
POISON = -1
EXTEND, DECODE, MIXED, IDLE = (int(m) for m in fj.ForwardMode)
SEED = int(os.environ.get("FM_CONTRACT_SEED") or random.SystemRandom().randrange(2**32))
SETTINGS = settings(
    max_examples=int(os.environ.get("FM_CONTRACT_EXAMPLES", "150")),
    stateful_step_count=30,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------------------- the model
@dataclass
class Outcome:
    """What the contract says a call does.

    Attributes:
      refused: the field a FutureMapError must name ('' when the call is good).
      traced: the invariant the pure ops report instead of refusing (None: they cannot
        see this fault; nothing to check), for a refused call.
      violation: the invariant a debug check reports on good input ('' when none).
      out: the call's outputs (resolve: ids and lengths; reads: lengths; invalidate:
        sentinels).
      poisoned: slots whose token the call poisons (a resolve).
    """

    refused: str = ""
    traced: str | None = None
    violation: str = ""
    out: dict[str, list[int]] = field(default_factory=dict)
    poisoned: list[int] = field(default_factory=list)


@dataclass
class Model:
    """The buffers' live slots, in plain Python."""

    tokens: dict[int, int] = field(default_factory=lambda: dict.fromkeys(LIVE, POISON))
    lens: dict[int, int] = field(default_factory=lambda: dict.fromkeys(LIVE, 0))

    @staticmethod
    def slot_fault(slots: list[int]) -> str | None:
        if any(not 0 <= s < R for s in slots):
            return "slot range"
        live = [s for s in slots if s]
        return "duplicate live slot" if len(set(live)) != len(live) else None

    def write(self, op: str, slots: list[int], values: list[int]) -> Outcome:
        """publish (lengths) or stash (tokens)."""
        name = "new_seq_lens" if op == "publish" else "tokens"
        bad = self.slot_fault(slots)
        if bad:
            return Outcome(refused="indices", traced=bad)
        if any(v < 0 for v in values):
            inv = "published lengths >= 0" if op == "publish" else "stashed tokens >= 0"
            return Outcome(refused=name, traced=inv)
        buf = self.lens if op == "publish" else self.tokens
        for s, v in zip(slots, values, strict=True):
            if s:
                buf[s] = v
        return Outcome()

    def read(self, slots: list[int]) -> Outcome:
        """resolve_seq_lens_cpu."""
        bad = self.slot_fault(slots)
        if bad:
            return Outcome(refused="indices", traced=bad)
        return Outcome(out={"lens": [self.lens[s] if s else None for s in slots]})  # type: ignore[misc]

    def resolve(self, mode: Any, slots: list[int], ids: list[int], lens: list[int]) -> Outcome:
        bad = self.slot_fault(slots)
        if bad:
            return Outcome(refused="req_pool_indices", traced=bad)
        unpublished = mode == DECODE and any(s and self.lens[s] <= 0 for s in slots)
        if any(i <= -R for i in ids):
            # the ops check restored lengths before sentinels: the first failure is named
            first = "seq_lens > 0" if unpublished else "sentinel range"
            return Outcome(refused="input_ids", traced=first)
        if isinstance(mode, bool) or mode not in (EXTEND, DECODE, MIXED, IDLE):
            # the pure ops hold the mode traced: a bool is no int (refused when traced)
            return Outcome(refused="forward_mode", traced=None if mode is True else "forward mode")
        if mode == DECODE and len(ids) != len(slots):
            return Outcome(refused="input_ids", traced=None)  # padded shapes hide it
        got = Outcome()
        out_lens = list(lens)
        if mode == DECODE:
            out_lens = [self.lens[s] if s else None for s in slots]  # type: ignore[misc]
            if unpublished:
                got.violation = "seq_lens > 0"
        read = [-i for i in ids if i < 0]
        out_ids = [self.tokens[-i] if i < 0 else i for i in ids]
        if not got.violation and any(self.tokens[s] < 0 for s in read):
            got.violation = "consume (WRWR)"
        got.out = {"ids": out_ids, "lens": out_lens}
        got.poisoned = sorted({s for s in [*slots, *read] if s})
        for s in got.poisoned:
            self.tokens[s] = POISON
        return got


# ------------------------------------------------------------ the implementations' setup
@functools.cache
def _class_map() -> fj.FutureMap:
    """One class map for every example (reset by `_reset_class`): a fresh map per example
    would compile its executables again."""
    return fj.FutureMap(R, debug=True, batch_buckets=(ROWS,), token_buckets=(TOKENS,))


_OPS = fj.future_map(R, debug=True)


def _checked(fn: Any) -> Any:
    return jax.jit(checkify.checkify(fn, errors=checkify.user_checks))


_PURE = {
    "publish": _checked(_OPS.publish),
    "stash": _checked(_OPS.stash),
    "resolve": _checked(_OPS.resolve),
    "read": _checked(_OPS.seq_lens_at),
    "invalidate": jax.jit(_OPS.invalidate),
}


def _reset_class(fm: fj.FutureMap) -> None:
    """Bring the shared class map to the model's start (lengths 0, tokens poisoned), with
    public ops only."""
    with contextlib.suppress(fj.InvariantViolation):
        fm.check()  # an earlier failing example may have left errors pending
    live = np.array(LIVE)
    fm.publish(live, np.zeros(len(LIVE), np.int64))
    fm.stash(live, np.zeros(len(LIVE), np.int64))
    ones = np.ones(len(LIVE), np.int64)
    fm.resolve(fj.Batch(fj.ForwardMode.EXTEND, live, ones, ones))  # poisons every live slot
    fm.check()


def _pad(xs: list[int], n: int) -> jax.Array:
    return jnp.asarray(np.array([*xs, *[0] * (n - len(xs))], np.int32))


def _live(buf: Any) -> list[int]:
    return [int(x) for x in np.asarray(buf)[1:R]]


# ------------------------------------------------------------------------ the machine
slot_lists = st.lists(st.sampled_from(LIVE), max_size=3, unique=True).flatmap(
    lambda live: (
        st.permutations([*live, *[0] * (len(live) < 3)]) if live else st.sampled_from([[], [0]])
    )
)
faults = st.sampled_from([None, None, None, "slot", "dup", "negative"])


def _with_slot_fault(slots: list[int], fault: str | None, data: st.DataObject) -> list[int]:
    if fault == "slot":
        bad = data.draw(st.sampled_from([-1, R, R + 3]))
        return [*slots[:-1], bad] if slots else [bad]
    if fault == "dup":
        s = next((x for x in slots if x), 1)
        return [*slots, s][:ROWS] if s in slots else [s, s]
    return slots


class ContractMachine(RuleBasedStateMachine):
    """The three implementations side by side, against `Model`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.fm = _class_map()
        self.state = _OPS.init()
        self.tm = ft.FutureMap(R, dtype=torch.int32, debug=True)

    @initialize()
    def start(self) -> None:
        _reset_class(self.fm)
        self.compare_buffers()

    # ------------------------------------------------------------------- comparisons
    def compare_buffers(self) -> None:
        want_tokens = [self.model.tokens[s] for s in LIVE]
        want_lens = [self.model.lens[s] for s in LIVE]
        bufs = self.fm.buffers()
        for who, tokens, lens in (
            ("class", bufs["output_tokens"], bufs["new_seq_lens"]),
            ("ops", self.state.output_tokens, self.state.new_seq_lens),
            ("torch", self.tm.output_tokens, self.tm.new_seq_lens),
        ):
            assert _live(tokens) == want_tokens, (who, "output_tokens")
            assert _live(lens) == want_lens, (who, "new_seq_lens")

    def run(self, want: Outcome, on_class: Any, on_torch: Any, on_ops: Any) -> dict[str, Any]:
        """Run one call on all three; check refusals and violations; return the outputs."""
        outs: dict[str, Any] = {}
        if want.refused:
            with pytest.raises(fj.FutureMapError, match=want.refused):
                on_class()
            with pytest.raises(ft.FutureMapError, match=want.refused):
                on_torch()
            try:
                err, _ = on_ops()  # its result is dropped: nothing written, as refused
            except fj.FutureMapError as e:  # visible when traced
                assert want.refused in str(e), e
            else:
                if want.traced is not None:
                    with pytest.raises(fj.InvariantViolation) as info:
                        fj.raise_if_violated(err)
                    assert info.value.invariant == want.traced, info.value
            self.fm.check()  # a refused call records nothing
            return outs
        outs["class"] = on_class()
        if want.violation:
            with pytest.raises(fj.InvariantViolation) as info:
                self.fm.check()
            assert info.value.invariant == want.violation, info.value
            with pytest.raises(ft.InvariantViolation) as tinfo:
                on_torch()
            assert tinfo.value.invariant == want.violation, tinfo.value
            if want.poisoned:  # fm_torch's CPU path wrote nothing; the device path would
                self.tm.output_tokens[torch.tensor(want.poisoned)] = POISON
        else:
            self.fm.check()
            outs["torch"] = on_torch()
        err, outs["ops"] = on_ops()
        if want.violation:
            with pytest.raises(fj.InvariantViolation) as info:
                fj.raise_if_violated(err)
            assert info.value.invariant == want.violation, info.value
        else:
            fj.raise_if_violated(err)
        return outs

    # ------------------------------------------------------------------------ rules
    @rule(op=st.sampled_from(["publish", "stash"]), slots=slot_lists, fault=faults, data=st.data())
    def write(self, op: str, slots: list[int], fault: str | None, data: st.DataObject) -> None:
        slots = _with_slot_fault(slots, fault, data)
        values = data.draw(st.lists(st.integers(0, 30), min_size=len(slots), max_size=len(slots)))
        if fault == "negative" and slots:
            values[data.draw(st.integers(0, len(slots) - 1))] = data.draw(st.integers(-5, -1))
        want = self.model.write(op, slots, values)
        idx, vals = np.array(slots, np.int64), np.array(values, np.int64)

        def on_ops() -> Any:
            err, new = _PURE[op](self.state, _pad(slots, ROWS), _pad(values, ROWS))
            if not want.refused:
                self.state = new
            return err, None

        self.run(
            want,
            lambda: getattr(self.fm, op)(idx, vals),
            lambda: getattr(self.tm, op)(torch.from_numpy(idx), torch.from_numpy(vals)),
            on_ops,
        )
        self.compare_buffers()

    @rule(slots=slot_lists, fault=st.sampled_from([None, None, "slot"]), data=st.data())
    def read_lengths(self, slots: list[int], fault: str | None, data: st.DataObject) -> None:
        slots = _with_slot_fault(slots, fault, data)
        want = self.model.read(slots)
        idx = np.array(slots, np.int64)
        outs = self.run(
            want,
            lambda: self.fm.resolve_seq_lens_cpu(idx),
            lambda: self.tm.resolve_seq_lens_cpu(torch.from_numpy(idx)),
            lambda: _PURE["read"](self.state, _pad(slots, ROWS)),
        )
        if outs:
            want_lens = want.out["lens"]
            live = [i for i, s in enumerate(slots) if s]
            for who, got in (
                ("class", np.asarray(outs["class"])),
                ("torch", outs["torch"].numpy()),
                ("ops", np.asarray(outs["ops"])),
            ):
                assert [int(got[i]) for i in live] == [want_lens[i] for i in live], who
        self.compare_buffers()

    @rule(slots=slot_lists, fault=st.sampled_from([None, None, "slot"]), data=st.data())
    def invalidate(self, slots: list[int], fault: str | None, data: st.DataObject) -> None:
        slots = _with_slot_fault(slots, fault, data)
        bad = self.model.slot_fault(slots)
        idx = np.array(slots, np.int64)
        batch = fj.Batch(fj.ForwardMode.DECODE, idx, idx, idx)
        ti = torch.from_numpy(idx)
        tb = ft.ScheduleBatch(ft.ForwardMode.DECODE, ti, ti, ti)
        if bad:  # the pure op reads no value: nothing to check there
            with pytest.raises(fj.FutureMapError, match="indices"):
                self.fm.invalidate(batch, idx)
            with pytest.raises(ft.FutureMapError, match="indices"):
                self.tm.invalidate(tb, torch.from_numpy(idx))
            return
        got = self.fm.invalidate(batch, idx)
        self.tm.invalidate(tb, torch.from_numpy(idx))
        pure = _PURE["invalidate"](batch._replace(forward_mode=None), _pad(slots, ROWS))
        want = [-s for s in slots]
        n = len(slots)
        assert np.asarray(got.input_ids)[:n].tolist() == want
        assert np.asarray(got.seq_lens)[:n].tolist() == want
        assert tb.input_ids.tolist() == want and tb.seq_lens.tolist() == want
        assert np.asarray(pure.input_ids)[:n].tolist() == want

    @rule(
        mode=st.sampled_from([EXTEND, DECODE, DECODE, DECODE, MIXED, IDLE]),
        slots=slot_lists,
        fault=st.sampled_from(
            [None, None, "slot", "dup", "sentinel", "mode", "ids", "stray", "stray"]
        ),
        data=st.data(),
    )
    def resolve(self, mode: int, slots: list[int], fault: str | None, data: st.DataObject) -> None:
        ready = [s for s in LIVE if self.model.tokens[s] >= 0 and self.model.lens[s] > 0]
        if ready and (fault == "stray" or data.draw(st.booleans())):  # slots a good step runs
            slots = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3, unique=True))
        slots = [] if mode == IDLE else _with_slot_fault(slots, fault, data)
        # Rows: prefill rows (EXTEND, and the head of MIXED) carry 1-2 real tokens, decode
        # rows their sentinel -slot (a padding row: 0); DECODE lengths are sentinels too.
        n_prefill = {EXTEND: len(slots), MIXED: len(slots) // 2}.get(mode, 0)
        ids: list[int] = []
        for i, s in enumerate(slots):
            if i >= n_prefill:
                ids.append(-s)
                continue
            k = data.draw(st.integers(1, 2)) if len(ids) + len(slots) - i < TOKENS else 1
            ids += data.draw(st.lists(st.integers(0, 30), min_size=k, max_size=k))
        n = len(slots)
        lens = (
            [-s for s in slots]
            if mode == DECODE
            else data.draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
        )
        decode_rows = [i for i, x in enumerate(ids) if x < 0]
        if fault == "sentinel":
            ids = [*ids[:-1], -data.draw(st.integers(R, R + 3))]
        elif fault == "mode":
            mode = data.draw(st.sampled_from([7, -1, True]))
        elif fault == "ids" and mode == DECODE:
            ids = [*ids, 3]
        elif fault == "stray" and decode_rows:
            # Good input: a sentinel naming a live slot outside the batch (one holding a
            # token when there is one: its first read is clean, its second is not).
            outside = [s for s in LIVE if s not in slots]
            outside = [s for s in outside if self.model.tokens[s] >= 0] or outside
            if outside:
                ids[decode_rows[0]] = -data.draw(st.sampled_from(outside))
        if len(ids) > TOKENS:
            return  # the class would refuse the size (not a bucket): another rule
        want = self.model.resolve(mode, slots, ids, lens)
        a = lambda xs: np.array(xs, np.int64)  # noqa: E731
        traced = jnp.asarray(mode) if isinstance(mode, bool) else jnp.int32(int(mode))

        def on_ops() -> Any:
            b = fj.Batch(traced, _pad(slots, ROWS), _pad(ids, TOKENS), _pad(lens, ROWS))
            err, (new, res) = _PURE["resolve"](self.state, b)
            if not want.refused:
                self.state = new
            return err, res

        tb = ft.ScheduleBatch(mode, *(torch.from_numpy(a(x)) for x in (slots, ids, lens)))
        outs = self.run(
            want,
            lambda: self.fm.resolve(fj.Batch(mode, a(slots), a(ids), a(lens))),
            lambda: self.tm.resolve(tb),
            on_ops,
        )
        if outs:
            self.compare_resolved(want, slots, ids, outs, tb)
        self.compare_buffers()

    def compare_resolved(
        self, want: Outcome, slots: list[int], ids: list[int], outs: dict[str, Any], tb: Any
    ) -> None:
        """Resolved ids and lengths: every implementation as the model (padding rows'
        restored lengths are garbage: not compared)."""
        got = {k: v for k, v in outs.items() if v is not None}
        if "torch" in got:
            got["torch"] = fj.Resolved(tb.input_ids.numpy(), tb.seq_lens.numpy())
        live = [i for i, s in enumerate(slots) if s]
        for who, res in got.items():
            assert np.asarray(res.input_ids)[: len(ids)].tolist() == want.out["ids"], who
            lens = np.asarray(res.seq_lens)
            assert [int(lens[i]) for i in live] == [want.out["lens"][i] for i in live], who


def test_every_implementation_follows_the_contract_model() -> None:
    """Random good and bad op sequences: the fm_jax class, its pure ops and fm_torch agree
    with the plain-Python model on every output, every live buffer slot, every refusal and
    every debug violation."""
    test = seed(SEED)(get_state_machine_test(ContractMachine, settings=SETTINGS))
    try:
        test()
    except BaseException as e:
        e.add_note(f"contract state machine seed: FM_CONTRACT_SEED={SEED} reproduces this run")
        raise
