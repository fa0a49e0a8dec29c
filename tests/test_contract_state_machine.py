"""Random op sequences, good and bad, through every implementation against a model.

A hypothesis rule-based state machine drives publish / stash / resolve /
resolve_seq_lens_cpu / invalidate calls and whole engine steps (each either good or with
one fault: a slot out of range, a live slot twice, a negative token or length, a sentinel
naming no slot, a DECODE batch with more ids than rows, a forward mode that is none; and,
as good input, a sentinel naming a slot outside its batch) through every implementation
in `IMPLS`, all in debug mode:
- fm_jax's FutureMap class, host numpy rows, without host lengths
  (`needs_cpu_seq_lens=False`: every read gathers from the buffer);
- the class's engine step (`FutureMap.engine_step`) on a map that keeps host lengths
  (the default) and has buckets 2 and 4 (a batch's rows may follow its token bucket):
  a step is one dispatch, resolve + a forward that writes the resolved lengths + 1 and
  the host's tokens + the tail; every other rule is the class's op on that map;
- fm_jax's pure ops, jitted once per op at fixed padded shapes, under checkify;
- fm_torch (CPU tensors).
A step on the others is resolve, then the tail (the class's `finish`; publish, stash and
invalidate on the pure ops and fm_torch). `Model` below is the contract in plain Python
(dicts, docs/CONTRACT.md's words). After every call each implementation must give the
model's outputs, hold the model's live slots in every buffer, and refuse (FutureMapError
naming the field) or report (InvariantViolation naming the invariant) exactly what the
model says. Slot 0 is padding: garbage, never compared. A new implementation is one more
`Impl` in `IMPLS`: every rule drives it.

Host lengths: reads come at drawn slots and at exactly the slots last published (a publish
of host or device lengths, a finish, a step: the copy a publish keeps); every array a read
returns is the caller's own (a fresh writable ndarray, or tensor) and the test updates it
in place, as an engine does, before the next call; a publish's and a step's host arrays
are overwritten after the call (the engine refilling them for the next batch). None of it
may change what the map holds or returns.

Batches: fresh ones, with the forward mode on the host or (good input) a jax array; and
the batch the implementation's last step returned, fed back as the next DECODE step.

Where the implementations differ by design, the model says how: a refused call changes
nothing anywhere (the pure ops, which cannot read values when traced, must report it as
a violation instead; their result is dropped). A debug violation on valid input: the
fm_jax ops run on and write their poison; fm_torch on CPU raises before writing, so the
test writes the same poison into its buffer (what fm_torch's CUDA path, which asserts on
the device, would hold) and all go on alike.

Reproducing a failure: hypothesis prints the failing call sequence and a
`@reproduce_failure` blob; the run's seed is printed too (set FM_CONTRACT_SEED to rerun
with it). Nothing is saved to an example database.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, event, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    precondition,
    rule,
)
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
    max_examples=int(os.environ.get("FM_CONTRACT_EXAMPLES", "80")),
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
      out: the call's outputs by name: "ids" (resolved ids, one per token), "lens"
        (resolved or read lengths, one per row), "next" and "next_lens" (sentinels),
        "mode" (the forward mode a step's forward sees).
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
    lens: dict[int, int] = field(default_factory=lambda: dict.fromkeys(LIVE, POISON))

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
        got = Outcome(out={"lens": [self.lens[s] if s else None for s in slots]})  # type: ignore[misc]
        if any(s and self.lens[s] < 0 for s in slots):  # never published: the poison
            got.violation = "consume lengths (WRWR)"
        return got

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

    def step(
        self, mode: Any, slots: list[int], ids: list[int], lens: list[int], tokens: list[int]
    ) -> tuple[Outcome, list[int]]:
        """An engine step: resolve; a forward whose lengths are each row's resolved length
        + 1 (a padding row's: garbage, written at slot 0) and whose tokens are `tokens`;
        the tail publishes and stashes them at the batch's slots and leaves the sentinels.
        Returns the outcome and the lengths the tail publishes."""
        got = self.resolve(mode, slots, ids, lens)
        if got.refused:
            return got, []
        after = [(n or 0) + 1 for n in got.out["lens"]]
        assert not self.write("publish", slots, after).refused
        assert not self.write("stash", slots, tokens).refused
        got.out.update(next=[-s for s in slots], next_lens=[-s for s in slots], mode=[mode])
        return got, after


# ------------------------------------------------------------------- the implementations
@dataclass
class BatchIn:
    """One batch in the model's terms, for every implementation to lay out its own way.

    Attributes:
      traced: the class's forward mode a jax int32 array (the traced executables); the
        pure ops' always is.
      again: the batch the implementation's own last step returned (its sentinels), with
        `mode` as its forward mode; `slots`, `ids` and `lens` say what it holds.
    """

    mode: Any
    slots: list[int]
    ids: list[int]
    lens: list[int]
    traced: bool = False
    again: bool = False


def a(xs: list[int]) -> np.ndarray:
    return np.array(xs, np.int64)


def _pad(xs: list[int], n: int) -> jax.Array:
    return jnp.asarray(np.array([*xs, *[0] * (n - len(xs))], np.int32))


def _live(buf: Any) -> list[int]:
    return [int(x) for x in np.asarray(buf)[1:R]]


def _ints(x: Any, n: int) -> list[int]:
    return [int(v) for v in np.asarray(x)[:n]]


def _checked(fn: Any) -> Any:
    return jax.jit(checkify.checkify(fn, errors=checkify.user_checks))


SCRIBBLE = 12345  # what the engine refills its host arrays with after a call


class Impl:
    """One implementation under test: each op in the model's terms, in its own layout.

    `call(op, want, *args)` runs op `op` (a method: write, i.e. publish or stash; read,
    resolve, invalidate, step) and checks its refusal or debug violation against `want` the way
    this implementation reports them; it returns the op's outputs by name (as `Outcome.out`
    names them), or None where it has none to compare.
    """

    name: str

    def reset(self) -> None:
        """Back to the model's start: lengths 0, every live token poisoned."""
        raise NotImplementedError

    def buffers(self) -> tuple[Any, Any]:
        """(output_tokens, new_seq_lens), global."""
        raise NotImplementedError

    def call(self, op: str, want: Outcome, *args: Any) -> dict[str, list[int]] | None:
        raise NotImplementedError


@functools.cache
def _class_map(needs_cpu_seq_lens: bool, buckets: tuple[int, ...] = (ROWS,)) -> fj.FutureMap:
    """One class map per variant for every example (reset by `ClassImpl.reset`): a fresh
    map per example would compile its executables again. `buckets`: its batch and token
    buckets (the largest `ROWS`, the pure ops' padded size)."""
    return fj.FutureMap(
        R,
        debug=True,
        batch_buckets=buckets,
        token_buckets=buckets,
        needs_cpu_seq_lens=needs_cpu_seq_lens,
    )


class ClassImpl(Impl):
    """fm_jax's class: refusals raised before anything runs, violations at `check()`."""

    def __init__(self, name: str, fm: fj.FutureMap) -> None:
        self.name, self.fm = name, fm
        self.kept: fj.Batch | None = None  # the batch its last step returned
        self.returned: np.ndarray | None = None  # the last read's array (the caller's)

    def reset(self) -> None:
        fm = self.fm
        with contextlib.suppress(fj.InvariantViolation):
            fm.check()  # an earlier failing example may have left errors pending
        fm.reset()  # every token and length poisoned, no host copy kept
        self.kept = self.returned = None

    def buffers(self) -> tuple[Any, Any]:
        bufs = self.fm.buffers()
        return bufs["output_tokens"], bufs["new_seq_lens"]

    def call(self, op: str, want: Outcome, *args: Any) -> dict[str, list[int]] | None:
        fn, step = getattr(self, op), self.fm.step
        if want.refused:
            with pytest.raises(fj.FutureMapError, match=want.refused):
                fn(*args)
            self.fm.check()  # a refused call records nothing
            assert self.fm.step == step, self.name
            return None
        if want.violation:
            out = None  # a read raises its violations itself (it checks)
            with pytest.raises(fj.InvariantViolation) as info:
                out = fn(*args)
                self.fm.check()
            assert info.value.invariant == want.violation, (self.name, info.value)
            return out  # type: ignore[no-any-return]
        out = fn(*args)
        self.fm.check()
        return out  # type: ignore[no-any-return]

    # ------------------------------------------------------------------------------ ops
    def write(self, op: str, slots: list[int], values: list[int], form: str) -> None:
        """publish or stash, the values in `form`: a host array of that dtype, or "device"
        (a jax array padded to the slots' bucket: good values, checked on the device)."""
        idx = a(slots)
        if form == "device":
            vals = jnp.asarray(fj.pad_to_bucket(np.array(values, np.int32), self.fm.batch_buckets))
        else:
            vals = np.array(values, form)
        getattr(self.fm, op)(idx, vals)
        idx[:] = SCRIBBLE  # the engine refills its arrays
        if form != "device":
            vals[:] = SCRIBBLE

    def read(self, slots: list[int]) -> dict[str, list[int]]:
        got = self.fm.resolve_seq_lens_cpu(a(slots))
        assert type(got) is np.ndarray and got.flags.writeable, (self.name, type(got))
        assert self.returned is None or not np.shares_memory(got, self.returned), self.name
        self.returned = got
        out = got.tolist()
        got += SCRIBBLE  # the caller updates its copy in place: nothing the map keeps
        return {"lens": out}

    def mode(self, b: BatchIn) -> Any:
        return jnp.int32(b.mode) if b.traced else b.mode

    def batch(self, b: BatchIn) -> fj.Batch:
        if b.again:
            assert self.kept is not None
            return self.kept._replace(forward_mode=self.mode(b))
        return fj.Batch(self.mode(b), a(b.slots), a(b.ids), a(b.lens))

    def resolve(self, b: BatchIn) -> dict[str, list[int]]:
        return self.resolve_batch(self.batch(b), b)

    def invalidate(self, slots: list[int]) -> dict[str, list[int]]:
        idx = a(slots)
        got = self.fm.invalidate(fj.Batch(fj.ForwardMode.DECODE, idx, idx, idx), idx)
        return {
            "next": _ints(got.input_ids, len(slots)),
            "next_lens": _ints(got.seq_lens, len(slots)),
        }

    def step(self, b: BatchIn, tokens: list[int], after: list[int]) -> dict[str, list[int]]:
        """resolve, then `finish` with the forward's lengths and tokens."""
        batch = self.batch(b)
        out = self.resolve_batch(batch, b)
        lens, toks = np.array(after, np.int32), np.array(tokens, np.int32)
        self.kept = self.fm.finish(batch, batch.req_pool_indices, lens, toks)
        lens[:], toks[:] = SCRIBBLE, SCRIBBLE
        return {**out, **self.next_of(self.kept, len(b.slots))}

    def resolve_batch(self, batch: fj.Batch, b: BatchIn) -> dict[str, list[int]]:
        res = self.fm.resolve(batch)
        return {"ids": _ints(res.input_ids, len(b.ids)), "lens": _ints(res.seq_lens, len(b.slots))}

    @staticmethod
    def next_of(batch: fj.Batch, n: int) -> dict[str, list[int]]:
        return {"next": _ints(batch.input_ids, n), "next_lens": _ints(batch.seq_lens, n)}


def _forward(res: fj.Resolved, batch: fj.Batch, inputs: dict[str, Any]) -> fj.StepOutput:
    """The engine's forward: each row's resolved length + 1, the host's tokens; it hands
    back what it was given (ids, lengths, forward mode)."""
    mode = jnp.asarray(batch.forward_mode, jnp.int32)
    return fj.StepOutput(res.seq_lens + 1, inputs["tokens"], (res.input_ids, res.seq_lens, mode))


class StepImpl(ClassImpl):
    """The class's engine step on its own map: a step is one dispatch; the other ops are
    the class's. The forward's batch is compared on its mode, host or traced."""

    def __init__(self, name: str, fm: fj.FutureMap) -> None:
        super().__init__(name, fm)
        self.engine = _engine_step(fm)

    def step(self, b: BatchIn, tokens: list[int], after: list[int]) -> dict[str, list[int]]:
        toks = np.array(tokens, np.int32)
        r = self.engine(self.batch(b), inputs={"tokens": toks})
        toks[:] = SCRIBBLE
        assert isinstance(r.batch, fj.Batch)
        self.kept = r.batch
        ids, lens, mode = r.out
        n = len(b.slots)
        out = {"ids": _ints(ids, len(b.ids)), "lens": _ints(lens, n), "mode": [int(mode)]}
        return {**out, **self.next_of(r.batch, n)}


@functools.cache
def _engine_step(fm: fj.FutureMap) -> fj.EngineStep:
    return fm.engine_step(_forward, inputs=[fj.StepInput("tokens", "row")])


_OPS = fj.future_map(R, debug=True)
_PURE = {
    "publish": _checked(_OPS.publish),
    "stash": _checked(_OPS.stash),
    "resolve": _checked(_OPS.resolve),
    "read": _checked(_OPS.seq_lens_at),
    "invalidate": jax.jit(_OPS.invalidate),
}


class OpsImpl(Impl):
    """fm_jax's pure ops at padded shapes, the mode traced: a refused call's fault is
    raised while tracing or reported as an invariant (its result dropped); a violation is
    reported by the op's checkify error."""

    name = "ops"

    def __init__(self) -> None:
        self.state = _OPS.init()
        self.kept: fj.Batch | None = None

    def reset(self) -> None:
        self.state, self.kept = _OPS.init(), None

    def buffers(self) -> tuple[Any, Any]:
        return self.state.output_tokens, self.state.new_seq_lens

    def call(self, op: str, want: Outcome, *args: Any) -> dict[str, list[int]] | None:
        fn = getattr(self, op)
        if want.refused:
            try:
                errs, _ = fn(*args, commit=False)  # its result dropped: nothing written
            except fj.FutureMapError as e:  # visible when traced
                assert want.refused in str(e), e
            else:
                if want.traced is not None:
                    with pytest.raises(fj.InvariantViolation) as info:
                        fj.raise_if_violated(errs[0])
                    assert info.value.invariant == want.traced, info.value
            return None
        errs, out = fn(*args, commit=True)
        for i, err in enumerate(errs):  # the violation is the first op's (a resolve's)
            if want.violation and i == 0:
                with pytest.raises(fj.InvariantViolation) as info:
                    fj.raise_if_violated(err)
                assert info.value.invariant == want.violation, info.value
            else:
                fj.raise_if_violated(err)
        return out  # type: ignore[no-any-return]

    def write(
        self, op: str, slots: list[int], values: list[int], form: str, *, commit: bool
    ) -> tuple[list[Any], None]:
        err, new = _PURE[op](self.state, _pad(slots, ROWS), _pad(values, ROWS))
        if commit:
            self.state = new
        return [err], None

    def read(self, slots: list[int], *, commit: bool) -> tuple[list[Any], dict[str, list[int]]]:
        err, lens = _PURE["read"](self.state, _pad(slots, ROWS))
        return [err], {"lens": _ints(lens, len(slots))}

    def batch(self, b: BatchIn) -> fj.Batch:
        mode = jnp.asarray(b.mode) if isinstance(b.mode, bool) else jnp.int32(int(b.mode))
        if b.again:
            assert self.kept is not None
            return self.kept._replace(forward_mode=mode)
        return fj.Batch(mode, _pad(b.slots, ROWS), _pad(b.ids, TOKENS), _pad(b.lens, ROWS))

    def resolve(self, b: BatchIn, *, commit: bool) -> tuple[list[Any], dict[str, list[int]]]:
        err, (new, res) = _PURE["resolve"](self.state, self.batch(b))
        if commit:
            self.state = new
        return [err], {
            "ids": _ints(res.input_ids, len(b.ids)),
            "lens": _ints(res.seq_lens, len(b.slots)),
        }

    def invalidate(
        self, slots: list[int], *, commit: bool
    ) -> tuple[list[Any], dict[str, list[int]]]:
        n = len(slots)
        got = _PURE["invalidate"](fj.Batch(None, _pad(slots, ROWS), None, None), _pad(slots, ROWS))
        return [], {"next": _ints(got.input_ids, n), "next_lens": _ints(got.seq_lens, n)}

    def step(
        self, b: BatchIn, tokens: list[int], after: list[int], *, commit: bool
    ) -> tuple[list[Any], dict[str, list[int]] | None]:
        """resolve, then publish, stash and invalidate."""
        batch = self.batch(b)
        err, (new, res) = _PURE["resolve"](self.state, batch)
        if not commit:
            return [err], None
        self.state, n = new, len(b.slots)
        out = {"ids": _ints(res.input_ids, len(b.ids)), "lens": _ints(res.seq_lens, n)}
        errs = [err]
        for op, values in (("publish", after), ("stash", tokens)):
            errs += self.write(op, b.slots, values, "int32", commit=True)[0]
        self.kept = _PURE["invalidate"](batch._replace(forward_mode=None), batch.req_pool_indices)
        assert self.kept is not None
        return errs, {**out, **ClassImpl.next_of(self.kept, n)}


class TorchImpl(Impl):
    """fm_torch on CPU: refusals and violations both raised before anything is written
    (the test then writes the poison its device path would)."""

    name = "torch"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tm = ft.FutureMap(R, dtype=torch.int32, debug=True)
        self.kept: ft.ScheduleBatch | None = None
        self.returned: torch.Tensor | None = None

    def buffers(self) -> tuple[Any, Any]:
        return self.tm.output_tokens, self.tm.new_seq_lens

    def call(self, op: str, want: Outcome, *args: Any) -> dict[str, list[int]] | None:
        if op == "step":
            return self.step(want, *args)
        fn = getattr(self, op)
        if want.refused:
            with pytest.raises(ft.FutureMapError, match=want.refused):
                fn(*args)
            return None
        if not want.violation:
            return fn(*args)  # type: ignore[no-any-return]
        with pytest.raises(ft.InvariantViolation) as info:
            fn(*args)
        assert info.value.invariant == want.violation, info.value
        if want.poisoned:  # fm_torch's CPU path wrote nothing; the device path would
            self.tm.output_tokens[torch.tensor(want.poisoned)] = POISON
        return None

    def write(self, op: str, slots: list[int], values: list[int], form: str) -> None:
        getattr(self.tm, op)(torch.tensor(slots, dtype=torch.int64), torch.tensor(values))

    def read(self, slots: list[int]) -> dict[str, list[int]]:
        got = self.tm.resolve_seq_lens_cpu(torch.tensor(slots, dtype=torch.int64))
        prev = self.returned
        assert prev is None or not np.shares_memory(got.numpy(), prev.numpy())
        self.returned = got
        out = got.tolist()
        got += SCRIBBLE  # the caller updates its copy in place: nothing the map keeps
        return {"lens": out}

    def batch(self, b: BatchIn) -> ft.ScheduleBatch:
        if b.again:
            assert self.kept is not None
            self.kept.forward_mode = b.mode
            return self.kept
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return ft.ScheduleBatch(b.mode, t(b.slots), t(b.ids), t(b.lens))

    def resolve(self, b: BatchIn) -> dict[str, list[int]]:
        tb = self.batch(b)
        self.tm.resolve(tb)
        return {"ids": tb.input_ids.tolist(), "lens": tb.seq_lens.tolist()}

    def invalidate(self, slots: list[int]) -> dict[str, list[int]]:
        idx = torch.tensor(slots, dtype=torch.int64)
        tb = ft.ScheduleBatch(ft.ForwardMode.DECODE, idx, idx, idx)
        self.tm.invalidate(tb, idx)
        return {"next": tb.input_ids.tolist(), "next_lens": tb.seq_lens.tolist()}

    def step(
        self, want: Outcome, b: BatchIn, tokens: list[int], after: list[int]
    ) -> dict[str, list[int]] | None:
        """resolve (refused, or its violation reported, as a resolve's), then publish,
        stash and invalidate."""
        tb = self.batch(b)
        out = self.call("resolve_batch", want, tb)
        if want.refused:
            return None
        self.write("publish", b.slots, after, "int32")
        self.write("stash", b.slots, tokens, "int32")
        self.tm.invalidate(tb, tb.req_pool_indices)
        self.kept = tb
        return {**(out or {}), "next": tb.input_ids.tolist(), "next_lens": tb.seq_lens.tolist()}

    def resolve_batch(self, tb: ft.ScheduleBatch) -> dict[str, list[int]]:
        self.tm.resolve(tb)
        return {"ids": tb.input_ids.tolist(), "lens": tb.seq_lens.tolist()}


IMPLS: list[Callable[[], Impl]] = [
    lambda: ClassImpl("class (no host lengths)", _class_map(False)),
    lambda: StepImpl(
        "engine step (class, host lengths, buckets 2 and 4)", _class_map(True, (2, 4))
    ),
    OpsImpl,
    TorchImpl,
]
"""Every implementation the machine drives, built once per example."""


# ------------------------------------------------------------------------ the machine
slot_lists = st.lists(st.sampled_from(LIVE), max_size=3, unique=True).flatmap(
    lambda live: (
        st.permutations([*live, *[0] * (len(live) < 3)]) if live else st.sampled_from([[], [0]])
    )
)
faults = st.sampled_from([None, None, None, "slot", "dup", "negative"])
tokens_of = lambda n: st.lists(st.integers(0, 30), min_size=n, max_size=n)  # noqa: E731


def _with_slot_fault(slots: list[int], fault: str | None, data: st.DataObject) -> list[int]:
    if fault == "slot":
        bad = data.draw(st.sampled_from([-1, R, R + 3]))
        return [*slots[:-1], bad] if slots else [bad]
    if fault == "dup":
        s = next((x for x in slots if x), 1)
        return [*slots, s][:ROWS] if s in slots else [s, s]
    return slots


class ContractMachine(RuleBasedStateMachine):
    """Every implementation of `IMPLS` side by side, against `Model`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.impls = [make() for make in IMPLS]
        self.published: list[int] = LIVE  # the slots of the last publish
        self.stepped: list[int] | None = None  # the slots of the last step

    @initialize()
    def start(self) -> None:
        for impl in self.impls:
            impl.reset()
        self.compare_buffers()

    # ------------------------------------------------------------------- comparisons
    def compare_buffers(self) -> None:
        want_tokens = [self.model.tokens[s] for s in LIVE]
        want_lens = [self.model.lens[s] for s in LIVE]
        for impl in self.impls:
            tokens, lens = impl.buffers()
            assert _live(tokens) == want_tokens, (impl.name, "output_tokens")
            assert _live(lens) == want_lens, (impl.name, "new_seq_lens")

    def run(self, op: str, want: Outcome, *args: Any) -> dict[str, dict[str, list[int]]]:
        """One call on every implementation (each checks its refusal or violation);
        returns the outputs by implementation."""
        event(f"{op}: {want.refused or want.violation or 'good'}")
        outs = {}
        for impl in self.impls:
            got = impl.call(op, want, *args)
            if got is not None:
                outs[impl.name] = got
        return outs

    def compare(
        self, want: Outcome, slots: list[int], outs: dict[str, dict[str, list[int]]]
    ) -> None:
        """Every output as the model's: ids, sentinels and modes whole, lengths at live
        rows (a padding row's is garbage)."""
        live = [i for i, s in enumerate(slots) if s]
        for who, got in outs.items():
            for key, value in got.items():
                w = want.out[key]
                if key == "lens":
                    assert [value[i] for i in live] == [w[i] for i in live], (who, key, value, w)
                else:
                    assert value == w, (who, key, value, w)

    # ------------------------------------------------------------------------ rules
    @rule(
        op=st.sampled_from(["publish", "stash"]),
        slots=st.one_of(slot_lists, st.permutations(LIVE)),  # or the whole bucket
        fault=faults,
        data=st.data(),
    )
    def write(self, op: str, slots: list[int], fault: str | None, data: st.DataObject) -> None:
        slots = _with_slot_fault(slots, fault, data)
        values = data.draw(st.lists(st.integers(0, 30), min_size=len(slots), max_size=len(slots)))
        if fault == "negative" and slots:
            values[data.draw(st.integers(0, len(slots) - 1))] = data.draw(st.integers(-5, -1))
        # The class's values: host arrays (int32 ones of a whole bucket need no padding),
        # or good values on the device, as many as the bucket.
        forms = ["int32", "int32", "int64"] + ["device"] * (
            fault != "negative" and len(slots) <= ROWS
        )
        form = data.draw(st.sampled_from(forms))
        want = self.model.write(op, slots, values)
        self.run("write", want, op, slots, values, form)
        if op == "publish" and not want.refused:
            self.published = slots
        self.compare_buffers()

    def read(self, slots: list[int]) -> None:
        want = self.model.read(slots)
        self.compare(want, slots, self.run("read", want, slots))
        self.compare_buffers()

    @rule(slots=slot_lists, fault=st.sampled_from([None, None, "slot"]), data=st.data())
    def read_lengths(self, slots: list[int], fault: str | None, data: st.DataObject) -> None:
        self.read(_with_slot_fault(slots, fault, data))

    @rule()
    def read_published(self) -> None:
        """Exactly the slots last published (or finished, or stepped): where the map keeps
        host lengths, the copy that publish kept."""
        self.read(self.published)

    @rule(slots=slot_lists, fault=st.sampled_from([None, None, "slot"]), data=st.data())
    def invalidate(self, slots: list[int], fault: str | None, data: st.DataObject) -> None:
        slots = _with_slot_fault(slots, fault, data)
        bad = self.model.slot_fault(slots)
        # The pure op reads no value: a bad slot is nothing it can see.
        want = Outcome(refused="indices") if bad else Outcome(out={"next": [-s for s in slots]})
        if not bad:
            want.out["next_lens"] = want.out["next"]
        self.compare(want, slots, self.run("invalidate", want, slots))
        self.compare_buffers()

    def draw_batch(self, data: st.DataObject) -> BatchIn | None:
        """A fresh batch, good or with one fault; None when it would not fit the bucket."""
        mode = data.draw(st.sampled_from([EXTEND, DECODE, DECODE, DECODE, MIXED, IDLE]))
        fault = data.draw(
            st.sampled_from(
                [None, None, "slot", "dup", "sentinel", "mode", "ids", "stray", "stray"]
            )
        )
        slots = data.draw(slot_lists)
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
            ids += data.draw(tokens_of(k))
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
            return None  # the class would refuse the size (not a bucket): another rule
        traced = fault in (None, "stray", "slot", "dup") and data.draw(st.booleans())
        return BatchIn(mode, slots, ids, lens, traced=traced)

    @rule(data=st.data())
    def resolve(self, data: st.DataObject) -> None:
        b = self.draw_batch(data)
        if b is None:
            return
        want = self.model.resolve(b.mode, b.slots, b.ids, b.lens)
        self.compare(want, b.slots, self.run("resolve", want, b))
        self.compare_buffers()

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """An engine step on a fresh batch."""
        b = self.draw_batch(data)
        if b is not None:
            self.run_step(b, data)

    @precondition(lambda self: self.stepped is not None)
    @rule(traced=st.booleans(), data=st.data())
    def step_again(self, traced: bool, data: st.DataObject) -> None:
        """A DECODE step on the batch the last step returned (its sentinels)."""
        assert self.stepped is not None
        s = self.stepped
        self.run_step(BatchIn(DECODE, s, [-x for x in s], [-x for x in s], traced, True), data)

    def run_step(self, b: BatchIn, data: st.DataObject) -> None:
        tokens = data.draw(tokens_of(len(b.slots)))
        want, after = self.model.step(b.mode, b.slots, b.ids, b.lens, tokens)
        self.compare(want, b.slots, self.run("step", want, b, tokens, after))
        if not want.refused:
            self.published = self.stepped = b.slots
        self.compare_buffers()


def test_every_implementation_follows_the_contract_model() -> None:
    """Random good and bad op sequences and engine steps: the fm_jax class (with and
    without host lengths), its engine step, its pure ops and fm_torch
    agree with the plain-Python model on every output, every live buffer slot, every
    refusal and every debug violation; every read returns the caller's own array."""
    test = seed(SEED)(get_state_machine_test(ContractMachine, settings=SETTINGS))
    try:
        test()
    except BaseException as e:
        e.add_note(f"contract state machine seed: FM_CONTRACT_SEED={SEED} reproduces this run")
        raise


# ------------------------------------------------------------------ the machine is not blind
def _returns_its_own_rows(read: Any) -> Any:
    """`read` (`FutureMap.resolve_seq_lens_cpu`) handing out a view of rows the map keeps
    (one array per map, refilled by each read) instead of the caller's own array."""
    kept: dict[int, np.ndarray] = {}

    def mutant(self: Any, *args: Any, **kwargs: Any) -> Any:
        got = np.asarray(read(self, *args, **kwargs))
        rows = kept.setdefault(id(self), np.zeros(64, got.dtype))
        rows[: len(got)] = got
        return rows[: len(got)]

    return mutant


def test_the_machine_fails_on_a_map_whose_reads_share_its_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reads' checks are not blind: a map handing `resolve_seq_lens_cpu` a view of its
    own host rows instead of the caller's own array fails the machine."""
    read = fj.FutureMap.resolve_seq_lens_cpu
    monkeypatch.setattr(fj.FutureMap, "resolve_seq_lens_cpu", _returns_its_own_rows(read))
    test = get_state_machine_test(
        ContractMachine, settings=settings(SETTINGS, max_examples=100, phases=[Phase.generate])
    )
    with pytest.raises(AssertionError):
        seed(SEED)(test)()


def _stepper() -> StepImpl:
    """The machine's engine step at the model's start."""
    impl = StepImpl("engine step", _class_map(True, (2, 4)))
    impl.reset()
    return impl


@pytest.mark.parametrize("mode", [MIXED, IDLE])
def test_the_engine_steps_forward_sees_the_batchs_host_mode(mode: int) -> None:
    """An engine step given a host MIXED or IDLE batch handed its forward EXTEND (its
    executable fixed 'not DECODE'): a forward that branches on the mode (skip IDLE, handle
    MIXED's running rows) took the wrong path. It must see MIXED or IDLE."""
    slots = [] if mode == IDLE else [1]
    out = _stepper().step(
        BatchIn(mode, slots, [5] * len(slots), [1] * len(slots)), [7] * len(slots), []
    )
    assert out["mode"] == [mode]


def test_the_batch_a_step_returns_is_the_next_steps_batch() -> None:
    """StepResult.batch, 'the batch for the next step', padded its sentinels to the token
    bucket its rows followed (4 rows for 2) while keeping the caller's 2 slots, and the next
    step refused it. Fed back as the next DECODE step after a prefill of 2 rows and 3
    tokens (token bucket 4, batch bucket 2), it must serve."""
    impl = _stepper()
    impl.step(BatchIn(EXTEND, [1, 2], [5, 6, 7], [2, 1]), [8, 9], [])
    out = impl.step(BatchIn(DECODE, [1, 2], [-1, -2], [-1, -2], again=True), [1, 1], [])
    assert out["ids"] == [8, 9]
