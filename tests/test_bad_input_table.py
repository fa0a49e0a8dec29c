"""One rule for bad input: every bad input through every entry point, judged alike.

Each row of `CASES` is one bad input to one op. It runs through every entry point that
takes that form of input (`applies`):
- `jax`: the fm_jax class on one device (numpy host rows), each call's arrays passed on
  their own;
- `step`: an engine step on one device (`FutureMap.engine_step`) whose forward is the
  identity on the relay (it publishes and stashes what it resolved) except where the
  row's bad input is what the forward returns: a batch's rows are the step's batch, a
  publish's lengths and a stash's payload the forward's `StepOutput` (judged when the
  step is traced, as jax arrays), and the step's own `inputs` (`StepInput`) its own rows;
- `mesh` and `mesh step`: the class and the engine step on a 4x2 mesh of virtual CPU
  devices (each DP rank given the same rows), in a subprocess with 8 devices, as
  tests/test_scaleout_mesh.py does;
- `ops`: fm_jax's pure ops, for what is visible when they are traced (dtypes, shapes,
  the kind of payload, a forward mode known on the host), called eagerly and under jit;
- `torch`: the fm_torch twin (CPU tensors: values checked, as fm_jax checks host rows).
Every entry point must refuse with `FutureMapError` (never a raw TypeError, ValueError or
OverflowError) whose message names the field, and leave every buffer byte-identical (an
engine step: its step count too); the maps keep working afterwards.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.experimental import checkify

import fm_jax as fj
import fm_torch as ft
from fm_bench.child import call_in_child

R = 6
K, H = 2, 3
WHERE = ("jax", "step", "mesh", "mesh step", "ops", "torch")
CLASS = ("jax", "mesh")  # the class's own calls
HOST = tuple(w for w in WHERE if w != "ops")  # host rows: only what checks values sees them
STEP = ("step", "mesh step")  # what only an engine step takes (the class takes lists)
DP, TP = 4, 2
MAP_OPS = ("publish", "stash", "resolve", "invalidate", "seq_lens")


@dataclass(frozen=True)
class Bad:
    """One bad input: `op`'s good call with `change` applied.

    Attributes:
      op: publish, stash, resolve, invalidate or seq_lens (resolve_seq_lens_cpu); an
        engine step's own: inputs (its `StepInput`s) or output (what its forward returns
        other than a StepOutput).
      field: what the refusal must name (fm_jax's field name).
      change: call arguments replaced (see `good_call`).
      spec: run on the spec maps.
      trace: visible when traced (so the pure ops refuse it too, and an engine step whose
        forward returns it).
      torch_field: fm_torch's name for the field, where it differs.
      where: the entry points that take this form of input (`applies` adds each entry
        point's own rule).
    """

    op: str
    field: str
    change: dict[str, Any] = field(default_factory=dict)
    spec: bool = False
    trace: bool = False
    torch_field: str | None = None
    where: tuple[str, ...] = WHERE


def a(*xs: Any) -> np.ndarray:
    return np.array(xs)


def i32(*xs: Any) -> np.ndarray:
    return np.array(xs, np.int32)


def bf16(*shape: int) -> np.ndarray:
    return np.ones(shape, ml_dtypes.bfloat16)


def draft(rows: int = 2, **change: Any) -> dict[str, Any]:
    d = {
        "bonus_tokens": np.arange(rows) + 10,
        "topk_p": np.full((rows, K), 0.5, np.float32),
        "topk_index": np.ones((rows, K), np.int64),
        "hidden_states": bf16(rows, H),
    }
    return {"draft": {**d, **change}}


DECODE, EXTEND = 1, 0
CASES: dict[str, Bad] = {
    # ------------------------------------------------------------------------ slots
    "indices_float": Bad("publish", "indices", {"indices": a(1.0, 2.0)}, trace=True),
    "indices_2d": Bad("publish", "indices", {"indices": a([1, 2])}, trace=True),
    "indices_str": Bad("publish", "indices", {"indices": "12"}, where=HOST),
    "indices_none": Bad("stash", "indices", {"indices": None}, where=HOST),
    "indices_objects": Bad("stash", "indices", {"indices": [1, "a"]}, where=HOST),
    "indices_slot_R": Bad("publish", "indices", {"indices": a(1, R)}),
    "indices_negative": Bad("stash", "indices", {"indices": a(-1, 2)}),
    "indices_live_twice": Bad("stash", "indices", {"indices": a(3, 3)}),
    "indices_int64_beyond_int32": Bad("stash", "indices", {"indices": a(1, 2**32 + 2)}),
    "req_pool_indices_slot_R": Bad("resolve", "req_pool_indices", {"idx": a(1, R)}),
    "req_pool_indices_live_twice": Bad("resolve", "req_pool_indices", {"idx": a(2, 2)}),
    "invalidate_slot_R": Bad("invalidate", "indices", {"indices": a(R, 1)}),
    "invalidate_float": Bad("invalidate", "indices", {"indices": a(1.0, 2.0)}, trace=True),
    "seq_lens_cpu_negative_slot": Bad("seq_lens", "indices", {"indices": a(-1, 2)}),
    "seq_lens_cpu_slot_R": Bad("seq_lens", "indices", {"indices": a(1, R)}),
    # ------------------------------------------------------------------ per-row values
    "new_seq_lens_rows": Bad("publish", "new_seq_lens", {"values": a(5)}, trace=True),
    "new_seq_lens_float": Bad("publish", "new_seq_lens", {"values": a(5.0, 6.0)}, trace=True),
    "new_seq_lens_beyond_int32": Bad("publish", "new_seq_lens", {"values": a(5, 2**31)}),
    "new_seq_lens_negative": Bad("publish", "new_seq_lens", {"values": a(5, -2)}),
    "new_seq_lens_none": Bad("publish", "new_seq_lens", {"values": None}, where=HOST),
    "tokens_negative": Bad("stash", "tokens", {"values": a(-1, 8)}),
    "tokens_negative_padding_row": Bad("stash", "tokens", {"indices": a(1, 0), "values": a(7, -5)}),
    "tokens_rows": Bad("stash", "tokens", {"values": a(7, 8, 9)}, trace=True),
    "tokens_object": Bad("stash", "tokens", {"values": a(None, None)}, where=HOST),
    "tokens_beyond_int32": Bad("stash", "tokens", {"values": a(7, -(2**31) - 1)}),
    "tokens_huge_python_ints": Bad("stash", "tokens", {"values": [2**70, 1]}, where=HOST),
    "draft_on_plain_map": Bad("stash", "DraftPayload", draft(), trace=True),
    # ------------------------------------------------------------------------ resolve
    "input_ids_float": Bad("resolve", "input_ids", {"ids": a(-1.0, -2.0)}, trace=True),
    "input_ids_2d": Bad("resolve", "input_ids", {"ids": a([-1, -2])}, trace=True),
    "input_ids_sentinel_R": Bad("resolve", "input_ids", {"ids": a(-1, -R)}),
    "input_ids_beyond_int32": Bad("resolve", "input_ids", {"ids": a(-1, -(2**32) + 2)}),
    "decode_ids_longer_than_batch": Bad("resolve", "input_ids", {"ids": a(-1, -2, 5)}),
    "extend_seq_lens_rows": Bad(
        "resolve", "seq_lens", {"mode": EXTEND, "ids": a(4, 5), "lens": a(3)}, trace=True
    ),
    "extend_seq_lens_float": Bad(
        "resolve", "seq_lens", {"mode": EXTEND, "ids": a(4, 5), "lens": a(3.0, 3.0)}, trace=True
    ),
    "extend_seq_lens_beyond_int32": Bad(
        "resolve", "seq_lens", {"mode": EXTEND, "ids": a(4, 5), "lens": a(3, 2**31)}
    ),
    "draft_indices_on_plain_map": Bad("resolve", "draft", {"draft_indices": a(1, 2)}, trace=True),
    "mode_unknown": Bad("resolve", "forward_mode", {"mode": 7}, trace=True),
    "mode_negative": Bad("resolve", "forward_mode", {"mode": -1}, trace=True),
    "mode_bool": Bad("resolve", "forward_mode", {"mode": True}, trace=True),
    "mode_float": Bad("resolve", "forward_mode", {"mode": 1.0}, trace=True),
    "mode_str": Bad("resolve", "forward_mode", {"mode": "DECODE"}, trace=True),
    "mode_none": Bad("resolve", "forward_mode", {"mode": None}, trace=True),
    "mode_huge": Bad("resolve", "forward_mode", {"mode": 2**70}, trace=True),
    # ------------------------------------------------------------------------- spec
    "tokens_on_spec_map": Bad(
        "stash", "DraftPayload", {"draft": None, "values": a(7, 8)}, spec=True, trace=True
    ),
    "tuple_draft": Bad("stash", "DraftPayload", {"tuple_draft": True}, spec=True, trace=True),
    "topk_p_wrong_k": Bad(
        "stash", "topk_p", draft(topk_p=np.zeros((2, K + 1), np.float32)), spec=True, trace=True
    ),
    "topk_p_float64": Bad("stash", "topk_p", draft(topk_p=np.zeros((2, K))), spec=True, trace=True),
    "topk_p_rows": Bad(
        "stash", "topk_p", draft(topk_p=np.zeros((3, K), np.float32)), spec=True, trace=True
    ),
    "topk_index_float": Bad(
        "stash",
        "topk_index",
        draft(topk_index=np.zeros((2, K), np.float32)),
        spec=True,
        trace=True,
    ),
    "topk_index_beyond_int32": Bad(
        "stash", "topk_index", draft(topk_index=np.full((2, K), 2**31)), spec=True
    ),
    "hidden_wrong_dtype": Bad(
        "stash",
        "hidden_states",
        draft(hidden_states=np.zeros((2, H), np.float32)),
        spec=True,
        trace=True,
    ),
    "hidden_wrong_width": Bad(
        "stash", "hidden_states", draft(hidden_states=bf16(2, H + 1)), spec=True, trace=True
    ),
    "bonus_missing": Bad("stash", "bonus_tokens", draft(bonus_tokens=None), spec=True, trace=True),
    "topk_index_missing": Bad("stash", "topk_index", draft(topk_index=None), spec=True, trace=True),
    "bonus_rows": Bad(
        "stash", "bonus_tokens", draft(bonus_tokens=a(1, 2, 3)), spec=True, trace=True
    ),
    "bonus_negative": Bad("stash", "bonus_tokens", draft(bonus_tokens=a(3, -1)), spec=True),
    "bonus_object": Bad(
        "stash",
        "bonus_tokens",
        draft(bonus_tokens=a(None, None)),
        spec=True,
        where=HOST,
    ),
    "draft_indices_slot_R": Bad(
        "resolve",
        "draft_indices",
        {"draft_indices": a(1, R)},
        spec=True,
        torch_field="draft.indices",
    ),
    "draft_indices_float": Bad(
        "resolve",
        "draft_indices",
        {"draft_indices": a(1.0, 2.0)},
        spec=True,
        trace=True,
        torch_field="draft.indices",
    ),
    "spec_sentinel_R": Bad("resolve", "input_ids", {"ids": a(-1, -R)}, spec=True),
    "spec_mode_unknown": Bad("resolve", "forward_mode", {"mode": 9}, spec=True, trace=True),
    # ------------------------------------------------------------ rows with no rows
    "new_seq_lens_0d": Bad("publish", "new_seq_lens", {"values": np.array(5)}, trace=True),
    "tokens_0d": Bad("stash", "tokens", {"values": np.array(7)}, trace=True),
    "topk_p_0d": Bad("stash", "topk_p", draft(topk_p=np.float32(0.5)), spec=True, trace=True),
    "extras_list": Bad("stash", "draft.extras", draft(extras=[bf16(2, H)]), spec=True, trace=True),
    # ----------------------------------------- what an engine's forward returns (step)
    "step_lens_list": Bad("publish", "new_seq_lens", {"values": [5, 6]}, trace=True, where=STEP),
    "step_lens_int": Bad("publish", "new_seq_lens", {"values": 5}, trace=True, where=STEP),
    "step_tokens_list": Bad("stash", "tokens", {"values": [7, 8]}, trace=True, where=STEP),
    "step_tokens_int": Bad("stash", "tokens", {"values": 7}, trace=True, where=STEP),
    "step_tokens_none": Bad("stash", "tokens", {"values": None}, trace=True, where=STEP),
    "step_bonus_list": Bad(
        "stash", "bonus_tokens", draft(bonus_tokens=[10, 11]), spec=True, trace=True, where=STEP
    ),
    "step_hidden_float": Bad(
        "stash", "hidden_states", draft(hidden_states=1.0), spec=True, trace=True, where=STEP
    ),
    "step_output_tuple": Bad("output", "StepOutput", trace=True, where=STEP),
    # ------------------------------------------------- an engine step's own inputs
    "input_float": Bad("inputs", "pos", {"inputs": {"pos": a(0.5, 1.0)}}, where=STEP),
    "input_int64_beyond_int32": Bad("inputs", "pos", {"inputs": {"pos": a(0, 2**40)}}, where=STEP),
    "input_missing": Bad("inputs", "pos", {"inputs": {}}, where=STEP),
    "input_undeclared": Bad(
        "inputs", "temp", {"inputs": {"pos": i32(0, 1), "temp": i32(0, 1)}}, where=STEP
    ),
    "input_rows": Bad("inputs", "pos", {"inputs": {"pos": i32(0, 1, 2)}}, where=STEP),
    "input_row_shape": Bad(
        "inputs", "pos", {"inputs": {"pos": np.zeros((2, 3), np.int32)}}, where=STEP
    ),
    "input_0d": Bad("inputs", "pos", {"inputs": {"pos": np.array(0, np.int32)}}, where=STEP),
    "input_object": Bad("inputs", "pos", {"inputs": {"pos": a(None, None)}}, where=STEP),
    "input_str": Bad("inputs", "pos", {"inputs": {"pos": "01"}}, where=STEP),
    "input_jax_rows": Bad(
        "inputs", "pos", {"inputs": {"pos": jnp.zeros(3, jnp.int32)}}, where=("step",)
    ),
    "inputs_not_a_mapping": Bad("inputs", "inputs", {"inputs": [i32(0, 1)]}, where=STEP),
    # ---------------------------------------------- per-rank mappings (fm_jax only)
    "rank_key_float": Bad("stash", "DP rank", {"by_rank": 1.0}, where=CLASS),
    "rank_key_bool": Bad("stash", "DP rank", {"by_rank": True}, where=CLASS),
    "rank_key_str": Bad("stash", "DP rank", {"by_rank": "1"}, where=CLASS),
    "rank_key_foreign": Bad("stash", "DP rank", {"by_rank": DP}, where=CLASS),
}


# ------------------------------------------------------------------------- the calls
def good_call(case: Bad) -> dict[str, Any]:
    """The good call of `case.op` (rank-local host rows), with the case's changes."""
    base: dict[str, Any] = {
        "mode": DECODE,
        "indices": a(1, 2),
        "values": a(5, 6) if case.op == "publish" else a(7, 8),
        "idx": a(1, 2),
        "ids": a(-1, -2),
        "lens": a(-1, -2),
        "draft_indices": a(1, 2) if case.spec else None,
        "inputs": {"pos": i32(0, 1)},
    }
    if case.op == "stash" and case.spec:
        base.update(draft())
    return {**base, **case.change}


def tile(x: Any, n: int) -> Any:
    """`x` laid out for `n` DP ranks: each rank given the same rows."""
    if isinstance(x, np.ndarray) and x.ndim >= 1:
        return np.concatenate([x] * n)
    if isinstance(x, dict):
        return {k: tile(v, n) for k, v in x.items()}
    return x


def reaches_step(case: Bad) -> bool:
    """Whether an engine step takes the case's bad input: a batch's rows (the step's
    batch), its own inputs, or what its forward returns (publish's lengths, stash's
    payload, another output), seen when traced, as jax arrays (`staged_applies`)."""
    if case.op in ("resolve", "inputs"):
        return True
    if case.op in ("publish", "stash", "invalidate") and set(case.change) == {"indices"}:
        return True  # a step's slots are its batch's
    returned = set(case.change) <= {"values", "draft", "tuple_draft"}
    return case.op in ("publish", "stash", "output") and case.trace and returned


def field(case: Bad, where: str) -> str:
    """What the refusal through `where` must name: an engine step's slots are its batch's
    `req_pool_indices`."""
    if where in ("step", "mesh step") and case.field == "indices":
        return "req_pool_indices"
    return case.field


def applies(case: Bad, where: str) -> bool:
    """Whether the entry point `where` takes the case: named by the case, and within
    the entry point's reach (the pure ops: what tracing sees; an engine step:
    `reaches_step`; the others: the map's own ops)."""
    if where not in case.where:
        return False
    if where in ("step", "mesh step"):
        return reaches_step(case) and staged_applies(case)
    return case.op in MAP_OPS and (case.trace or where != "ops")


def cases(where: str) -> list[str]:
    """The cases the entry point `where` takes."""
    return [k for k, c in CASES.items() if applies(c, where)]


def call_jax(fm: Any, case: Bad, n: int = 1) -> Any:
    """Run `case` on an fm_jax FutureMap (`n` DP ranks, given global rows)."""
    c = {k: tile(v, n) for k, v in good_call(case).items()}
    if "by_rank" in c:
        return fm.stash({c["by_rank"]: a(1, 2)}, {c["by_rank"]: a(7, 8)})
    payload: Any = c["values"]
    if c.get("draft") is not None:
        payload = fj.DraftPayload(**c["draft"])
    if c.get("tuple_draft"):
        payload = tuple(fj.DraftPayload(**tile(draft()["draft"], n)))
    batch = fj.Batch(c["mode"], c["idx"], c["ids"], c["lens"], c["draft_indices"])
    return {
        "publish": lambda: fm.publish(c["indices"], c["values"]),
        "stash": lambda: fm.stash(c["indices"], payload),
        "resolve": lambda: fm.resolve(batch),
        "invalidate": lambda: fm.invalidate(batch, c["indices"]),
        "seq_lens": lambda: fm.resolve_seq_lens_cpu(c["indices"]),
    }[case.op]()


POS = fj.StepInput("pos", "row")
"""The engine step's own per-row input."""


def relay_forward(case: Bad, out: dict[str, Any]) -> Any:
    """An engine's forward that is the identity on the relay (it publishes and stashes
    what it resolved) but returns `case`'s bad lengths or payload (`out`, as jax arrays)
    in their place, or a tuple for a case of another output."""

    def forward(res: fj.Resolved, batch: fj.Batch, inputs: dict[str, Any]) -> Any:
        lens = out.get("lens", res.seq_lens)
        payload = out.get("payload", res.draft if case.spec else res.input_ids)
        got = fj.StepOutput(lens, payload, inputs["pos"])
        return tuple(got) if case.op == "output" else got

    return forward


_GOOD_STEPS: dict[Any, Any] = {}
"""Each map's engine step with the identity forward (by map; compiled once per map)."""


def call_step(fm: Any, case: Bad, n: int = 1) -> Any:
    """Run `case` through an engine step of `fm` (`n` DP ranks, given global rows)."""
    c = {k: tile(v, n) for k, v in good_call(case).items()}
    rows = {k: tile(v, n) for k, v in good_call(Bad("resolve", "", spec=case.spec)).items()}
    if case.op == "resolve":
        rows = c
    elif "indices" in case.change:  # the step's slots
        rows["idx"] = c["indices"]
    batch = fj.Batch(rows["mode"], rows["idx"], rows["ids"], rows["lens"], rows["draft_indices"])
    out: dict[str, Any] = {}
    if case.op == "publish":
        out["lens"] = staged(c["values"])
    elif case.op == "stash":
        out["payload"] = staged_payload(c, n)
    if out or case.op == "output":
        step = fm.engine_step(relay_forward(case, out), inputs=[POS])
    else:  # the good forward: one step per map, compiled once
        step = _GOOD_STEPS.get(fm)
        if step is None:
            step = _GOOD_STEPS[fm] = fm.engine_step(relay_forward(case, {}), inputs=[POS])
    return step(batch, inputs=c["inputs"])


def staged(x: Any) -> Any:
    """A host array as a jax array (what a jitted function holds); anything else as is."""
    if not isinstance(x, np.ndarray) or x.dtype == object:
        return x
    return jnp.asarray(x)


def staged_payload(c: dict[str, Any], n: int) -> Any:
    """Stash's payload of the call `c` (tokens, a DraftPayload, a tuple), staged."""
    if c.get("tuple_draft"):
        return tuple(staged(v) for v in tile(draft()["draft"], n).values())
    if c.get("draft") is not None:
        d = c["draft"]
        extras = d.get("extras")
        if isinstance(extras, dict):
            extras = {k: staged(v) for k, v in extras.items()}
        return fj.DraftPayload(**{**{k: staged(v) for k, v in d.items()}, "extras": extras})
    return staged(c["values"])


def call_ops(ops: Any, state: Any, case: Bad, jit: bool) -> Any:
    """Run `case` on fm_jax's pure ops (`ops` single-pool or sharded), eagerly or jitted."""
    n = getattr(getattr(ops, "layout", None), "dp", 1)
    c = {k: tile(v, n) for k, v in good_call(case).items()}

    def conv(x: Any) -> Any:
        """Under jit, arrays as jax arrays (an engine's jitted step holds nothing else)."""
        return staged(x) if jit else x

    payload: Any = staged_payload(c, n) if jit else c["values"]
    if not jit and c.get("draft") is not None:
        payload = fj.DraftPayload(**c["draft"])
    if not jit and c.get("tuple_draft"):
        payload = tuple(tile(draft()["draft"], n).values())
    mode = c["mode"]
    if jit and isinstance(mode, int | float) and not isinstance(mode, bool):
        mode = jnp.asarray(mode)  # a traced mode, as an engine's jitted step holds it
    fields = (conv(c[k]) for k in ("idx", "ids", "lens", "draft_indices"))
    batch = fj.Batch(mode, *fields)
    fn = {
        "publish": lambda s, i, v: ops.publish(s, i, v),
        "stash": lambda s, i, v: ops.stash(s, i, v),
        "resolve": lambda s, i, v: ops.resolve(s, batch),
        "invalidate": lambda s, i, v: ops.invalidate(batch, i),
        "seq_lens": lambda s, i, v: ops.seq_lens_at(s, i),
    }[case.op]
    values = payload if case.op == "stash" else conv(c["values"])
    if jit:
        checked = checkify.checkify(fn, errors=checkify.user_checks)
        return jax.jit(checked)(state, conv(c["indices"]), values)
    return fn(state, c["indices"], values)


def staged_applies(case: Bad) -> bool:
    """Whether the case is visible to an op staged by jit or shard_map: a float64 array
    arrives as float32 (JAX without x64 places it so; the op never sees float64)."""
    d = case.change.get("draft") or {}
    return not any(isinstance(v, np.ndarray) and v.dtype == np.float64 for v in d.values())


def jit_applies(case: Bad) -> bool:
    """Whether jit leaves the case visible when traced: as staged, and a host int mode is
    made a jax value (as an engine's jitted step holds it) whose value is checked in debug
    mode, not refused when traced."""
    mode = case.change.get("mode")
    traced_value = isinstance(mode, int) and not isinstance(mode, bool)
    return staged_applies(case) and not (case.field == "forward_mode" and traced_value)


def jax_buffers(fm: Any) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in fm.buffers().items()}


def jax_outcome(fm: Any, case: Bad, where: str, n: int = 1) -> dict[str, Any]:
    """What `case` did through the fm_jax entry point `where`: the refusal, and whether
    the buffers and the step count held."""
    before, state, step = jax_buffers(fm), fm.state, fm.step
    try:
        CALLS[where](fm, case, n)
    except Exception as e:  # noqa: BLE001  # the test judges the type
        kind, msg = type(e).__name__, str(e)
        refused = isinstance(e, fj.FutureMapError)
    else:
        kind, msg, refused = "accepted", "", False
    intact = (
        fm.state is state
        and fm.step == step
        and not any(b.is_deleted() for b in fm.buffers().values())
        and jax_buffers(fm) == before
    )
    return {"kind": kind, "message": msg, "refused": refused, "intact": intact}


CALLS = {"jax": call_jax, "mesh": call_jax, "step": call_step}
CALLS["mesh step"] = call_step


def good_case(case: Bad, where: str) -> Bad:
    """The good call that shows the map still works after `case` through `where`: the
    op's own, or for an engine step a step with the identity forward."""
    op = "resolve" if where in ("step", "mesh step") else case.op
    return Bad(op, "", spec=case.spec)


def make_jax_map(spec: bool, mesh: Any = None) -> Any:
    """An fm_jax map with distinct values in every buffer (the spec extras of one draft)."""
    cfg = fj.SpecConfig(K, H, jnp.dtype(jnp.bfloat16)) if spec else None
    kw = {} if mesh is None else {"mesh": mesh, "dp_axis": "dp", "tp_axis": "tp"}
    fm = fj.FutureMap(R, spec=cfg, batch_buckets=(2, 4), token_buckets=(2, 4), **kw)
    n = fm.layout.dp
    fm.publish(tile(a(1, 2, 3, 4), n), tile(a(11, 12, 13, 14), n))
    if spec:
        d = fj.DraftPayload(**tile(draft(4)["draft"], n))
        fm.stash(tile(a(1, 2, 3, 4), n), d)
    else:
        fm.stash(tile(a(1, 2, 3, 4), n), tile(a(21, 22, 23, 24), n))
    return fm


# ------------------------------------------------------------------- fm_jax, one device
ONE_DEVICE = ("jax", "step")


@pytest.fixture(scope="module")
def jax_maps() -> dict[tuple[str, bool], Any]:
    """A map per one-device entry point and spec."""
    return {(w, spec): make_jax_map(spec) for w in ONE_DEVICE for spec in (False, True)}


@pytest.mark.parametrize(("where", "name"), [(w, k) for w in ONE_DEVICE for k in cases(w)])
def test_fm_jax_class_refuses_and_keeps_every_byte(
    jax_maps: dict[tuple[str, bool], Any], where: str, name: str
) -> None:
    """Pins a bad input that the one-device class or its engine
    step takes (writing or casting silently), or refuses with a raw error, a message that
    does not name the field, or after a write."""
    case = CASES[name]
    fm = jax_maps[where, case.spec]
    got = jax_outcome(fm, case, where)
    assert got["refused"], got
    assert field(case, where) in got["message"], got
    assert got["intact"], got
    # the map keeps working: the op's good call goes through
    CALLS[where](fm, good_case(case, where))


# --------------------------------------------------------------------- fm_jax pure ops
@pytest.fixture(scope="module")
def pure_ops() -> dict[bool, Any]:
    out = {}
    for spec in (False, True):
        cfg = fj.SpecConfig(K, H, jnp.dtype(jnp.bfloat16)) if spec else None
        ops = fj.future_map(R, spec=cfg, debug=True)
        out[spec] = (ops, ops.init())
    return out


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", cases("ops"))
def test_pure_ops_refuse_what_tracing_sees(pure_ops: dict[bool, Any], name: str, jit: bool) -> None:
    """Pins a pure op taking a bad dtype, shape, payload kind or host mode when traced
    (silently cast, or failing later with a raw error): the engine that inlines the ops
    gets the same refusal as the class."""
    case = CASES[name]
    if jit and not jit_applies(case):
        pytest.skip("jit makes the bad value a jax value: checked in debug mode, or cast")
    ops, state = pure_ops[case.spec]
    before = [np.asarray(x).tobytes() for x in state if x is not None]
    with pytest.raises(fj.FutureMapError, match=case.field):
        call_ops(ops, state, case, jit)
    assert [np.asarray(x).tobytes() for x in state if x is not None] == before


# -------------------------------------------------------------------------- fm_torch
def to_torch(x: Any) -> Any:
    """A numeric host array as a CPU tensor (bf16 through its bits); anything else as is."""
    if not isinstance(x, np.ndarray):
        return x
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    if x.dtype.kind in "biuf":
        return torch.from_numpy(x.copy())
    return x  # object dtype: no tensor holds it


def call_torch(fm: Any, case: Bad) -> Any:
    c = {k: to_torch(v) for k, v in good_call(case).items() if k != "draft"}
    payload: Any = c["values"]
    if good_call(case).get("draft") is not None:
        d = {k: to_torch(v) for k, v in good_call(case)["draft"].items()}
        payload = ft.DraftPayload(**d)
    if c.get("tuple_draft"):
        payload = tuple(to_torch(v) for v in draft()["draft"].values())
    di = c["draft_indices"]
    batch = ft.ScheduleBatch(
        c["mode"], c["idx"], c["ids"], c["lens"], None if di is None else ft.DraftInput(di)
    )
    return batch, {
        "publish": lambda: fm.publish(c["indices"], c["values"]),
        "stash": lambda: fm.stash(c["indices"], payload),
        "resolve": lambda: fm.resolve(batch),
        "invalidate": lambda: fm.invalidate(batch, c["indices"]),
        "seq_lens": lambda: fm.resolve_seq_lens_cpu(c["indices"]),
    }[case.op]


def torch_bytes(fm: Any, batch: Any) -> list[Any]:
    """Every buffer of `fm` and every field of `batch`, tensors as dtype and raw bytes."""

    def raw(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return repr(x)
        return str(x.dtype), x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    bufs = [fm.output_tokens, fm.new_seq_lens, fm.topk_p, fm.topk_index, fm.hidden_states]
    fields = [batch.forward_mode, batch.req_pool_indices, batch.input_ids, batch.seq_lens]
    return [raw(b) for b in bufs] + [raw(f) for f in fields]


@pytest.fixture(scope="module")
def torch_maps() -> dict[bool, Any]:
    out = {}
    for spec in (False, True):
        fm = ft.FutureMap(R, dtype=torch.int32, spec=spec)
        fm.publish(torch.tensor([1, 2, 3, 4]), torch.tensor([11, 12, 13, 14]))
        if spec:
            fm.stash(
                torch.tensor([1, 2, 3, 4]),
                ft.DraftPayload(**{k: to_torch(v) for k, v in draft(4)["draft"].items()}),
            )
        else:
            fm.stash(torch.tensor([1, 2, 3, 4]), torch.tensor([21, 22, 23, 24]))
        out[spec] = fm
    return out


@pytest.mark.parametrize("name", cases("torch"))
def test_fm_torch_refuses_and_keeps_every_byte(torch_maps: dict[bool, Any], name: str) -> None:
    """Pins fm_torch judging an input otherwise than fm_jax (taking what fm_jax refuses,
    or refusing with a raw error or after a write)."""
    case = CASES[name]
    fm = torch_maps[case.spec]
    batch, call = call_torch(fm, case)
    before = torch_bytes(fm, batch)
    with pytest.raises(ft.FutureMapError, match=case.torch_field or case.field):
        call()
    assert torch_bytes(fm, batch) == before
    _, good = call_torch(fm, Bad(case.op, "", spec=case.spec))
    good()  # the map keeps working


# --------------------------------------------------- fm_jax on a 4x2 mesh (subprocess)
MESH = ("mesh", "mesh step")


def _inner() -> dict[str, Any]:
    """In a process with 8 CPU devices: every case on a 4x2 mesh map and its engine step,
    and the trace-time cases on the sharded pure ops; one JSON-able report."""
    assert len(jax.devices()) == DP * TP, jax.devices()
    mesh = jax.make_mesh((DP, TP), ("dp", "tp"))  # Explicit axes, jax.make_mesh's default
    report: dict[str, Any] = {"ops": {}}
    for where in MESH:
        maps = {spec: make_jax_map(spec, mesh) for spec in (False, True)}
        report[where] = {}
        for name in cases(where):
            case = CASES[name]
            try:
                got = jax_outcome(maps[case.spec], case, where, DP)
                CALLS[where](maps[case.spec], good_case(case, where), DP)  # still works
            except Exception:  # noqa: BLE001  # reported to the test
                got = {"error": traceback.format_exc()}
            report[where][name] = got
    sharded = {}
    for spec in (False, True):
        cfg = fj.SpecConfig(K, H, jnp.dtype(jnp.bfloat16)) if spec else None
        ops = fj.future_map(R, mesh=mesh, dp_axis="dp", tp_axis="tp", spec=cfg, debug=True)
        sharded[spec] = (ops, ops.init())
    for name in cases("ops"):
        case = CASES[name]
        for jit in (False, True):
            if not (jit_applies(case) if jit else staged_applies(case)):
                continue
            try:
                call_ops(*sharded[case.spec], case, jit=jit)
                got = {"kind": "accepted", "message": ""}
            except Exception as e:  # noqa: BLE001  # the test judges the type
                got = {"kind": type(e).__name__, "message": str(e)}
                got["refused"] = isinstance(e, fj.FutureMapError)
            report["ops"][f"{name}-{'jit' if jit else 'eager'}"] = got
    # A traced per-rank mode that is no ForwardMode is run as 'not DECODE' and, in debug
    # mode, reported for its rank (all rows padding: nothing else to report).
    debug = fj.FutureMap(R, mesh=mesh, dp_axis="dp", tp_axis="tp", debug=True)
    rows = tile(a(0, 0), DP)
    debug.resolve(fj.Batch(jnp.asarray(np.array([1, 7, -1, 0], np.int32)), rows, rows, rows))
    try:
        debug.check()
        report["modes"] = []
    except fj.InvariantViolation as e:
        report["modes"] = [[v.rank, v.invariant] for v in e.violations]
    return report


@pytest.fixture(scope="module")
def mesh_report() -> dict[str, Any]:
    # Imported here: the child runs this file without tests/ on its path.
    from host_devices import cpu_devices_env

    env = cpu_devices_env(8)
    return call_in_child(__file__, "_inner", env, timeout=600)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("where", "name"), [(w, k) for w in MESH for k in cases(w)])
def test_fm_jax_mesh_refuses_and_keeps_every_byte(
    mesh_report: dict[str, Any], where: str, name: str
) -> None:
    """Pins the mesh map or its engine step judging an input otherwise than the one-device
    map (a float64 topk_p cast, a rank key 1.0 or True taken as rank 1, a draft ignored)."""
    case = CASES[name]
    got = mesh_report[where][name]
    assert "error" not in got, got.get("error")
    assert got["refused"], got
    assert field(case, where) in got["message"], got
    assert got["intact"], got


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", cases("ops"))
def test_sharded_pure_ops_refuse_what_tracing_sees(
    mesh_report: dict[str, Any], name: str, jit: bool
) -> None:
    """Pins the sharded pure ops taking a bad dtype, shape, payload kind or host mode that
    the single-pool ops refuse when traced (a string or None mode reaching jnp first)."""
    case = CASES[name]
    if not (jit_applies(case) if jit else staged_applies(case)):
        pytest.skip("staging makes the bad value a jax value: checked in debug mode, or cast")
    got = mesh_report["ops"][f"{name}-{'jit' if jit else 'eager'}"]
    assert got.get("refused"), got
    assert case.field in got["message"], got


def test_traced_per_rank_modes_that_are_no_forward_mode_are_reported_per_rank(
    mesh_report: dict[str, Any],
) -> None:
    """Pins per-rank traced modes 7 and -1 on a mesh passing as 'not DECODE' unreported:
    in debug mode each such rank is reported, naming the rank."""
    assert mesh_report["modes"] == [[1, "forward mode"], [2, "forward mode"]]
