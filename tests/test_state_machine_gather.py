"""Random gather-protocol op sequences, good and bad, through both twins against a model.

The gather protocol's twin of tests/test_contract_state_machine.py (whose model, slot
strategies and helpers it imports): a hypothesis rule-based state machine drives publish /
stash / resolve / resolve_seq_lens_cpu / invalidate and engine steps through
- fm_jax's FutureMap class (protocol="gather", debug, host rows, host forward modes;
  ), a step its `engine_step` (resolve, a forward whose lengths
  are the resolved ones + 1 and whose payload is the host's tokens or draft, publish and
  stash: one dispatch);
- fm_jax's pure ops under checkify, with the forward mode traced (one device only);
- fm_torch (protocol="gather", debug, CPU tensors, one map per DP rank),
(a step on these two: resolve, then publish and stash) against `GatherModel`, the
contract in plain Python (docs/CONTRACT.md, 'Two protocols' and its batch-fields table,
'Relay fields', 'Checks beyond SGLang'). Each resolve (and step) builds one batch per DP
rank from the table: EXTEND (prefill ids, token slots none or all 0), DECODE
(non-spec: no ids, gathered; spec: the host's ids or none), MIXED (prefill ids, then the
running rows' tokens gathered: fm_jax's per-token `token_slots`, fm_torch's per-row
`mix_running_indices`, the same batch in each twin's layout) and IDLE, with at most one
fault drawn from the same table: ids missing where required, ids given to a non-spec
DECODE, a negative or too-large host id, nonzero token slots on a batch that is not MIXED,
MIXED without token slots, a running slot out of range or twice, a request slot out of
range or twice, lengths of another row count, a forward mode that is none, draft indices
of the wrong length, out of range or twice, a draft given to a non-spec map, a spec MIXED
batch whose running rows are not its last live rows in order; and, as good input, running
slots naming a live slot outside the batch (non-spec), reads of slots with no write and a
spec MIXED batch whose draft reads a running slot again (debug consume violations), lengths
never published (debug). A spec MIXED batch's running rows get their published length + 1.
Writes and reads carry slot faults, negative and too-large values, and (spec) drafts that
break the declaration (a field missing, undeclared, of another dtype or shape).

After every call: a bad call is refused by both twins with a FutureMapError naming the
field (each twin's name for it), every buffer byte-identical to the model's, the fm_jax
step count unchanged, nothing reported by debug, the fm_torch batch untouched; the pure
ops refuse it when traced or report the invariant the model names (where padded shapes
hide a fault, there is nothing to check). A good call gives the model's ids, lengths and
draft rows and leaves the model's bytes in every live buffer row; a debug violation is
reported by both twins with the same invariant (fm_jax's named slot among the model's
bad slots). fm_torch on CPU raises before writing, so the test writes the poison its
device path would (as the sentinel machine does). Reads come at drawn slots and at exactly
each rank's slots last published (the class's host lengths); every array a read returns is
the caller's own (fresh, writable), updated in place by the test before the next call,
and the host arrays of a publish or a step are overwritten after it (the engine refilling
them): neither may change what the map returns.

Variants: non-spec; spec,
with a declared payload of verified ids (consume-tracked), an engine's float32 field
`score` and consume-tracked int field `steps`, top-k and bf16 hidden states whose values
include NaNs with payloads (quiet and signalling), infinities and -0.0, compared bit for
bit (raw bytes: NaN == NaN only with the same bits, -0.0 != 0.0); and both again on a
2-rank mesh (a child process with 2 virtual CPU devices: the class takes per-rank mappings,
each rank's kind drawn on its own, so ranks of different kinds meet in one resolve;
fm_torch has one map per rank; the pure ops are not driven there).
`test_the_machine_fails_on_a_broken_model` runs the machine against models with one rule
broken (MIXED ids not gathered, token slots on EXTEND taken, a tracked draft field not
poisoned, NaN payloads canonicalised): each must fail.

Findings, each pinned by a test named after it (F1 by tests/test_spec_mixed.py's
test_a_slot_the_running_rows_and_the_draft_both_read_is_read_twice): F1 (a spec MIXED batch
whose draft names a running slot: fm_jax reported no second read where fm_torch did), F2 (a
mesh MIXED rank without token slots beside one with them: fm_jax took it, its running rows
kept the host's ids), F3 (a mesh DECODE rank with all-zero token slots: taken on a mesh,
refused on one device), F4 (a spec mesh with draft indices on some ranks only: refused by
fm_jax; a rank that is not DECODE now reads padding slots, a DECODE one without its own is
refused), F6 (a spec MIXED batch with a padding row among its live rows: both twins bound
the padding row's length) and F7 (an IDLE rank's all-zero token slots beside DECODE ranks:
refused while tracing) are fixed; the machine generates all but F6, which its test pins (the
machine lays a spec MIXED batch's padding rows last). F5 stays, by encoding: fm_jax's token
slots cannot name a padding running row (fm_torch's mix_running_indices [2, 0]), so fm_torch
refuses what fm_jax never sees; the machine does not generate it.

Reproducing a failure: hypothesis prints the failing steps and a `@reproduce_failure`
blob; the run's seed is printed too (FM_GATHER_SEED reruns it), FM_GATHER_EXAMPLES sets
the number of examples per machine (default 50; the mesh machines run a third).
Failures are not shrunk by default (a shrink can take minutes of CI time): rerun with the
seed and FM_GATHER_SHRINK=1 for a minimal sequence.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import random
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from host_devices import cpu_devices_env
from hypothesis import HealthCheck, Phase, event, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    precondition,
    rule,
)
from test_contract_state_machine import (
    DECODE,
    EXTEND,
    IDLE,
    LIVE,
    MIXED,
    POISON,
    ROWS,
    SCRIBBLE,
    TOKENS,
    Model,
    Outcome,
    R,
    _checked,
    _with_slot_fault,
    slot_lists,
)

import fm_jax as fj
import fm_torch as ft

MODES = (EXTEND, DECODE, MIXED, IDLE)
MODE_NAMES = {int(m): m.name for m in fj.ForwardMode}
I32_MAX = 2**31 - 1
BIG = 2**31  # fits no int32 buffer
K, H = 2, 3
SPEC = fj.SpecConfig(
    topk=K,
    hidden=H,
    hidden_dtype=jnp.bfloat16,
    verified_id=True,
    extra=(
        fj.RelayField("score", (2,), np.float32),
        fj.RelayField("steps", consumed=True),
    ),
)
CONSUMED = ("steps",)  # fm_torch's name for the same declaration's tracked extra
# Float bits a draft carries: 0, -0.0, 1.0, -pi, inf, quiet NaNs with payloads (one
# negative), signalling NaNs (one negative).
F32_BITS = [0x0, 0x80000000, 0x3F800000, 0xC0490FDB, 0x7F800000, 0x7FC00123, 0xFFC00001]
F32_BITS += [0x7F800001, 0xFFA00001]
BF16_BITS = [0x0, 0x8000, 0x3F80, 0xC049, 0x7F80, 0x7FC1, 0xFFC1, 0x7F81, 0xFF81]
INT_FIELDS = ("bonus_tokens", "verified_id", "steps")  # one int per row, consume-tracked
ROW_FIELDS = ("topk_p", "topk_index", "hidden_states", "score")  # rows of bytes
DRAFT_FIELDS = INT_FIELDS + ROW_FIELDS

SEED = int(os.environ.get("FM_GATHER_SEED") or random.SystemRandom().randrange(2**32))
EXAMPLES = int(os.environ.get("FM_GATHER_EXAMPLES", "50"))


def _settings(examples: int, **kw: Any) -> settings:
    if not os.environ.get("FM_GATHER_SHRINK"):  # a shrink can take minutes: opt in
        kw.setdefault("phases", [Phase.explicit, Phase.reuse, Phase.generate])
    return settings(
        max_examples=max(1, examples),
        stateful_step_count=25,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        **kw,
    )


# ---------------------------------------------------------------------------- the model
@dataclass
class Expect(Outcome):
    """What the contract says one call does on one DP rank (`Outcome`'s fields, plus the
    gather protocol's).

    Attributes:
      refused: a regex the fm_jax class's FutureMapError must match ('' when good).
      torch_refused: the regex for fm_torch's (its names: mix_running_indices for
        token_slots, draft.indices for draft_indices).
      ops: what the pure ops do with a refused call: ("raise", regex) when tracing sees it,
        ("inv", invariant) when debug reports it, None when they cannot see it (not run).
      bad: the slots a debug violation may name.
      draft: resolve's gathered draft rows by field (bytes; None for padding rows).
      poisoned_draft: slots whose tracked draft fields (verified ids, steps) a resolve
        poisons; `poisoned` (Outcome's) are output_tokens'.
      poisoned_lens: slots whose length a spec DECODE resolve consumes (poisons).
      ops_violation: what the pure ops report instead of `violation` (None: the same; ''
        nothing): they have no host read, so no fresh-publish check.
    """

    torch_refused: str = ""
    ops: tuple[str, str] | None = None
    bad: list[int] = field(default_factory=list)
    draft: dict[str, list[bytes | None]] | None = None
    poisoned_draft: list[int] = field(default_factory=list)
    poisoned_lens: list[int] = field(default_factory=list)
    ops_violation: str | None = None  # the pure ops' report, where it differs ('': none)


def refuse(jax_re: str, torch_re: str | None = None, ops: tuple[str, str] | None = None) -> Expect:
    return Expect(refused=jax_re, torch_refused=torch_re or jax_re, ops=ops)


def _rank(name: str) -> str:
    """A field as fm_jax names it, on one device or one rank of a mesh ('x[rank 1]')."""
    return rf"{name}(\[rank \d+\])?"


@dataclass
class Draft:
    """One stash's draft rows: ints, and floats as their bits."""

    bonus: list[int]
    vid: list[int]
    steps: list[int]
    topk_p: np.ndarray  # [n, K] uint32 (float32 bits)
    topk_index: np.ndarray  # [n, K] int64
    hidden: np.ndarray  # [n, H] uint16 (bf16 bits)
    score: np.ndarray  # [n, 2] uint32 (float32 bits)

    def row(self, name: str, i: int) -> bytes:
        """Row i of a field as the buffers hold it (ints as int32)."""
        if name in INT_FIELDS:
            v = {"bonus_tokens": self.bonus, "verified_id": self.vid, "steps": self.steps}[name]
            return np.int32(v[i]).tobytes()
        if name == "topk_index":
            return self.topk_index[i].astype(np.int32).tobytes()
        return {"topk_p": self.topk_p, "hidden_states": self.hidden, "score": self.score}[name][
            i
        ].tobytes()


@dataclass
class Call:
    """One rank's resolve input in the contract's terms; `jax_*` and `torch_*` are the same
    batch in each twin's layout.

    Attributes:
      kind: the batch kind it was built as; `mode` what it brings (a fault may make it no
        ForwardMode).
      prefill: the host's ids (EXTEND, IDLE: all; MIXED: the prefill rows'; spec DECODE:
        one per row), None when not given.
      running: the running rows' slots (fm_torch's mix_running_indices).
      filler: fm_jax's ids at the running rows' positions (any value >= 0).
      slots_given: token slots given (fm_torch: all 0 on a batch not MIXED is None).
    """

    kind: int
    mode: Any
    slots: list[int]
    lens: list[int]
    prefill: list[int] | None
    running: list[int] = field(default_factory=list)
    filler: list[int] = field(default_factory=list)
    slots_given: bool = False
    draft: list[int] | None = None
    enum: bool = True

    def jax_ids(self) -> list[int] | None:
        return None if self.prefill is None else self.prefill + self.filler

    def jax_token_slots(self) -> list[int] | None:
        return [0] * len(self.prefill or []) + self.running if self.slots_given else None

    def torch_mix(self) -> list[int] | None:
        if not self.slots_given or (self.kind != MIXED and not any(self.running)):
            return None
        return self.running

    def known_mode(self) -> bool:
        return not isinstance(self.mode, bool) and self.mode in MODES


@dataclass
class GatherModel(Model):
    """One rank's buffers' live slots, in plain Python (`Model`'s tokens and lengths, its
    publish / stash / read rules), and the gather protocol's resolve."""

    spec: bool = False
    armed: bool = False  # spec: a publish came since the last read of lengths
    vid: dict[int, int] = field(default_factory=lambda: dict.fromkeys(LIVE, POISON))
    steps: dict[int, int] = field(default_factory=lambda: dict.fromkeys(LIVE, POISON))
    rows: dict[str, dict[int, bytes]] = field(default_factory=dict)

    def row(self, name: str, s: int) -> bytes:
        if name in INT_FIELDS:
            v = {"bonus_tokens": self.tokens, "verified_id": self.vid, "steps": self.steps}[name]
            return np.int32(v[s]).tobytes()
        return self.rows[name][s]

    def buffer(self, name: str) -> bytes:
        """The live rows of a buffer, as bytes."""
        if name == "output_tokens":
            return np.array([self.tokens[s] for s in LIVE], np.int32).tobytes()
        if name == "new_seq_lens":
            return np.array([self.lens[s] for s in LIVE], np.int32).tobytes()
        return b"".join(self.row(name, s) for s in LIVE)

    # ---------------------------------------------------------------- writes and reads
    def write_values(self, op: str, slots: list[int], values: list[int]) -> Expect:
        """publish (lengths) or non-spec stash (tokens): `Model.write`, plus values that do
        not fit the int32 buffers."""
        name = "new_seq_lens" if op == "publish" else "tokens"
        if self.slot_fault(slots) is None and any(v > I32_MAX for v in values):
            return refuse(rf"{_rank(name)} holds values that do not fit")
        got = self.write(op, slots, values)
        if got.refused:
            field_re = _rank("indices") if got.refused == "indices" else _rank(name)
            return refuse(rf"^{field_re} holds", ops=("inv", got.traced or ""))
        if op == "publish" and slots:
            self.armed = True
        return Expect()

    def read_lengths(self, slots: list[int]) -> Expect:
        """resolve_seq_lens_cpu: `Model.read` (a live length read back must not be the
        poison), and on a spec map a read with rows consumes the last publish, which no
        read may have consumed before ('fresh publish', reported first; the pure ops have
        no such host read)."""
        got = self.read(slots)
        if got.refused:
            return refuse(rf"^{_rank('indices')} holds", ops=("inv", got.traced or ""))
        want = Expect(out=got.out, violation=got.violation)
        want.bad = [s for s in slots if s and self.lens[s] < 0]
        if self.spec and slots:
            if not self.armed:
                want.ops_violation, want.violation = want.violation, "fresh publish"
            self.armed = False
        return want

    def stash_draft(self, slots: list[int], d: Draft, fault: str | None) -> Expect:
        """Spec stash: every declared field written at the live slots, or one refusal."""
        bad = self.slot_fault(slots)
        if bad:
            return refuse(rf"^{_rank('indices')} holds", ops=("inv", bad))
        if fault in DRAFT_SHAPE_FAULTS:
            jax_re, torch_re = DRAFT_SHAPE_FAULTS[fault]
            return refuse(jax_re, torch_re, ops=("raise", jax_re))
        if any(v > I32_MAX for v in d.bonus):
            return refuse(rf"draft.{_rank('bonus_tokens')} holds values that do not fit")
        for name, values in (("bonus_tokens", d.bonus), ("verified_id", d.vid), ("steps", d.steps)):
            if any(v < 0 for v in values):
                return refuse(rf"draft.{_rank(name)} holds negative", ops=("inv", STASHED))
        for i, s in enumerate(slots):
            if s:
                self.tokens[s], self.vid[s], self.steps[s] = d.bonus[i], d.vid[i], d.steps[i]
                for name in ROW_FIELDS:
                    self.rows.setdefault(name, {})[s] = d.row(name, i)
        return Expect()

    # -------------------------------------------------------------------------- resolve
    def refusal(self, c: Call) -> Expect | None:
        """The batch-fields table and the checks beyond SGLang, for one rank's batch."""
        if not c.known_mode():
            ops = ("raise", "forward_mode") if c.mode is True else ("inv", "forward mode")
            return refuse("forward_mode must be a ForwardMode", ops=ops)
        if len(c.lens) != len(c.slots):
            return refuse(rf"^{_rank('seq_lens')} has")
        if c.draft is not None and not self.spec:
            return refuse(
                "draft_indices given (but the map was built without spec|on some ranks only)",
                "batch.draft given but this FutureMap has spec=False",
                ops=("raise", "draft_indices given"),
            )
        bad = self.slot_fault(c.slots)
        if bad:
            return refuse(rf"{_rank('req_pool_indices')} holds", ops=("inv", bad))
        decode = c.mode == DECODE
        if decode and not self.spec and c.prefill is not None:
            return refuse("input_ids given for a DECODE batch")
        if not decode and c.prefill is None:
            return refuse("input_ids is None with forward_mode", ops=("raise", "input_ids is None"))
        if c.prefill is not None and any(i < 0 for i in c.prefill):
            return refuse(rf"{_rank('input_ids')} holds negative ids", ops=("inv", FIELDS))
        if c.prefill is not None and any(i > I32_MAX for i in c.prefill):
            return refuse(rf"{_rank('input_ids')} holds values that do not fit")
        if c.mode == MIXED and not c.slots_given:
            return refuse(
                "MIXED batch in the gather protocol needs token_slots",
                "mix_running_indices is required for a MIXED batch",
                ops=("inv", FIELDS),
            )
        if c.mode != MIXED and c.slots_given and (decode or any(c.running)):
            return refuse(
                r"token_slots (given for a DECODE batch|of a batch of kind)",
                "mix_running_indices given with forward_mode",
                ops=("inv", FIELDS),
            )
        bad = self.slot_fault(c.running) if c.mode == MIXED else None
        if bad:
            return refuse(
                rf"{_rank('token_slots')} holds",
                r"mix_running_indices (holds|has \d+ entries, more than)",
                ops=("inv", bad),
            )
        if self.spec and c.mode == MIXED:
            # Spec MIXED: the running rows are the batch's last live rows, in order.
            live = [s for s in c.slots if s]
            if c.running and live[max(len(live) - len(c.running), 0) :] != c.running:
                return refuse(
                    "a spec MIXED batch lists its running rows last",
                    r"(are not the slots of the batch's last live|mix_running_indices has)",
                    ops=("inv", FIELDS),
                )
        if c.draft is not None and len(c.draft) != len(c.slots):
            return refuse(r"draft_indices has .* rows per rank", r"draft.indices has \d+ rows")
        bad = None if c.draft is None else self.slot_fault(c.draft)
        if bad:
            if self.spec and c.mode == MIXED and any(self.lens[s] <= 0 for s in c.running):
                bad = "seq_lens > 0"  # the pure ops check the bound lengths first
            return refuse(
                rf"{_rank('draft_indices')} holds", "draft.indices holds", ops=("inv", bad)
            )
        return None

    def resolve_gather(self, c: Call) -> Expect:
        """One rank's resolve: refused, or the forward's inputs, its debug report, and the
        poison it writes ('Two protocols', 'Debug mode', 'Relay fields')."""
        refused = self.refusal(c)
        if refused is not None:
            return refused
        tok = lambda s: self.tokens[s] if s else None  # noqa: E731  # slot 0: garbage
        read: list[int] = []  # live slots read from output_tokens, in order
        if c.mode == DECODE and not self.spec:
            ids, read = [tok(s) for s in c.slots], [s for s in c.slots if s]
        elif c.mode == MIXED:
            assert c.prefill is not None
            ids, read = [*c.prefill, *map(tok, c.running)], [s for s in c.running if s]
        elif c.mode == DECODE:  # spec: the host's ids, or none (fm_jax: zeros)
            ids = list(c.prefill) if c.prefill is not None else [0] * len(c.slots)
        else:
            assert c.prefill is not None
            ids = list(c.prefill)
        got = Expect(out={"ids": ids, "lens": list(c.lens)})  # type: ignore[dict-item]
        if self.spec and c.mode == MIXED and c.running:
            # Late binding: each running row (the last live rows) gets its published
            # length + 1 ('Two protocols'); one never published is reported.
            rows = [i for i, s in enumerate(c.slots) if s][-len(c.running) :]
            for i in rows:
                got.out["lens"][i] = self.lens[c.slots[i]] + 1
            short = [s for s in c.running if self.lens[s] <= 0]
            if short:
                got.violation, got.bad = "seq_lens > 0", short
        drafted: list[int] = []
        if c.draft is not None:
            drafted = [s for s in c.draft if s]
            got.draft = {n: [self.row(n, s) if s else None for s in c.draft] for n in DRAFT_FIELDS}
            if c.mode == DECODE:  # a spec DECODE's lengths: the verified ones published
                got.out["lens"] = [self.lens[s] if s else None for s in c.draft]  # type: ignore[misc]
                short = [s for s in drafted if self.lens[s] <= 0]
                if short:
                    got.violation, got.bad = "seq_lens > 0", short
                got.poisoned_lens = sorted(set(drafted))  # consumed (debug)
        if not got.violation:
            # Each read in order: a slot read twice with no write between finds the poison
            # (a spec MIXED batch's running rows, then its draft).
            seen: set[int] = set()
            for s in read:
                if self.tokens[s] < 0 or s in seen:
                    got.bad.append(s)
                seen.add(s)
            for s in drafted:
                if min(self.tokens[s], self.vid[s], self.steps[s]) < 0 or s in seen:
                    got.bad.append(s)
            if got.bad:
                got.violation = "consume (WRWR)"
        got.poisoned = sorted({*read, *drafted})
        got.poisoned_draft = sorted(set(drafted))
        for s in got.poisoned:
            self.tokens[s] = POISON
        for s in got.poisoned_draft:
            self.vid[s] = self.steps[s] = POISON
        for s in got.poisoned_lens:
            self.lens[s] = POISON
        return got


FIELDS = "batch fields"
STASHED = "stashed tokens >= 0"
# A stash fault in the draft's shape: (fm_jax's message, fm_torch's).
DRAFT_SHAPE_FAULTS = {
    "no_vid": (r"draft.verified_id (is missing|given on some ranks only)", r"expected verified_id"),
    "topk_half": (
        r"draft.topk_(p given without draft.topk_index|index given on some ranks only)",
        r"draft.topk_p given without draft.topk_index",
    ),
    "hidden_f16": (r"draft.hidden_states", r"draft.hidden_states must have dtype"),
    "score_shape": (r"draft.score", r"draft.score must have shape"),
    "topk_width": (r"draft.topk_p", r"draft.topk_p must have shape"),
}


# ------------------------------------------------------------ the implementations' setup
@functools.cache
def _class_map(spec: bool, dp: int) -> fj.FutureMap:
    """One class map per variant for every example (brought back to the model's start by
    the machine's `start`): a fresh map per example would compile its executables again."""
    mesh = None
    if dp > 1:
        from fm_parity.mesh import make_mesh

        mesh = make_mesh(dp, 1)
    return fj.FutureMap(
        R,
        mesh=mesh,
        tp_axis="tp" if mesh is not None else None,
        spec=SPEC if spec else None,
        debug=True,
        protocol="gather",
        batch_buckets=(ROWS,),
        token_buckets=(TOKENS,),
    )


def _forward(res: fj.Resolved, batch: fj.Batch, inputs: dict[str, Any]) -> fj.StepOutput:
    """The engine's forward: each row's resolved length + 1, and as its payload the host's
    tokens (non-spec) or draft (spec: every declared field from the host); it hands back
    what it resolved. A spec DECODE row whose draft reads padding slot 0 has no length of
    its own (slot 0's garbage, in debug at first the poison): it publishes 0 + 1, as the
    model's tail does for a row without one."""
    if "tokens" in inputs:
        return fj.StepOutput(res.seq_lens + 1, inputs["tokens"], res)
    extras = {k: v for k, v in inputs.items() if k not in STANDARD_FIELDS}
    draft = fj.DraftPayload(**{k: inputs[k] for k in STANDARD_FIELDS}, extras=extras)
    lens = res.seq_lens
    if batch.draft_indices is not None:
        didx, mode = jnp.asarray(batch.draft_indices), jnp.asarray(batch.forward_mode)
        if mode.ndim:  # a mesh: one mode per rank, each rank's rows in turn
            mode = jnp.repeat(mode, didx.shape[0] // mode.shape[0])
        lens = jnp.where((mode == DECODE) & (didx == 0), 0, lens)
    return fj.StepOutput(lens + 1, draft, res)


STANDARD_FIELDS = ("bonus_tokens", "verified_id", "topk_p", "topk_index", "hidden_states")
STEP_INPUTS = {  # the engine's host inputs: the step's payload
    False: [fj.StepInput("tokens", "row")],
    True: [
        fj.StepInput("bonus_tokens", "row"),
        fj.StepInput("verified_id", "row"),
        fj.StepInput("topk_p", "row", (K,), np.float32),
        fj.StepInput("topk_index", "row", (K,)),
        fj.StepInput("hidden_states", "row", (H,), jnp.bfloat16),
        fj.StepInput("score", "row", (2,), np.float32),
        fj.StepInput("steps", "row"),
    ],
}


@functools.cache
def _engine_step(spec: bool, dp: int) -> fj.EngineStep:
    """The class map's engine step (compiled once per variant)."""
    return _class_map(spec, dp).engine_step(_forward, inputs=STEP_INPUTS[spec])


@functools.cache
def _pure(spec: bool) -> dict[str, Any]:
    """The pure ops, each jitted once under checkify (fixed padded shapes)."""
    ops = fj.future_map(R, spec=SPEC if spec else None, debug=True, protocol="gather")
    return {
        "ops": ops,
        "publish": _checked(ops.publish),
        "stash": _checked(ops.stash),
        "resolve": _checked(ops.resolve),
        "read": _checked(ops.seq_lens_at),
    }


def a(xs: list[int]) -> np.ndarray:
    return np.array(xs, np.int64)


def t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def _pad(xs: list[int] | np.ndarray, n: int) -> np.ndarray:
    """Rows padded with zero rows to n (a bucket of the pure ops), ints as int32."""
    x = np.array(xs, np.int64) if isinstance(xs, list) else np.asarray(xs)
    out = np.zeros((n, *x.shape[1:]), x.dtype)
    out[: len(x)] = x
    return out.astype(np.int32) if out.dtype.kind in "iu" and out.dtype.itemsize > 2 else out


def _draft_arrays(d: Draft, fault: str | None, pad: int | None = None) -> dict[str, Any]:
    """The draft's numpy arrays as both twins take them, the shape fault applied (None: a
    field left out); `pad` pads every field to that many rows (the pure ops)."""
    topk_p = d.topk_p.astype(np.uint32).view(np.float32)
    topk_index = d.topk_index.astype(np.int64)
    hidden = d.hidden.astype(np.uint16).view(np.float16 if fault == "hidden_f16" else jnp.bfloat16)
    score = d.score.astype(np.uint32).view(np.float32)
    if fault == "topk_width":
        topk_p = np.concatenate([topk_p, topk_p[:, :1]], axis=1)
        topk_index = np.concatenate([topk_index, topk_index[:, :1]], axis=1)
    if fault == "score_shape":
        score = np.concatenate([score, score[:, :1]], axis=1)
    out: dict[str, Any] = {
        "bonus_tokens": a(d.bonus),
        "verified_id": None if fault == "no_vid" else a(d.vid),
        "topk_p": topk_p,
        "topk_index": topk_index,
        "hidden_states": hidden,
        "score": score,
        "steps": np.array(d.steps, np.int32),  # fm_torch's buffer takes the first's dtype
    }
    if fault == "topk_half":
        out["topk_index"] = None
    if pad is not None:
        out = {k: None if v is None else _pad(v, pad) for k, v in out.items()}
    return out


def jax_draft(arrays: dict[str, Any]) -> fj.DraftPayload:
    return fj.DraftPayload(
        **{k: arrays[k] for k in STANDARD_FIELDS},
        extras={k: v for k, v in arrays.items() if k not in STANDARD_FIELDS},
    )


def torch_draft(arrays: dict[str, Any]) -> ft.DraftPayload:
    def tensor(x: Any) -> torch.Tensor | None:
        if x is None:
            return None
        if x.dtype == np.dtype(jnp.bfloat16):
            return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(x.copy())

    return ft.DraftPayload(
        **{k: tensor(arrays[k]) for k in STANDARD_FIELDS},
        extras={k: tensor(v) for k, v in arrays.items() if k not in STANDARD_FIELDS},  # type: ignore[misc]
    )


def _bits(x: Any) -> bytes:
    """The raw bytes of a host or device array, or of a tensor."""
    if isinstance(x, torch.Tensor):
        x = x.view(torch.int16) if x.dtype in (torch.bfloat16, torch.float16) else x
        return bytes(x.contiguous().numpy().tobytes())
    return bytes(np.ascontiguousarray(np.asarray(x)).tobytes())


def _ints(x: Any) -> list[int]:
    return [int(v) for v in np.asarray(x.numpy() if isinstance(x, torch.Tensor) else x)]


def _state_buffers(state: fj.FutureMapState) -> dict[str, Any]:
    """A fm_jax state's buffers by the model's names (the extras by their own)."""
    out = {k: v for k, v in state._asdict().items() if v is not None and k != "extras"}
    out.update(state.extras or {})
    return out


def _torch_buffers(tm: ft.FutureMap) -> dict[str, Any]:
    out = {
        "output_tokens": tm.output_tokens,
        "new_seq_lens": tm.new_seq_lens,
        "verified_id": tm.verified_id,
        "topk_p": tm.topk_p,
        "topk_index": tm.topk_index,
        "hidden_states": tm.hidden_states,
    }
    out.update(tm.extras)
    return {k: v for k, v in out.items() if v is not None}


def _draft_out(draft: Any) -> dict[str, Any]:
    """A resolved draft's fields by the model's names (either twin's payload)."""
    out = {n: getattr(draft, n) for n in ("bonus_tokens", "verified_id", "topk_p", "topk_index")}
    out["hidden_states"] = draft.hidden_states
    out.update(draft.extras or {})
    return out


# ------------------------------------------------------------------------ the machine
LENGTHS = st.integers(-3, 30).map(lambda v: max(v, 0))  # 0 often: a length never published
bits32 = st.sampled_from(F32_BITS)
bits16 = st.sampled_from(BF16_BITS)
WRITE_FAULTS = st.sampled_from([None, None, None, None, "slot", "dup", "negative", "big"])
STASH_FAULTS = st.sampled_from(
    [None, None, None, None, None, "slot", "dup", "neg_bonus", "neg_vid", "neg_steps", "big"]
    + sorted(DRAFT_SHAPE_FAULTS)
)
RESOLVE_FAULTS: list[str | None] = [
    *[None] * 16,
    "stray",
    "slot",
    "dup",
    "mode",
    "lens_rows",
    "ids_missing",
    "ids_on_decode",
    "neg_id",
    "big_id",
    "mixed_no_slots",
    "ts_not_mixed",
    "ts_slot",
    "ts_dup",
    "ts_order",
    "draft_nonspec",
    "draft_len",
    "draft_slot",
    "draft_dup",
]
SPEC_ONLY = {"draft_len", "draft_slot", "draft_dup", "ts_order"}
NONSPEC_ONLY = {"ids_on_decode", "draft_nonspec", "stray"}
DRAFT_FAULTS = {"draft_len", "draft_slot", "draft_dup"}
KINDS = [EXTEND, DECODE, DECODE, MIXED, MIXED, IDLE]
FAULT_KINDS = {  # the kinds a fault applies to (drawn from these when it is drawn)
    "ids_missing": [EXTEND, MIXED, IDLE],
    "ids_on_decode": [DECODE],
    "neg_id": [EXTEND, MIXED],
    "big_id": [EXTEND, MIXED],
    "mixed_no_slots": [MIXED],
    "ts_slot": [MIXED],
    "ts_dup": [MIXED],
    "ts_order": [MIXED],
    "stray": [MIXED],
    "ts_not_mixed": [EXTEND, DECODE, IDLE],
}


def draw_draft(data: st.DataObject, n: int) -> Draft:
    ints = lambda lo, hi: data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))  # noqa: E731
    grid = lambda s, w: np.array(  # noqa: E731
        data.draw(st.lists(s, min_size=n * w, max_size=n * w)), np.int64
    ).reshape(n, w)
    return Draft(
        bonus=ints(0, 30),
        vid=ints(0, 30),
        steps=ints(0, 9),
        topk_p=grid(bits32, K).astype(np.uint32),
        topk_index=grid(st.integers(0, 99), K),
        hidden=grid(bits16, H).astype(np.uint16),
        score=grid(bits32, 2).astype(np.uint32),
    )


def init_draft() -> Draft:
    """The first draft every map stashes at every live slot (it shapes fm_torch's buffers)."""
    n = len(LIVE)
    pick = lambda bits, w: np.array(  # noqa: E731
        [[bits[(i * w + j) % len(bits)] for j in range(w)] for i in range(n)], np.int64
    )
    return Draft(
        bonus=[1] * n,
        vid=[2] * n,
        steps=[3] * n,
        topk_p=pick(F32_BITS, K).astype(np.uint32),
        topk_index=pick(list(range(10, 20)), K),
        hidden=pick(BF16_BITS, H).astype(np.uint16),
        score=pick(F32_BITS[::-1], 2).astype(np.uint32),
    )


class GatherMachine(RuleBasedStateMachine):
    """Both twins (and, on one device, the pure ops) side by side, against `GatherModel`."""

    SPEC: ClassVar[bool] = False
    DP: ClassVar[int] = 1
    FAULTS: ClassVar[list[str | None]] = RESOLVE_FAULTS

    def __init__(self) -> None:
        super().__init__()
        self.models = [GatherModel(spec=self.SPEC) for _ in range(self.DP)]
        self.fm = _class_map(self.SPEC, self.DP)
        self.engine = _engine_step(self.SPEC, self.DP)
        self.published = [LIVE] * self.DP  # each rank's slots of the last publish
        self.returned: list[Any] = []  # the arrays the last read returned (the caller's)
        self.tms = [
            ft.FutureMap(
                R,
                dtype=torch.int32,
                spec=self.SPEC,
                debug=True,
                consumed=CONSUMED if self.SPEC else (),
                protocol="gather",
            )
            for _ in range(self.DP)
        ]
        self.pure = _pure(self.SPEC) if self.DP == 1 else None
        self.state: fj.FutureMapState | None = None

    # ------------------------------------------------------------------------ helpers
    def jx(self, per_rank: list[Any]) -> Any:
        """fm_jax's form of per-rank inputs: as they are on one device, a mapping on a mesh."""
        return per_rank[0] if self.DP == 1 else dict(enumerate(per_rank))

    def faults(self) -> list[str | None]:
        """The resolve faults that apply to this variant."""
        skip = NONSPEC_ONLY if self.SPEC else SPEC_ONLY
        return [f for f in self.FAULTS if f not in skip]

    def undo_if_refused(self, saved: list[GatherModel], wants: list[Expect]) -> None:
        """A call one rank refuses is refused whole (fm_jax holds every rank in one map):
        the other ranks' models as they were."""
        if any(w.refused for w in wants):
            self.models = saved

    @initialize()
    def start(self) -> None:
        """Every implementation at the model's start: lengths 0, tracked fields poisoned,
        (spec) the first draft's rows in every untracked field."""
        fm, live = self.fm, a(LIVE)
        with contextlib.suppress(fj.InvariantViolation):
            fm.check()  # an earlier failing example may have left errors pending
        zeros, ones = a([0] * len(LIVE)), a([1] * len(LIVE))
        # Spec: lengths published (a spec DECODE reads them); a 0 published later is
        # reported as a length never published.
        lens = [s + 3 if self.SPEC else 0 for s in LIVE]
        fm.publish(self.jx([live] * self.DP), self.jx([a(lens)] * self.DP))
        for m, tm in zip(self.models, self.tms, strict=True):
            tm.publish(t(LIVE), t(lens))
            m.lens.update(zip(LIVE, lens, strict=True))
            m.armed = True
        if self.SPEC:
            d = init_draft()
            arrays = _draft_arrays(d, None)
            fm.stash(self.jx([live] * self.DP), self.jx([jax_draft(arrays)] * self.DP))
            batch = fj.Batch(fj.ForwardMode.EXTEND, live, ones, ones, draft_indices=live)
            for m, tm in zip(self.models, self.tms, strict=True):
                tm.stash(t(LIVE), torch_draft(arrays))
                tb = ft.ScheduleBatch(
                    ft.ForwardMode.EXTEND, t(LIVE), t([1] * 4), t([1] * 4), ft.DraftInput(t(LIVE))
                )
                tm.resolve(tb)  # consumes every tracked field: all poisoned
                for i, s in enumerate(LIVE):
                    for name in ROW_FIELDS:
                        m.rows.setdefault(name, {})[s] = d.row(name, i)
        else:
            fm.stash(self.jx([live] * self.DP), self.jx([zeros] * self.DP))
            batch = fj.Batch(fj.ForwardMode.DECODE, live, None, ones)
        fm.resolve(self.jx([batch] * self.DP))  # poisons every tracked field
        fm.check()
        self.published, self.returned = [LIVE] * self.DP, []
        if self.pure is not None:
            p = self.pure
            err, self.state = p["publish"](p["ops"].init(), _pad(LIVE, ROWS), _pad(lens, ROWS))
            fj.raise_if_violated(err)
            if self.SPEC:
                padded = jax_draft(_draft_arrays(d, None, pad=ROWS))
                err, state = p["stash"](self.state, _pad(LIVE, ROWS), padded)
                fj.raise_if_violated(err)
                one = _pad([1] * len(LIVE), ROWS)
                b = fj.Batch(jnp.int32(EXTEND), _pad(LIVE, ROWS), one, one, _pad(LIVE, ROWS))
                err, (self.state, _) = p["resolve"](state, b)
                fj.raise_if_violated(err)
        self.compare_buffers()

    # ------------------------------------------------------------------- comparisons
    def compare_buffers(self) -> None:
        """Every live buffer row of every implementation holds the model's bytes."""
        jax_bufs = _state_buffers(self.fm.state)
        for d, model in enumerate(self.models):
            impls = {
                "class": {k: fj.per_rank(v, self.fm.layout)[d] for k, v in jax_bufs.items()},
                "torch": _torch_buffers(self.tms[d]),
            }
            if self.state is not None:
                impls["ops"] = _state_buffers(self.state)
            for who, bufs in impls.items():
                names = ["output_tokens", "new_seq_lens"]
                names += ["verified_id", "steps", *ROW_FIELDS] if self.SPEC else []
                assert sorted(bufs) == sorted(names), (who, sorted(bufs))
                for name in names:
                    got, want = _bits(bufs[name][1:R]), model.buffer(name)
                    assert got == want, (who, d, name, got.hex(), want.hex())

    def run(
        self, op: str, wants: list[Expect], on_class: Any, on_torch: Any, on_ops: Any
    ) -> dict[Any, Any] | None:
        """One call on every implementation: refusals and violations checked against the
        model; the outputs of a good call by implementation ('class', ('torch', rank),
        'ops'), None for a refused one.

        Args:
          op: the call, for the statistics (`--hypothesis-show-statistics`).
          wants: the model's outcome per rank.
          on_class: the fm_jax class call.
          on_torch: rank -> (the fm_torch call, the batch it rewrites or None).
          on_ops: (err, outputs) of the pure ops (one device), or None.
        """
        refused = [d for d, w in enumerate(wants) if w.refused]
        step = self.fm.step
        what = [w.torch_refused for w in wants if w.refused] or [
            w.violation for w in wants if w.violation
        ]
        event(f"{op}: {what[0] if what else 'good'}")
        if refused:
            assert len(refused) == 1, "one fault per call"
            want = wants[refused[0]]
            with pytest.raises(fj.FutureMapError) as jerr:
                on_class()
            assert re.search(want.refused, str(jerr.value)), (want.refused, str(jerr.value))
            call, tb = on_torch(refused[0])
            before = None if tb is None else (tb.input_ids, tb.seq_lens, tb.draft)
            with pytest.raises(ft.FutureMapError) as terr:
                call()
            assert re.search(want.torch_refused, str(terr.value)), (
                want.torch_refused,
                str(terr.value),
            )
            if tb is not None:  # the batch as it was
                assert before == (tb.input_ids, tb.seq_lens, tb.draft)
                assert tb.draft is None or tb.draft.payload is None
            if on_ops is not None and want.ops is not None:
                how, seen = want.ops
                if how == "raise":
                    with pytest.raises(fj.FutureMapError, match=seen):
                        on_ops(False)
                else:
                    err, _ = on_ops(False)  # its result dropped: nothing written
                    with pytest.raises(fj.InvariantViolation) as info:
                        fj.raise_if_violated(err)
                    assert info.value.invariant == seen, info.value
            self.fm.check()  # a refused call records nothing
            assert self.fm.step == step
            return None
        outs: dict[Any, Any] = {"class": None}
        violated = {d: w.violation for d, w in enumerate(wants) if w.violation}
        if violated:
            with pytest.raises(fj.InvariantViolation) as info:
                outs["class"] = on_class()  # a read raises its violations itself
                self.fm.check()
            first: dict[int, str] = {}  # a rank's later reports follow from its first
            for v in info.value.violations:
                first.setdefault(v.rank or 0, v.invariant)
            assert first == violated, info.value
            for v in info.value.violations:
                assert set(v.slots) <= set(wants[v.rank or 0].bad), (v, wants[v.rank or 0].bad)
        else:
            outs["class"] = on_class()
            self.fm.check()
        for d, want in enumerate(wants):
            call, tb = on_torch(d)
            if not want.violation:
                outs[("torch", d)] = call()
                continue
            before = None if tb is None else (tb.input_ids, tb.seq_lens, tb.draft)
            with pytest.raises(ft.InvariantViolation) as tinfo:
                call()
            assert tinfo.value.invariant == want.violation, tinfo.value
            named = tinfo.value.slots or want.violation == "fresh publish"  # names no slot
            assert named and set(tinfo.value.slots) <= set(want.bad), tinfo.value
            if tb is not None:
                assert before == (tb.input_ids, tb.seq_lens, tb.draft)
                assert tb.draft is None or tb.draft.payload is None
            # fm_torch's CPU path wrote nothing; its device path would have poisoned.
            tm = self.tms[d]
            if want.poisoned:
                tm.output_tokens[t(want.poisoned)] = POISON
            if want.poisoned_lens:
                tm.new_seq_lens[t(want.poisoned_lens)] = POISON
            if want.poisoned_draft:
                assert tm.verified_id is not None
                tm.verified_id[t(want.poisoned_draft)] = POISON
                tm.extras["steps"][t(want.poisoned_draft)] = POISON
        if on_ops is not None:
            err, outs["ops"] = on_ops(True)
            seen = wants[0].violation if wants[0].ops_violation is None else wants[0].ops_violation
            if seen:
                with pytest.raises(fj.InvariantViolation) as info:
                    fj.raise_if_violated(err)
                assert info.value.invariant == seen, info.value
            else:
                fj.raise_if_violated(err)
        return outs

    # ------------------------------------------------------------------------ rules
    def draw_slots(self, data: st.DataObject, d: int, fault: str | None) -> list[int]:
        return _with_slot_fault(data.draw(slot_lists), fault, data)

    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        """publish, or (non-spec) stash tokens."""
        self.write_step(data)

    @rule(data=st.data())
    def write_again(self, data: st.DataObject) -> None:
        """A second write rule: writes keep slots readable for as many resolves."""
        self.write_step(data)

    def write_step(self, data: st.DataObject) -> None:
        op = "publish" if self.SPEC else data.draw(st.sampled_from(["publish", "stash"]))
        faulty = data.draw(st.integers(0, self.DP - 1))
        slots, values, wants = [], [], []
        saved = copy.deepcopy(self.models)
        for d in range(self.DP):
            fault = data.draw(WRITE_FAULTS) if d == faulty else None
            s = self.draw_slots(data, d, fault)
            v = data.draw(st.lists(LENGTHS, min_size=len(s), max_size=len(s)))
            if fault == "negative" and s:
                v[data.draw(st.integers(0, len(s) - 1))] = data.draw(st.integers(-5, -1))
            if fault == "big" and s:
                v[data.draw(st.integers(0, len(s) - 1))] = BIG
            slots.append(s)
            values.append(v)
            wants.append(self.models[d].write_values(op, s, v))
        self.undo_if_refused(saved, wants)

        def on_ops(good: bool) -> Any:
            assert self.pure is not None and self.state is not None
            err, new = self.pure[op](self.state, _pad(slots[0], ROWS), _pad(values[0], ROWS))
            if good:
                self.state = new
            return err, None

        host = [(a(s), a(v)) for s, v in zip(slots, values, strict=True)]
        self.run(
            op,
            wants,
            lambda: getattr(self.fm, op)(
                self.jx([x[0] for x in host]), self.jx([x[1] for x in host])
            ),
            lambda d: (lambda: getattr(self.tms[d], op)(t(slots[d]), t(values[d])), None),
            on_ops
            if self.pure is not None and not any(w.ops is None and w.refused for w in wants)
            else None,
        )
        for arrays in host:  # the engine refills its arrays for the next batch
            for x in arrays:
                x[:] = SCRIBBLE
        if op == "publish" and not any(w.refused for w in wants):
            self.published = slots
        self.compare_buffers()

    @precondition(lambda self: self.SPEC)
    @rule(data=st.data())
    def stash_draft(self, data: st.DataObject) -> None:
        self.stash_draft_step(data)

    @precondition(lambda self: self.SPEC)
    @rule(data=st.data())
    def stash_draft_again(self, data: st.DataObject) -> None:
        """A second stash rule: stashes keep slots readable for as many resolves."""
        self.stash_draft_step(data)

    def stash_draft_step(self, data: st.DataObject) -> None:
        faulty = data.draw(st.integers(0, self.DP - 1))
        slots, arrays, wants = [], [], []
        drafts, faults = [], []
        saved = copy.deepcopy(self.models)
        for d in range(self.DP):
            fault = data.draw(STASH_FAULTS) if d == faulty else None
            s = self.draw_slots(data, d, fault if fault in ("slot", "dup") else None)
            dr = draw_draft(data, len(s))
            if s and fault in ("neg_bonus", "neg_vid", "neg_steps", "big"):
                i = data.draw(st.integers(0, len(s) - 1))
                value = BIG if fault == "big" else data.draw(st.integers(-5, -1))
                {"neg_bonus": dr.bonus, "big": dr.bonus, "neg_vid": dr.vid, "neg_steps": dr.steps}[
                    fault
                ][i] = value
            shape_fault = fault if fault in DRAFT_SHAPE_FAULTS else None
            slots.append(s)
            drafts.append(dr)
            faults.append(shape_fault)
            arrays.append(_draft_arrays(dr, shape_fault))
            wants.append(self.models[d].stash_draft(s, dr, shape_fault if s else None))
        if any(f is not None and not s for f, s in zip(faults, slots, strict=True)):
            self.models = saved
            return  # a shape fault with no rows: an idle call, a no-op for fm_torch only
        self.undo_if_refused(saved, wants)

        def on_ops(good: bool) -> Any:
            assert self.pure is not None and self.state is not None
            padded = _draft_arrays(drafts[0], faults[0], pad=ROWS)
            err, new = self.pure["stash"](self.state, _pad(slots[0], ROWS), jax_draft(padded))
            if good:
                self.state = new
            return err, None

        self.run(
            "stash draft",
            wants,
            lambda: self.fm.stash(
                self.jx(list(map(a, slots))), self.jx(list(map(jax_draft, arrays)))
            ),
            lambda d: (lambda: self.tms[d].stash(t(slots[d]), torch_draft(arrays[d])), None),
            on_ops
            if self.pure is not None and not any(w.ops is None and w.refused for w in wants)
            else None,
        )
        self.compare_buffers()

    @rule(data=st.data())
    def read_lengths(self, data: st.DataObject) -> None:
        faulty = data.draw(st.integers(0, self.DP - 1))
        slots = [
            self.draw_slots(data, d, data.draw(st.sampled_from([None, None, None, "slot", "dup"])))
            if d == faulty
            else self.draw_slots(data, d, None)
            for d in range(self.DP)
        ]
        self.read_step(slots)

    @rule()
    def read_published(self) -> None:
        """Exactly each rank's slots last published (or stepped): the copy that publish
        kept (host lengths)."""
        self.read_step(self.published)

    def read_step(self, slots: list[list[int]]) -> None:
        """resolve_seq_lens_cpu: the model's lengths, each array returned the caller's own
        (fresh, writable), updated in place by the caller afterwards."""
        saved = copy.deepcopy(self.models)
        wants = [m.read_lengths(s) for m, s in zip(self.models, slots, strict=True)]
        self.undo_if_refused(saved, wants)  # a refused read consumes no publish

        def on_ops(good: bool) -> Any:
            assert self.pure is not None
            return self.pure["read"](self.state, _pad(slots[0], ROWS))

        outs = self.run(
            "resolve_seq_lens_cpu",
            wants,
            lambda: self.fm.resolve_seq_lens_cpu(self.jx([a(s) for s in slots])),
            lambda d: (lambda: self.tms[d].resolve_seq_lens_cpu(t(slots[d])), None),
            on_ops if self.pure is not None else None,
        )
        if outs is not None and not any(w.violation for w in wants):
            got = outs["class"] if self.DP > 1 else {0: outs["class"]}
            for d, want in enumerate(wants):
                live = [i for i, s in enumerate(slots[d]) if s]
                lens = want.out["lens"]
                gots = {"class": got[d], "torch": outs[("torch", d)]}
                if "ops" in outs:
                    gots["ops"] = outs["ops"]
                for who, g in gots.items():
                    g = _ints(g)
                    assert [g[i] for i in live] == [lens[i] for i in live], (who, d)
            mine = [*got.values(), *(outs[("torch", d)] for d in range(self.DP))]
            for x in mine:
                host = x.numpy() if isinstance(x, torch.Tensor) else x
                assert type(host) is np.ndarray and host.flags.writeable, type(x)
                assert not any(np.shares_memory(host, y) for y in self.returned), "not fresh"
            self.returned = [x.numpy() if isinstance(x, torch.Tensor) else x for x in mine]
            for x in self.returned:
                x += SCRIBBLE  # the caller updates its copy in place: nothing the map keeps
        self.compare_buffers()

    @rule(data=st.data())
    def invalidate(self, data: st.DataObject) -> None:
        """No sentinels in the gather protocol: every implementation refuses it."""
        s = data.draw(slot_lists)
        batch = fj.Batch(fj.ForwardMode.DECODE, a(s), None, a(s))
        with pytest.raises(fj.FutureMapError, match="no sentinels"):
            self.fm.invalidate(self.jx([batch] * self.DP), self.jx([a(s)] * self.DP))
        for tm in self.tms:
            tb = ft.ScheduleBatch(ft.ForwardMode.DECODE, t(s), None, t(s))
            with pytest.raises(ft.FutureMapError, match="no sentinels"):
                tm.invalidate(tb, t(s))
            assert tb.input_ids is None
        if self.pure is not None:
            with pytest.raises(fj.FutureMapError, match="no sentinels"):
                self.pure["ops"].invalidate(batch, _pad(s, ROWS))
        self.compare_buffers()

    def draw_call(self, data: st.DataObject, d: int, fault: str | None) -> Call | None:
        """One rank's batch from the batch-fields table, with `fault` (if it applies)."""
        model, spec = self.models[d], self.SPEC
        kind = data.draw(st.sampled_from(FAULT_KINDS.get(fault or "", KINDS)))
        ready = [s for s in LIVE if model.tokens[s] >= 0 and model.lens[s] > 0]
        slots = data.draw(slot_lists)
        if ready and data.draw(st.integers(0, 3)) > 0:  # slots a good step runs
            slots = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3, unique=True))
        if fault in FAULT_KINDS and len([s for s in slots if s]) < 2:  # rows to break
            pool = ready if len(ready) >= 2 else LIVE
            slots = data.draw(st.lists(st.sampled_from(pool), min_size=2, max_size=3, unique=True))
        if kind == IDLE:
            slots = []
        n = len(slots)
        n_prefill = {EXTEND: n, MIXED: data.draw(st.integers(0, n))}.get(kind, 0)
        if kind == MIXED and spec:
            # A spec MIXED batch's layout: prefill rows, running rows, then padding rows
            # (padding among live rows: test_finding_f6; a padding running row: F5).
            live = [s for s in slots if s]
            slots = live + [0] * (n - len(live))
            n_prefill = min(n_prefill, len(live))
            running = live[n_prefill:]
        else:
            running = slots[n_prefill:] if kind == MIXED else []
        c = Call(
            kind,
            kind,
            slots,
            data.draw(st.lists(st.integers(1, 20), min_size=n, max_size=n)),
            None,
            enum=data.draw(st.booleans()),
        )
        if kind in (EXTEND, MIXED, IDLE):
            c.prefill = []
            for i in range(n_prefill):
                # Two tokens where every later row keeps room for its one.
                room = TOKENS - len(c.prefill) - 2 - (n_prefill - i - 1) - len(running)
                k = data.draw(st.integers(1, 2)) if room >= 0 else 1
                c.prefill += data.draw(st.lists(st.integers(0, 30), min_size=k, max_size=k))
        if kind == MIXED:
            c.running = running
            c.filler = data.draw(
                st.lists(st.integers(0, 30), min_size=len(running), max_size=len(running))
            )
            c.slots_given = True
        elif kind in (EXTEND, IDLE):
            c.slots_given = data.draw(st.booleans())  # all 0 (fm_torch: none)
        elif spec and data.draw(st.booleans()):  # a spec DECODE brings ids or none
            c.prefill = data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
        if spec and (kind == DECODE or fault in DRAFT_FAULTS or data.draw(st.booleans())):
            c.draft = self.draw_draft_slots(data, c, ready)
        return self.with_fault(data, d, c, fault)

    def draw_draft_slots(self, data: st.DataObject, c: Call, ready: list[int]) -> list[int]:
        """One draft slot per row: the rows' own slots (a spec DECODE; a spec MIXED's then
        reads its running slots twice), or other live slots, mostly ones a good step reads
        (padding 0 when too few)."""
        if data.draw(st.booleans()):
            return list(c.slots)
        pool = ready if ready and data.draw(st.integers(0, 3)) > 0 else LIVE
        k = min(len(c.slots), len(pool))
        picked = data.draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k, unique=True))
        return picked + [0] * (len(c.slots) - k)

    def with_fault(self, data: st.DataObject, d: int, c: Call, fault: str | None) -> Call | None:
        """`c` with one fault of the table (good input for 'stray'); None when the call
        would not fit the one bucket."""
        tokens = lambda: len(c.jax_ids() or [])  # noqa: E731
        if fault in ("slot", "dup"):
            n = len(c.slots)
            c.slots = _with_slot_fault(c.slots, fault, data)
            if len(c.slots) != n:  # one row more: its length and draft slot with it
                c.lens = c.lens + [1] * (len(c.slots) - n)
                c.draft = None if c.draft is None else c.draft + [0] * (len(c.slots) - n)
        elif fault == "mode":
            c.mode = data.draw(st.sampled_from([7, -1, True]))
        elif fault == "lens_rows":
            shorter = bool(c.lens) and data.draw(st.booleans())
            c.lens = c.lens[:-1] if shorter else [*c.lens, 5]
        elif fault == "ids_missing" and c.kind != DECODE:
            c.prefill, c.filler = None, []
        elif fault == "ids_on_decode" and c.kind == DECODE and not self.SPEC:
            c.prefill = data.draw(st.lists(st.integers(0, 30), min_size=len(c.slots), max_size=4))
        elif fault in ("neg_id", "big_id") and c.prefill is not None:
            bad = BIG if fault == "big_id" else data.draw(st.integers(-5, -1))
            if c.prefill:
                c.prefill[data.draw(st.integers(0, len(c.prefill) - 1))] = bad
            else:  # no prefill token: one more, first (the running tokens follow)
                c.prefill = [bad]
        elif fault == "mixed_no_slots" and c.kind == MIXED:
            c.slots_given = False
        elif fault == "ts_not_mixed" and c.kind != MIXED and tokens() < TOKENS:
            c.running = [data.draw(st.sampled_from(LIVE))]
            c.filler, c.slots_given = [0] if c.prefill is not None else [], True
        elif fault == "ts_slot" and c.kind == MIXED:
            bad = data.draw(st.sampled_from([-1, R, R + 3]))
            if c.running:
                c.running = [*c.running[:-1], bad]
            elif tokens() < TOKENS:
                c.running, c.filler = [bad], [0]
        elif fault == "ts_dup" and c.kind == MIXED:
            live = [i for i, s in enumerate(c.running) if s]
            if live and len(c.running) >= 2:
                i = live[0]
                j = next(j for j in range(len(c.running)) if j != i)
                c.running[j] = c.running[i]
            elif live and tokens() < TOKENS:
                c.running, c.filler = [*c.running, c.running[live[0]]], [*c.filler, 0]
        elif fault == "ts_order" and c.kind == MIXED and self.SPEC:
            # A spec MIXED batch whose running rows are not its last live rows, in order.
            if len(c.running) >= 2:
                c.running = c.running[::-1]
            elif c.running and c.prefill:
                c.running = [next(s for s in c.slots if s)]
        elif fault == "stray" and c.kind == MIXED and c.running and not self.SPEC:
            # Good input (non-spec): a running slot naming a live slot outside the batch
            # (one holding a token when there is one).
            outside = [s for s in LIVE if s not in c.slots]
            held = [s for s in outside if self.models[d].tokens[s] >= 0] or outside
            if held:
                c.running = [*c.running[:-1], data.draw(st.sampled_from(held))]
        elif fault == "draft_nonspec" and not self.SPEC:
            c.draft = list(c.slots)
        elif fault == "draft_len" and c.draft is not None:
            shorter = bool(c.draft) and data.draw(st.booleans())
            c.draft = c.draft[:-1] if shorter else [*c.draft, 0]
        elif fault == "draft_slot" and c.draft:
            c.draft = [*c.draft[:-1], data.draw(st.sampled_from([-1, R, R + 3]))]
        elif fault == "draft_dup" and c.draft and len(c.draft) >= 2 and any(c.draft):
            i = next(i for i, s in enumerate(c.draft) if s)
            c.draft[next(j for j in range(len(c.draft)) if j != i)] = c.draft[i]
        if tokens() > TOKENS or len(c.slots) > ROWS:
            return None
        return c

    @rule(data=st.data())
    def resolve(self, data: st.DataObject) -> None:
        self.resolve_step(data)

    @rule(data=st.data())
    def resolve_again(self, data: st.DataObject) -> None:
        """A second resolve rule: resolves are most of the steps."""
        self.resolve_step(data)

    def draw_calls(self, data: st.DataObject) -> list[Call] | None:
        """One call per rank, one rank's with a fault drawn; None where a size is no bucket."""
        faulty = data.draw(st.integers(0, self.DP - 1))
        calls: list[Call] = []
        for d in range(self.DP):
            c = self.draw_call(
                data, d, data.draw(st.sampled_from(self.faults())) if d == faulty else None
            )
            if c is None:
                return None
            calls.append(c)
        return calls

    def resolve_step(self, data: st.DataObject) -> None:
        calls = self.draw_calls(data)
        if calls is None:
            return  # the class would refuse the size (not a bucket): another rule
        saved = copy.deepcopy(self.models)
        wants = [m.resolve_gather(c) for m, c in zip(self.models, calls, strict=True)]
        self.undo_if_refused(saved, wants)
        tbs = [self.torch_batch(c) for c in calls]

        def on_ops(good: bool) -> Any:
            assert self.pure is not None and self.state is not None
            err, (new, res) = self.pure["resolve"](self.state, self.ops_batch(calls[0]))
            if good:
                self.state = new
            return err, res

        ops_ok = self.pure is not None and not (wants[0].refused and wants[0].ops is None)
        kinds = "+".join(MODE_NAMES[c.mode] if c.known_mode() else "bad mode" for c in calls)
        outs = self.run(
            f"resolve {kinds}",
            wants,
            lambda: self.fm.resolve(self.jx([self.jax_batch(c) for c in calls])),
            lambda d: (lambda: self.tms[d].resolve(tbs[d]), tbs[d]),
            on_ops if ops_ok else None,
        )
        if outs is not None:
            self.compare_resolved(calls, wants, outs, tbs)
        self.compare_buffers()

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """An engine step: on the class its `engine_step` (resolve, a forward whose lengths
        are each row's resolved length + 1 and whose payload is the host's tokens or draft,
        publish and stash: one dispatch); on fm_torch and the pure ops resolve, then
        publish and stash."""
        calls = self.draw_calls(data)
        if calls is None:
            return  # the class would refuse the size (not a bucket): another rule
        n = [len(c.slots) for c in calls]
        ints = lambda k: data.draw(st.lists(st.integers(0, 30), min_size=k, max_size=k))  # noqa: E731
        payloads: list[Any] = [draw_draft(data, k) if self.SPEC else ints(k) for k in n]
        saved = copy.deepcopy(self.models)
        wants = [m.resolve_gather(c) for m, c in zip(self.models, calls, strict=True)]
        self.undo_if_refused(saved, wants)
        afters = [[(x or 0) + 1 for x in w.out.get("lens", [])] for w in wants]
        if not any(w.refused for w in wants):  # the tail: lengths and payload at the slots
            for m, c, after, p in zip(self.models, calls, afters, payloads, strict=True):
                assert not m.write_values("publish", c.slots, after).refused
                if self.SPEC:
                    assert not m.stash_draft(c.slots, p, None).refused
                else:
                    assert not m.write_values("stash", c.slots, p).refused
        # The payload's arrays: the step's inputs (ints as the declared int32), fm_torch's
        # and the pure ops' stash.
        arrays = [_draft_arrays(p, None) if self.SPEC else {"tokens": a(p)} for p in payloads]
        inputs = [
            {k: np.array(v, np.int32 if v.dtype == np.int64 else v.dtype) for k, v in x.items()}
            for x in arrays
        ]
        tbs = [self.torch_batch(c) for c in calls]

        def on_class() -> Any:
            batch = self.jx([self.jax_batch(c) for c in calls])
            given = {k: self.jx([x[k] for x in inputs]) for k in inputs[0]}
            return self.engine(batch, inputs=given).out  # the forward's: what it resolved

        def on_ops(good: bool) -> Any:
            assert self.pure is not None and self.state is not None
            p, slots = self.pure, _pad(calls[0].slots, ROWS)
            err, (state, res) = p["resolve"](self.state, self.ops_batch(calls[0]))
            if good:
                padded = {k: _pad(v, ROWS) for k, v in arrays[0].items()}
                payload = jax_draft(padded) if self.SPEC else padded["tokens"]
                for op, values in (("publish", _pad(afters[0], ROWS)), ("stash", payload)):
                    tail_err, state = p[op](state, slots, values)
                    fj.raise_if_violated(tail_err)
                self.state = state
            return err, res

        ops_ok = self.pure is not None and not (wants[0].refused and wants[0].ops is None)
        kinds = "+".join(MODE_NAMES[c.mode] if c.known_mode() else "bad mode" for c in calls)
        outs = self.run(
            f"step {kinds}",
            wants,
            on_class,
            lambda d: (lambda: self.tms[d].resolve(tbs[d]), tbs[d]),
            on_ops if ops_ok else None,
        )
        for x in inputs:  # the engine refills its arrays for the next batch
            for v in x.values():
                v[...] = SCRIBBLE
        if outs is not None:  # fm_torch's tail, after its resolve (or its violation)
            for c, tm, after, x in zip(calls, self.tms, afters, arrays, strict=True):
                tm.publish(t(c.slots), t(after))
                tm.stash(t(c.slots), torch_draft(x) if self.SPEC else torch.from_numpy(x["tokens"]))
            self.published = [c.slots for c in calls]
            self.compare_resolved(calls, wants, outs, tbs)
        self.compare_buffers()

    # ------------------------------------------------------------- batch layouts
    @staticmethod
    def jax_batch(c: Call) -> fj.Batch:
        ids, ts = c.jax_ids(), c.jax_token_slots()
        mode = fj.ForwardMode(c.mode) if c.enum and c.known_mode() else c.mode
        return fj.Batch(
            mode,
            a(c.slots),
            None if ids is None else a(ids),
            a(c.lens),
            None if c.draft is None else a(c.draft),
            None if ts is None else a(ts),
        )

    @staticmethod
    def torch_batch(c: Call) -> ft.ScheduleBatch:
        mix = c.torch_mix()
        mode = ft.ForwardMode(c.mode) if c.enum and c.known_mode() else c.mode
        return ft.ScheduleBatch(
            mode,
            t(c.slots),
            None if c.prefill is None else t(c.prefill),
            t(c.lens),
            None if c.draft is None else ft.DraftInput(t(c.draft)),
            None if mix is None else t(mix),
        )

    @staticmethod
    def ops_batch(c: Call) -> fj.Batch:
        """The pure ops' batch: padded, the mode traced; a DECODE brings ids (zeros: a
        traced kind is known only on the device), except as the missing-ids fault."""
        ids, ts = c.jax_ids(), c.jax_token_slots()
        if ids is None and c.kind == DECODE:
            ids = [0] * TOKENS
        mode = jnp.asarray(True) if c.mode is True else jnp.int32(c.mode)
        return fj.Batch(
            mode,
            _pad(c.slots, ROWS),
            None if ids is None else _pad(ids, TOKENS),
            _pad(c.lens, ROWS),
            None if c.draft is None else _pad(c.draft, ROWS),
            None if ts is None else _pad(ts, TOKENS),
        )

    def compare_resolved(
        self, calls: list[Call], wants: list[Expect], outs: dict[Any, Any], tbs: list[Any]
    ) -> None:
        """Resolved ids, lengths and draft rows: every implementation as the model, draft
        rows as bytes (garbage, None in the model, not compared)."""
        res = outs["class"]
        per = lambda x: fj.per_rank(x, self.fm.layout)  # noqa: E731
        jax_ids, jax_lens = per(res.input_ids), per(res.seq_lens)
        jax_draft = (
            None if res.draft is None else {k: per(v) for k, v in _draft_out(res.draft).items()}
        )
        for d, (c, want, tb) in enumerate(zip(calls, wants, tbs, strict=True)):
            got: dict[str, tuple[Any, Any, dict[str, Any] | None]] = {
                "class": (
                    jax_ids[d],
                    jax_lens[d],
                    None if jax_draft is None else {k: v[d] for k, v in jax_draft.items()},
                )
            }
            if "ops" in outs:
                r = outs["ops"]
                got["ops"] = (
                    r.input_ids,
                    r.seq_lens,
                    None if r.draft is None else _draft_out(r.draft),
                )
            if not want.violation:
                p = None if tb.draft is None else tb.draft.payload
                got["torch"] = (tb.input_ids, tb.seq_lens, None if p is None else _draft_out(p))
                if c.kind == DECODE and self.SPEC and c.prefill is None:
                    assert tb.input_ids is None  # fm_torch keeps none; fm_jax gives zeros
                    got["torch"] = (np.zeros(len(c.slots), np.int32), *got["torch"][1:])
            ids, lens = want.out["ids"], want.out["lens"]
            for who, (g_ids, g_lens, g_draft) in got.items():
                g = _ints(g_ids)
                assert len(g) >= len(ids), (who, d, g, ids)
                assert [g[i] for i, v in enumerate(ids) if v is not None] == [
                    v for v in ids if v is not None
                ], (who, d, "ids", g, ids)
                g = _ints(g_lens)
                assert [g[i] for i, v in enumerate(lens) if v is not None] == [
                    v for v in lens if v is not None
                ], (who, d, "lens", g, lens)
                if want.draft is None:
                    assert g_draft is None or who == "class" and self.DP > 1, (who, d)
                    continue
                assert g_draft is not None and sorted(g_draft) == sorted(DRAFT_FIELDS), who
                for name, rows in want.draft.items():
                    for i, row in enumerate(rows):
                        if row is not None:
                            have = _bits(g_draft[name][i])
                            assert have == row, (who, d, name, i, have.hex(), row.hex())


class SpecGatherMachine(GatherMachine):
    SPEC = True


class MeshGatherMachine(GatherMachine):
    DP = 2


class MeshSpecGatherMachine(GatherMachine):
    SPEC, DP = True, 2


def _run_machine(cls: type[GatherMachine], examples: int, **kw: Any) -> None:
    test = seed(SEED)(get_state_machine_test(cls, settings=_settings(examples, **kw)))
    try:
        test()
    except BaseException as e:
        e.add_note(f"gather state machine seed: FM_GATHER_SEED={SEED} reproduces this run")
        raise


def test_gather_protocol_twins_follow_the_model() -> None:
    """Non-spec gather protocol on one device: the fm_jax class, its pure ops and fm_torch
    agree with the model on every output, buffer byte, refusal and debug violation."""
    _run_machine(GatherMachine, EXAMPLES)


def test_gather_protocol_spec_twins_follow_the_model_bit_for_bit() -> None:
    """Spec gather protocol with declared fields (verified ids, an engine's float and
    tracked int fields, bf16 hidden states with NaN payloads): the same, every draft row
    and buffer compared as raw bytes."""
    _run_machine(SpecGatherMachine, EXAMPLES)


# ------------------------------------------------------------------ the mutation check
class _BrokenMixed(GatherModel):
    """A MIXED batch's running rows keep the host's ids (not gathered)."""

    def resolve_gather(self, c: Call) -> Expect:
        got = super().resolve_gather(c)
        if not got.refused and c.mode == MIXED and c.prefill is not None:
            got.out["ids"] = [*c.prefill, *c.filler]
        return got


class _LaxTokenSlots(GatherModel):
    """Token slots on a batch that is not MIXED taken as good input."""

    def refusal(self, c: Call) -> Expect | None:
        if c.mode in (EXTEND, IDLE) and c.slots_given:
            c = Call(**{**c.__dict__, "slots_given": False, "running": []})
        return super().refusal(c)


class _NoDraftPoison(GatherModel):
    """A spec resolve that does not poison the verified ids it read."""

    def resolve_gather(self, c: Call) -> Expect:
        vid = dict(self.vid)
        got = super().resolve_gather(c)
        self.vid.update({s: vid[s] for s in got.poisoned_draft})
        return got


class _CanonicalNaN(GatherModel):
    """bf16 hidden states stored with every NaN made the canonical quiet NaN (what a float
    scatter on XLA:CPU does): NaN payloads not kept bit for bit."""

    def stash_draft(self, slots: list[int], d: Draft, fault: str | None) -> Expect:
        nan = ((d.hidden & 0x7F80) == 0x7F80) & ((d.hidden & 0x7F) != 0)
        hidden = np.where(nan, (d.hidden & 0x8000) | 0x7FC0, d.hidden).astype(np.uint16)
        return super().stash_draft(slots, Draft(**{**d.__dict__, "hidden": hidden}), fault)


@pytest.mark.parametrize(
    ("broken", "spec", "faults"),
    [
        (_BrokenMixed, False, RESOLVE_FAULTS),
        (_LaxTokenSlots, False, [None, "ts_not_mixed"]),  # a rare fault: drawn often here
        (_NoDraftPoison, True, RESOLVE_FAULTS),
        (_CanonicalNaN, True, RESOLVE_FAULTS),
    ],
)
def test_the_machine_fails_on_a_broken_model(
    broken: type[GatherModel], spec: bool, faults: list[str | None]
) -> None:
    """The machine is not blind: with one rule of the model broken it fails (no shrinking:
    the first failure is enough)."""

    class Broken(GatherMachine):
        SPEC = spec
        FAULTS = faults

        def __init__(self) -> None:
            super().__init__()
            self.models = [broken(spec=spec)]

    with pytest.raises(Exception):  # noqa: B017  # an assertion, or a refusal not expected
        _run_machine(Broken, 400, phases=[Phase.generate])


# -------------------------------------------------------------------- the 2-rank mesh
def _f2_repro() -> dict[str, Any]:
    """Finding F2 on a 2-rank mesh: rank 0 MIXED without token slots, rank 1 with them."""
    fm = _class_map(False, 2)
    fm.check()
    fm.publish({0: a([3]), 1: a([3])}, {0: a([4]), 1: a([4])})
    fm.stash({0: a([3]), 1: a([3])}, {0: a([30]), 1: a([31])})
    mixed = fj.ForwardMode.MIXED
    batches = {
        0: fj.Batch(mixed, a([2, 3]), a([7, 0]), a([1, 4])),
        1: fj.Batch(mixed, a([2, 3]), a([7, 0]), a([1, 4]), token_slots=a([0, 3])),
    }
    try:
        r = fm.resolve(batches)
        fm.check()
        ids = {d: v.tolist()[:2] for d, v in fj.per_rank(r.input_ids, fm.layout).items()}
        jax_said = f"accepted, ids per rank {ids}, no debug report"
    except (fj.FutureMapError, fj.InvariantViolation) as e:
        jax_said = f"{type(e).__name__}: {e}"
    tm = ft.FutureMap(R, dtype=torch.int32, debug=True, protocol="gather")
    try:
        tm.resolve(ft.ScheduleBatch(ft.ForwardMode.MIXED, t([2, 3]), t([7]), t([1, 4])))
        torch_said = "accepted"
    except ft.FutureMapError as e:
        torch_said = f"FutureMapError: {e}"
    return {"jax": jax_said, "torch": torch_said}


def _f3_repro() -> dict[str, Any]:
    """Finding F3: a DECODE rank with all-zero token slots, one device vs a mesh rank."""
    out = {}
    one = fj.FutureMap(R, protocol="gather", batch_buckets=(ROWS,), token_buckets=(TOKENS,))
    mesh = _class_map(False, 2)
    mesh.check()
    decode = fj.Batch(fj.ForwardMode.DECODE, a([3]), None, a([4]), token_slots=a([0]))
    extend = fj.Batch(fj.ForwardMode.EXTEND, a([2]), a([7]), a([1]))
    for name, call in (
        ("one device", lambda: one.resolve(decode)),
        ("mesh rank 0", lambda: mesh.resolve({0: decode, 1: extend})),
    ):
        try:
            call()
            out[name] = "accepted"
        except fj.FutureMapError as e:
            out[name] = f"FutureMapError: {e}"
    with contextlib.suppress(fj.InvariantViolation):
        mesh.check()
    return out


def _f4_repro() -> dict[str, Any]:
    """Finding F4: on a 2-rank spec mesh, rank 0 a spec DECODE with its draft, rank 1 a
    prefill without one (fm_torch: each rank's map takes its own batch)."""
    fm = _class_map(True, 2)
    with contextlib.suppress(fj.InvariantViolation):
        fm.check()
    fm.publish({0: a([3]), 1: a([3])}, {0: a([4]), 1: a([4])})
    batches = {
        0: fj.Batch(fj.ForwardMode.DECODE, a([3]), a([5]), a([1]), draft_indices=a([3])),
        1: fj.Batch(fj.ForwardMode.EXTEND, a([2]), a([7, 8]), a([2])),
    }
    try:
        fm.resolve(batches)
        jax_said = "accepted"
    except fj.FutureMapError as e:
        jax_said = f"FutureMapError: {e}"
    with contextlib.suppress(fj.InvariantViolation):
        fm.check()  # slot 3's draft was never stashed in this example: not the point
    tm = ft.FutureMap(R, dtype=torch.int32, spec=True, consumed=CONSUMED, protocol="gather")
    tm.stash(t(LIVE), torch_draft(_draft_arrays(init_draft(), None)))
    try:
        tm.resolve(ft.ScheduleBatch(ft.ForwardMode.EXTEND, t([2]), t([7, 8]), t([2])))
        torch_said = "accepted (rank 1's map)"
    except ft.FutureMapError as e:
        torch_said = f"FutureMapError: {e}"
    return {"jax": jax_said, "torch": torch_said}


def _f7_repro() -> dict[str, Any]:
    """Finding F7: rank 0 DECODE, rank 1 IDLE with all-zero token slots ('none, or all
    0'); fm_torch's rank maps take both."""
    fm = _class_map(False, 2)
    with contextlib.suppress(fj.InvariantViolation):
        fm.check()
    fm.publish({0: a([3])}, {0: a([4])})
    fm.stash({0: a([3])}, {0: a([30])})
    batches = {
        0: fj.Batch(fj.ForwardMode.DECODE, a([3]), None, a([4])),
        1: fj.Batch(fj.ForwardMode.IDLE, a([]), a([]), a([]), token_slots=a([])),
    }
    try:
        r = fm.resolve(batches)
        fm.check()
        jax_said = f"accepted, rank 0 ids {fj.per_rank(r.input_ids, fm.layout)[0][:1].tolist()}"
    except (fj.FutureMapError, fj.InvariantViolation) as e:
        jax_said = f"{type(e).__name__}: {e}"
    return {"jax": jax_said, "torch": "accepted (each rank's map)"}


def _mesh_child() -> None:
    """In a child with 2 virtual CPU devices: both machines on a 2-rank mesh and the
    findings' reproducers; prints one JSON report."""
    assert len(jax.devices()) >= 2, jax.devices()
    report: dict[str, Any] = {}
    for name, cls in (("nonspec", MeshGatherMachine), ("spec", MeshSpecGatherMachine)):
        try:
            _run_machine(cls, max(1, EXAMPLES // 3))
            report[name] = "ok"
        except BaseException as e:
            report[name] = "".join(traceback.format_exception(e))
    for name, fn in (("f2", _f2_repro), ("f3", _f3_repro), ("f4", _f4_repro), ("f7", _f7_repro)):
        try:
            report[name] = fn()
        except Exception:
            report[name] = {"error": traceback.format_exc()}
    print("REPORT " + json.dumps(report), flush=True)


@pytest.fixture(scope="module")
def mesh_report() -> dict[str, Any]:
    here = Path(__file__).parent
    code = (
        f"import sys; sys.path.insert(0, {str(here)!r}); "
        f"import {Path(__file__).stem} as m; m._mesh_child()"
    )
    env = dict(cpu_devices_env(2), FM_GATHER_SEED=str(SEED), FM_GATHER_EXAMPLES=str(EXAMPLES))
    p = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=here.parent,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("REPORT ")]
    assert p.returncode == 0 and lines, f"2-device child failed:\n{p.stdout}\n{p.stderr}"
    return json.loads(lines[-1][len("REPORT ") :])  # type: ignore[no-any-return]


@pytest.mark.parametrize("variant", ["nonspec", "spec"])
def test_gather_protocol_twins_follow_the_model_on_a_two_rank_mesh(
    mesh_report: dict[str, Any], variant: str
) -> None:
    """The machine on a 2-rank mesh (fm_jax's class with per-rank mappings, each rank's
    kind drawn on its own; one fm_torch map per rank)."""
    assert mesh_report[variant] == "ok", mesh_report[variant]


# ------------------------------------------------------------------------ the findings
def _primed_spec_twins() -> tuple[fj.FutureMap, ft.FutureMap]:
    """A spec map of each twin whose live slots hold the first draft and lengths 4..7."""
    jm = fj.FutureMap(
        R, spec=SPEC, protocol="gather", debug=True, batch_buckets=(ROWS,), token_buckets=(TOKENS,)
    )
    tm = ft.FutureMap(
        R, dtype=torch.int32, spec=True, debug=True, consumed=CONSUMED, protocol="gather"
    )
    arrays = _draft_arrays(init_draft(), None)
    lens = [s + 3 for s in LIVE]
    jm.publish(a(LIVE), a(lens))
    jm.stash(a(LIVE), jax_draft(arrays))
    tm.publish(t(LIVE), t(lens))
    tm.stash(t(LIVE), torch_draft(arrays))
    return jm, tm


def _both_resolve(c: Call) -> dict[str, Any]:
    """What each twin does with one spec MIXED batch: its lengths, or its refusal."""
    jm, tm = _primed_spec_twins()
    out: dict[str, Any] = {}
    try:
        out["jax"] = _ints(jm.resolve(GatherMachine.jax_batch(c)).seq_lens)[: len(c.slots)]
        jm.check()
    except (fj.FutureMapError, fj.InvariantViolation) as e:
        out["jax"] = f"{type(e).__name__}: {e}"
    tb = GatherMachine.torch_batch(c)
    try:
        tm.resolve(tb)
        out["torch"] = _ints(tb.seq_lens)
    except (ft.FutureMapError, ft.InvariantViolation) as e:
        out["torch"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.xfail(
    strict=True,
    reason="F5, by encoding: fm_jax's token slots cannot name a padding running row (a 0 "
    "token slot is a prefill position), which fm_torch's mix_running_indices [2, 0] does",
)
def test_finding_f5_a_spec_mixed_batch_with_a_padding_running_row() -> None:
    """Rows: a prefill row (slot 3), a running row (slot 2), a padding row; fm_torch's
    mix_running_indices [2, 0] is fm_jax's token_slots [0, 2, 0] (the contract's mapping):
    the twins must do the same with it."""
    c = Call(MIXED, MIXED, [3, 2, 0], [1, 1, 1], [9], [2, 0], [0, 0], slots_given=True)
    got = _both_resolve(c)
    assert isinstance(got["jax"], str) == isinstance(got["torch"], str), got
    assert isinstance(got["jax"], str) or got["jax"] == got["torch"], got


def test_finding_f6_a_spec_mixed_batch_with_padding_between_its_rows() -> None:
    """Rows: a prefill row (slot 3), a padding row, the running row (slot 1, published 4):
    the last live row is the running slot, so the batch is taken; the contract binds the
    running row's length to 4 + 1. Both twins bind the row after the prefill rows instead
    (the padding row) and leave the running row the host's 1."""
    c = Call(MIXED, MIXED, [3, 0, 1], [1, 1, 1], [9], [1], [0], slots_given=True)
    got = _both_resolve(c)
    for who in ("jax", "torch"):
        assert isinstance(got[who], str) or got[who][2] == 4 + 1, got


def test_finding_f2_a_mesh_mixed_rank_without_token_slots(mesh_report: dict[str, Any]) -> None:
    """Finding F2: on a 2-rank mesh, a MIXED rank without token slots beside a rank with
    them was taken by fm_jax (its running rows kept the host's placeholder ids); both twins
    refuse it now."""
    f2 = mesh_report["f2"]
    assert "error" not in f2, f2
    refused = [f2[k].startswith("FutureMapError") for k in ("jax", "torch")]
    assert refused == [True, True], f2


def test_finding_f3_a_mesh_decode_rank_with_all_zero_token_slots(
    mesh_report: dict[str, Any],
) -> None:
    """Finding F3: a DECODE rank's all-zero token slots were taken on a mesh and refused on
    one device; a mesh rank is held to the one-batch rule now."""
    f3 = mesh_report["f3"]
    assert "error" not in f3, f3
    assert f3["one device"].startswith("FutureMapError"), f3  # the table's rule
    assert f3["mesh rank 0"].startswith("FutureMapError"), f3


def test_finding_f4_a_mesh_rank_without_a_draft_beside_one_with(
    mesh_report: dict[str, Any],
) -> None:
    """Finding F4: on a spec mesh, draft indices on some ranks only were refused by fm_jax;
    a rank that is not DECODE now reads padding slots beside a spec DECODE rank's draft."""
    f4 = mesh_report["f4"]
    assert "error" not in f4, f4
    assert f4["jax"] == "accepted", f4


def test_finding_f7_an_idle_rank_with_zero_token_slots_beside_a_decode_rank(
    mesh_report: dict[str, Any],
) -> None:
    """Finding F7: an IDLE rank's all-zero token slots beside DECODE ranks failed while
    tracing; the batch is taken now."""
    f7 = mesh_report["f7"]
    assert "error" not in f7, f7
    assert f7["jax"].startswith("accepted"), f7
