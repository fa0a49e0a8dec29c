"""One rule for bad input: every bad input through every entry point, judged alike.

Each row of `CASES` is one bad input to one op. It runs through every entry point that
takes that form of input:
- `jax`: the fm_jax class on one device (numpy host rows);
- `mesh`: the fm_jax class on a 4x2 mesh of virtual CPU devices (each DP rank given the
  same rows), in a subprocess with 8 devices, as tests/test_scaleout_mesh.py does;
- `ops`: fm_jax's pure ops, for what is visible when they are traced (dtypes, shapes,
  the kind of payload, a forward mode known on the host), called eagerly and under jit;
- `torch`: the fm_torch twin (CPU tensors: values checked, as fm_jax checks host rows).
Every entry point must refuse with `FutureMapError` (never a raw TypeError, ValueError or
OverflowError) whose message names the field, and leave every buffer byte-identical; the
two maps keep working afterwards.
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
WHERE = ("jax", "mesh", "ops", "torch")
DP, TP = 4, 2


@dataclass(frozen=True)
class Bad:
    """One bad input: `op`'s good call with `change` applied.

    Attributes:
      op: publish, stash, resolve, invalidate or seq_lens (resolve_seq_lens_cpu).
      field: what the refusal must name (fm_jax's field name).
      change: call arguments replaced (see `good_call`).
      spec: run on the spec maps.
      trace: visible when the pure ops are traced (so `ops` refuses it too).
      torch_field: fm_torch's name for the field, where it differs.
      where: the entry points that take this form of input.
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
    "indices_str": Bad("publish", "indices", {"indices": "12"}, where=("jax", "mesh", "torch")),
    "indices_none": Bad("stash", "indices", {"indices": None}, where=("jax", "mesh", "torch")),
    "indices_objects": Bad(
        "stash", "indices", {"indices": [1, "a"]}, where=("jax", "mesh", "torch")
    ),
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
    "new_seq_lens_none": Bad(
        "publish", "new_seq_lens", {"values": None}, where=("jax", "mesh", "torch")
    ),
    "tokens_negative": Bad("stash", "tokens", {"values": a(-1, 8)}),
    "tokens_negative_padding_row": Bad("stash", "tokens", {"indices": a(1, 0), "values": a(7, -5)}),
    "tokens_rows": Bad("stash", "tokens", {"values": a(7, 8, 9)}, trace=True),
    "tokens_object": Bad(
        "stash", "tokens", {"values": a(None, None)}, where=("jax", "mesh", "torch")
    ),
    "tokens_beyond_int32": Bad("stash", "tokens", {"values": a(7, -(2**31) - 1)}),
    "tokens_huge_python_ints": Bad(
        "stash", "tokens", {"values": [2**70, 1]}, where=("jax", "mesh", "torch")
    ),
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
    "hidden_missing": Bad(
        "stash", "hidden_states", draft(hidden_states=None), spec=True, trace=True
    ),
    "bonus_rows": Bad(
        "stash", "bonus_tokens", draft(bonus_tokens=a(1, 2, 3)), spec=True, trace=True
    ),
    "bonus_negative": Bad("stash", "bonus_tokens", draft(bonus_tokens=a(3, -1)), spec=True),
    "bonus_object": Bad(
        "stash",
        "bonus_tokens",
        draft(bonus_tokens=a(None, None)),
        spec=True,
        where=("jax", "mesh", "torch"),
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
    # ---------------------------------------------- per-rank mappings (fm_jax only)
    "rank_key_float": Bad("stash", "DP rank", {"by_rank": 1.0}, where=("jax", "mesh")),
    "rank_key_bool": Bad("stash", "DP rank", {"by_rank": True}, where=("jax", "mesh")),
    "rank_key_str": Bad("stash", "DP rank", {"by_rank": "1"}, where=("jax", "mesh")),
    "rank_key_foreign": Bad("stash", "DP rank", {"by_rank": DP}, where=("jax", "mesh")),
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


def call_ops(ops: Any, state: Any, case: Bad, jit: bool) -> Any:
    """Run `case` on fm_jax's pure ops (`ops` single-pool or sharded), eagerly or jitted."""
    n = getattr(getattr(ops, "layout", None), "dp", 1)
    c = {k: tile(v, n) for k, v in good_call(case).items()}

    def conv(x: Any) -> Any:
        """Under jit, arrays as jax arrays (an engine's jitted step holds nothing else)."""
        if not jit or x is None or isinstance(x, int | float | str) or x.dtype == object:
            return x
        return jnp.asarray(x)

    payload: Any = conv(c["values"])
    if c.get("draft") is not None:
        payload = fj.DraftPayload(**{k: conv(v) for k, v in c["draft"].items()})
    if c.get("tuple_draft"):
        payload = tuple(conv(v) for v in tile(draft()["draft"], n).values())
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


def ops_cases() -> list[str]:
    """The cases visible when the pure ops are traced."""
    return [k for k, c in CASES.items() if c.trace and "ops" in c.where]


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


def jax_outcome(fm: Any, case: Bad, n: int = 1) -> dict[str, Any]:
    """What `case` did on an fm_jax class map: the refusal and whether buffers held."""
    before, state = jax_buffers(fm), fm.state
    try:
        call_jax(fm, case, n)
    except Exception as e:  # noqa: BLE001  # the test judges the type
        kind, msg = type(e).__name__, str(e)
        refused = isinstance(e, fj.FutureMapError)
    else:
        kind, msg, refused = "accepted", "", False
    intact = (
        fm.state is state
        and not any(b.is_deleted() for b in fm.buffers().values())
        and jax_buffers(fm) == before
    )
    return {"kind": kind, "message": msg, "refused": refused, "intact": intact}


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
@pytest.fixture(scope="module")
def jax_maps() -> dict[bool, Any]:
    return {spec: make_jax_map(spec) for spec in (False, True)}


@pytest.mark.parametrize("name", [k for k, c in CASES.items() if "jax" in c.where])
def test_fm_jax_class_refuses_and_keeps_every_byte(jax_maps: dict[bool, Any], name: str) -> None:
    """Pins a bad input that the one-device class takes (writing or casting silently), or
    refuses with a raw error, a message that does not name the field, or after a write."""
    case = CASES[name]
    fm = jax_maps[case.spec]
    got = jax_outcome(fm, case)
    assert got["refused"], got
    assert case.field in got["message"], got
    assert got["intact"], got
    # the map keeps working: the op's good call goes through
    call_jax(fm, Bad(case.op, "", spec=case.spec))


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
@pytest.mark.parametrize("name", ops_cases())
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


@pytest.mark.parametrize("name", [k for k, c in CASES.items() if "torch" in c.where])
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
def _inner() -> dict[str, Any]:
    """In a process with 8 CPU devices: every case on a 4x2 mesh map, and the trace-time
    cases on the sharded pure ops; one JSON-able report."""
    assert len(jax.devices()) == DP * TP, jax.devices()
    mesh = jax.make_mesh((DP, TP), ("dp", "tp"))  # Explicit axes, jax.make_mesh's default
    maps = {spec: make_jax_map(spec, mesh) for spec in (False, True)}
    report: dict[str, Any] = {"class": {}, "ops": {}}
    for name, case in CASES.items():
        if "mesh" not in case.where:
            continue
        try:
            got = jax_outcome(maps[case.spec], case, DP)
            call_jax(maps[case.spec], Bad(case.op, "", spec=case.spec), DP)  # still works
        except Exception:  # noqa: BLE001  # reported to the test
            got = {"error": traceback.format_exc()}
        report["class"][name] = got
    sharded = {}
    for spec in (False, True):
        cfg = fj.SpecConfig(K, H, jnp.dtype(jnp.bfloat16)) if spec else None
        ops = fj.sharded_future_map(R, mesh, dp_axis="dp", tp_axis="tp", spec=cfg, debug=True)
        sharded[spec] = (ops, ops.init())
    for name in ops_cases():
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


@pytest.mark.parametrize("name", [k for k, c in CASES.items() if "mesh" in c.where])
def test_fm_jax_mesh_refuses_and_keeps_every_byte(mesh_report: dict[str, Any], name: str) -> None:
    """Pins the mesh map judging an input otherwise than the one-device map (a float64
    topk_p cast, a rank key 1.0 or True taken as rank 1, a draft ignored)."""
    case = CASES[name]
    got = mesh_report["class"][name]
    assert "error" not in got, got.get("error")
    assert got["refused"], got
    assert case.field in got["message"], got
    assert got["intact"], got


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ops_cases())
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
