"""Int rows of every int dtype, through both twins: one rule (docs/CONTRACT.md, 'Checks
beyond SGLang'). Per-row ints (slots, input ids, lengths, tokens, bonus tokens, verified
ids, top-k ids, an engine's int fields) of any int dtype, signed or unsigned, are cast where
every value fits the buffer's dtype; a value that does not fit is refused with
FutureMapError naming the field, before anything is written.

Each case feeds the same rows to fm_jax's class (numpy host rows) and to fm_torch (CPU
tensors of the same dtype, values checked) on int32 maps, for each of the eight int dtypes
and for values that fit, values beyond the buffer (int32's max + 1, uint64's max, int16's
max + 1 for an int16 field) and negative values: both accept with the same buffers and
results, or both refuse naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fm_jax as fj
import fm_torch as ft
from fm_torch import ForwardMode

R = 8
DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
SLOTS = (3, 5)
CONFIGS = ("plain", "spec", "gather")


class Maps(NamedTuple):
    jax: fj.FutureMap
    torch: ft.FutureMap


def spec_config() -> fj.SpecConfig:
    return fj.SpecConfig(
        topk=2,
        verified_id=True,
        extra=(
            fj.RelayField("steps", consumed=True),  # the map's int dtype
            fj.RelayField("pair", (2,), np.int16),
        ),
    )


def good_draft(step: int) -> dict[str, np.ndarray]:
    """A whole draft's rows (int32 ints) for the slots SLOTS."""
    return {
        "bonus_tokens": np.array([30, 50], np.int32) + step,
        "topk_p": np.full((2, 2), 0.5, np.float32),
        "topk_index": np.array([[1, 2], [3, 4]], np.int32) + step,
        "verified_id": np.array([31, 51], np.int32) + step,
        "steps": np.array([1, 2], np.int32) + step,
        "pair": np.array([[6, 7], [8, 9]], np.int16) + step,
    }


def jax_draft(rows: dict[str, Any]) -> fj.DraftPayload:
    return fj.DraftPayload(
        rows["bonus_tokens"],
        rows["topk_p"],
        rows["topk_index"],
        None,
        rows["verified_id"],
        {"steps": rows["steps"], "pair": rows["pair"]},
    )


def torch_draft(rows: dict[str, Any]) -> ft.DraftPayload:
    tt = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in rows.items()}
    return ft.DraftPayload(
        tt["bonus_tokens"],
        tt["topk_p"],
        tt["topk_index"],
        None,
        tt["verified_id"],
        {"steps": tt["steps"], "pair": tt["pair"]},
    )


@pytest.fixture(scope="module")
def maps() -> dict[str, Maps]:
    return make_maps()


def make_maps() -> dict[str, Maps]:
    """One map pair per configuration, each slot of SLOTS published and stashed (int32
    rows). Every case leaves the pair's buffers equal (or fails), so the cases share them."""
    out = {}
    for name in CONFIGS:
        spec = name == "spec"
        protocol = "gather" if name == "gather" else "sentinel"
        jm = fj.FutureMap(
            R, dtype=jnp.int32, spec=spec_config() if spec else None, protocol=protocol
        )
        tm = ft.FutureMap(
            R, dtype=torch.int32, spec=spec, consumed=("steps",) if spec else (), protocol=protocol
        )
        s = np.array(SLOTS, np.int32)
        jm.publish(s, s + 1)
        tm.publish(torch.from_numpy(s), torch.from_numpy(s + 1))
        if spec:
            jm.stash(s, jax_draft(good_draft(0)))
            tm.stash(torch.from_numpy(s), torch_draft(good_draft(0)))
        else:
            jm.stash(s, s * 10)
            tm.stash(torch.from_numpy(s), torch.from_numpy(s * 10))
        out[name] = Maps(jm, tm)
    return out


def buffers(m: Maps) -> list[tuple[str, list[Any], list[Any]]]:
    """Each buffer of both twins as values: (name, fm_jax's, fm_torch's)."""
    js, tm = m.jax.state, m.torch
    pairs = [("output_tokens", js.output_tokens, tm.output_tokens)]
    pairs.append(("new_seq_lens", js.new_seq_lens, tm.new_seq_lens))
    if tm.spec:
        pairs += [
            ("topk_index", js.topk_index, tm.topk_index),
            ("verified_id", js.verified_id, tm.verified_id),
        ]
        assert js.extras is not None
        pairs += [(k, js.extras[k], tm.extras[k]) for k in ("steps", "pair")]
    return [(n, np.asarray(j).tolist(), t.tolist()) for n, j, t in pairs]


def head(x: Any, n: int = 2) -> list[int]:
    """The first `n` rows of a result (fm_jax pads to a bucket) as Python ints."""
    return np.asarray(x if not isinstance(x, torch.Tensor) else x.numpy())[:n].tolist()


# --------------------------------------------------------------------------- the cases
Call = Callable[[dict[str, Maps], Any], Any]
"""Runs an op on the maps with the varied rows (a host array or a tensor), returns what to
compare."""


class Case(NamedTuple):
    config: str
    field: str  # fm_jax's name; fm_torch's in `torch_field` where it differs
    good: tuple[Any, ...]  # the rows that fit (int values, nested for a [B, k] field)
    run_jax: Call
    run_torch: Call
    into: str = "int32"  # the buffer's dtype
    torch_field: str | None = None


def j_batch(mode: ForwardMode, idx: Any, ids: Any, lens: Any, **kw: Any) -> fj.Batch:
    return fj.Batch(mode, idx, ids, lens, **kw)


def t_batch(mode: ForwardMode, idx: Any, ids: Any, lens: Any, **kw: Any) -> ft.ScheduleBatch:
    return ft.ScheduleBatch(mode, idx, ids, lens, **kw)


S32 = np.array(SLOTS, np.int32)
IDS = np.array([7, 9], np.int32)
LENS = np.array([4, 6], np.int32)


def T(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.copy())


def resolve_pair(config: str, field: str) -> tuple[Call, Call]:
    """resolve of an EXTEND batch (spec: a DECODE batch with a draft) with `field` varied."""
    mode = ForwardMode.DECODE if config == "spec" else ForwardMode.EXTEND

    def parts(x: Any, wrap: Callable[[np.ndarray], Any]) -> dict[str, Any]:
        given = {"idx": wrap(S32), "ids": wrap(-S32 if config == "spec" else IDS)}
        given["lens"] = wrap(-S32 if config == "spec" else LENS)
        if config == "spec":
            given["draft"] = wrap(S32)
        given[field] = x
        return given

    def run_jax(ms: dict[str, Maps], x: Any) -> Any:
        g = parts(x, lambda a: a)
        kw = {"draft_indices": g["draft"]} if config == "spec" else {}
        r = ms[config].jax.resolve(j_batch(mode, g["idx"], g["ids"], g["lens"], **kw))
        out = [head(r.input_ids), head(r.seq_lens)]
        if r.draft is not None:
            assert r.draft.extras is not None
            out += [head(r.draft.verified_id), head(r.draft.extras["pair"])]
        return out

    def run_torch(ms: dict[str, Maps], x: Any) -> Any:
        g = parts(x, T)
        kw = {"draft": ft.DraftInput(g["draft"])} if config == "spec" else {}
        b = t_batch(mode, g["idx"], g["ids"], g["lens"], **kw)
        ms[config].torch.resolve(b)
        out = [head(b.input_ids), head(b.seq_lens)]
        if b.draft is not None:
            p = b.draft.payload
            assert p is not None and p.extras is not None
            out += [head(p.verified_id), head(p.extras["pair"])]
        return out

    return run_jax, run_torch


def cases() -> list[Case]:
    out = []
    for config in ("plain", "spec"):
        out.append(
            Case(
                config,
                "indices",
                SLOTS,
                lambda ms, x, c=config: ms[c].jax.publish(x, LENS + 1),
                lambda ms, x, c=config: ms[c].torch.publish(x, T(LENS + 1)),
            )
        )
        out.append(
            Case(
                config,
                "new_seq_lens",
                (11, 12),
                lambda ms, x, c=config: ms[c].jax.publish(S32, x),
                lambda ms, x, c=config: ms[c].torch.publish(T(S32), x),
            )
        )
    out.append(
        Case(
            "plain",
            "tokens",
            (21, 22),
            lambda ms, x: ms["plain"].jax.stash(S32, x),
            lambda ms, x: ms["plain"].torch.stash(T(S32), x),
        )
    )
    out.append(
        Case(
            "plain",
            "indices",
            SLOTS,
            lambda ms, x: ms["plain"].jax.stash(x, IDS),
            lambda ms, x: ms["plain"].torch.stash(x, T(IDS)),
        )
    )
    for name, good, into in (
        ("bonus_tokens", (40, 41), "int32"),
        ("topk_index", ((5, 6), (7, 8)), "int32"),
        ("verified_id", (42, 43), "int32"),
        ("steps", (3, 4), "int32"),
        ("pair", ((10, 11), (12, 13)), "int16"),
    ):

        def jstash(ms: dict[str, Maps], x: Any, n: str = name) -> Any:
            ms["spec"].jax.stash(S32, jax_draft({**good_draft(1), n: x}))

        def tstash(ms: dict[str, Maps], x: Any, n: str = name) -> Any:
            ms["spec"].torch.stash(T(S32), torch_draft({**good_draft(1), n: x}))

        out.append(Case("spec", f"draft.{name}", good, jstash, tstash, into))
    out.append(
        Case(
            "spec",
            "indices",
            SLOTS,
            lambda ms, x: ms["spec"].jax.stash(x, jax_draft(good_draft(2))),
            lambda ms, x: ms["spec"].torch.stash(x, torch_draft(good_draft(2))),
        )
    )
    for config in CONFIGS:
        fields = ["req_pool_indices", "input_ids", "seq_lens"]
        if config == "spec":
            fields = ["req_pool_indices", "draft_indices"]
        for f in fields:
            key = {"req_pool_indices": "idx", "input_ids": "ids", "seq_lens": "lens"}.get(
                f, "draft"
            )
            good = {"idx": SLOTS, "ids": (7, 9), "lens": (4, 6), "draft": SLOTS}[key]
            rj, rt = resolve_pair(config, key)
            torch_field = "draft.indices" if f == "draft_indices" else None
            out.append(Case(config, f, good, rj, rt, torch_field=torch_field))
    eb = (ForwardMode.EXTEND, S32, IDS, LENS)
    for config in ("plain", "spec"):
        out.append(
            Case(
                config,
                "indices",
                SLOTS,
                lambda ms, x, c=config: head(ms[c].jax.invalidate(j_batch(*eb), x).input_ids),
                lambda ms, x, c=config: (
                    ms[c].torch.invalidate(b := t_batch(eb[0], T(S32), T(IDS), T(LENS)), x)
                    or head(b.input_ids)
                ),
            )
        )
        out.append(
            Case(
                config,
                "indices",
                SLOTS,
                lambda ms, x, c=config: head(ms[c].jax.resolve_seq_lens_cpu(x)),
                lambda ms, x, c=config: head(ms[c].torch.resolve_seq_lens_cpu(x)),
            )
        )
    return out


CASES = cases()


def variants(dtype: str, good: tuple[Any, ...], into: str) -> list[tuple[str, Any]]:
    """(what, rows) for `dtype`: the good rows, and where `dtype` holds such a value, the
    last row's first value replaced by the buffer's max + 1, by uint64's max, by -1."""
    info, buf = np.iinfo(dtype), np.iinfo(into)
    out = [("fit", good)]
    for what, value in (
        ("beyond the buffer", int(buf.max) + 1),
        ("beyond int64", 2**64 - 1),
        ("negative", -1),
    ):
        if info.min <= value <= info.max:
            rows = [list(r) if isinstance(r, tuple) else r for r in good]
            if isinstance(rows[-1], list):
                rows[-1][0] = value
            else:
                rows[-1] = value
            out.append((what, rows))
    return out


def call(run: Call, maps: dict[str, Maps], rows: Any) -> tuple[Any, str | None]:
    """What `run` returned, or the FutureMapError message it raised."""
    try:
        return run(maps, rows), None
    except (fj.FutureMapError, ft.FutureMapError) as e:
        return None, str(e)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_both_twins_take_or_refuse_int_rows_alike(
    maps: dict[str, Maps], case: int, dtype: str
) -> None:
    """The same rows of `dtype` to both twins: both accept (the same results and buffers)
    or both refuse naming the field, buffers unchanged; a refusal is never torch's raw
    NotImplementedError (uint16, uint32, uint64 have few ops on CPU)."""
    c = CASES[case]
    m = maps[c.config]
    for what, rows in variants(dtype, c.good, c.into):
        before = buffers(m)
        assert [b[1] for b in before] == [b[2] for b in before]
        a = np.array(rows, dtype)
        got_j, err_j = call(c.run_jax, maps, a)
        got_t, err_t = call(c.run_torch, maps, torch.from_numpy(a.copy()))
        where = f"{c.config} {c.field} {dtype} {what} {rows}: jax {err_j!r}, torch {err_t!r}"
        assert (err_j is None) == (err_t is None), where
        if err_j is not None:
            assert err_t is not None
            assert c.field in err_j, where
            assert (c.torch_field or c.field) in err_t, where
            assert buffers(m) == before, where
        else:
            assert got_j == got_t, where
        after = buffers(m)
        assert [b[1] for b in after] == [b[2] for b in after], where


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_wide_unsigned_rows_are_judged_not_torch_errors(dtype: str) -> None:
    """fm_torch alone: uint16/uint32/uint64 slots, tokens and lengths that fit are taken
    (torch has no min or max for them on CPU); values beyond int32 (uint64: beyond int64)
    are refused naming the field, nothing written."""
    tdt = getattr(torch, dtype)
    fm = ft.FutureMap(R, dtype=torch.int32)
    fm.publish(torch.tensor([3, 5], dtype=tdt), torch.tensor([4, 6], dtype=tdt))
    fm.stash(torch.tensor([3, 5], dtype=tdt), torch.tensor([7, 8], dtype=tdt))
    assert fm.new_seq_lens[[3, 5]].tolist() == [4, 6]
    assert fm.output_tokens[[3, 5]].tolist() == [7, 8]
    big = int(np.iinfo(dtype).max)
    if big > 2**31 - 1:
        before = (fm.new_seq_lens.clone(), fm.output_tokens.clone())
        with pytest.raises(ft.FutureMapError, match="^new_seq_lens holds values that do not"):
            fm.publish(torch.tensor([3, 5], dtype=tdt), torch.tensor([4, big], dtype=tdt))
        with pytest.raises(ft.FutureMapError, match="^indices holds values that do not"):
            fm.stash(torch.tensor([3, big], dtype=tdt), torch.tensor([7, 8], dtype=tdt))
        assert torch.equal(fm.new_seq_lens, before[0])
        assert torch.equal(fm.output_tokens, before[1])
