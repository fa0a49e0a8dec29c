"""Bitwise comparison of two traces: raw bytes, so NaN == NaN and -0.0 != 0.0."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fm_parity import exchange
from fm_parity.trace import Field, OpRecord, RunResult


@dataclass(frozen=True)
class Divergence:
    """Where two traces first differ, with both values (value and bit pattern)."""

    scenario: str
    rank: int
    step: int
    op: str
    field: str
    slot: int | None
    index: tuple[int, ...] | None
    a: str
    b: str
    names: tuple[str, str] = ("jax", "torch")

    def __str__(self) -> str:
        where = f"{self.scenario}: rank {self.rank}, step {self.step}, op {self.op}"
        where += f", field {self.field}"
        if self.slot is not None:
            where += f", slot {self.slot}"
        if self.index is not None:
            where += f" (entry {list(self.index)})"
        return f"{where}: {self.names[0]}={self.a} vs {self.names[1]}={self.b}"


@dataclass(frozen=True)
class Comparison:
    """The result of comparing two traces.

    Attributes:
      ops_compared: records (ops) present in both traces and compared.
      field_divergences: recorded fields whose bytes differ in a compared record.
      length_mismatch: one trace has records the other lacks (a run stopped early).
      first: the first divergence, or None.
    """

    ops_compared: int
    field_divergences: int
    length_mismatch: bool
    first: Divergence | None

    @property
    def divergences(self) -> int:
        """Differing fields, plus one if the traces differ in length."""
        return self.field_divergences + int(self.length_mismatch)


def _element(x: np.ndarray, i: int) -> str:
    """Entry `i` of flat `x` as 'value (0xbits)'."""
    flat = np.ascontiguousarray(x).reshape(-1)
    raw = flat[i : i + 1].view(np.uint8)[::-1].tobytes().hex()  # little-endian -> hex
    v = flat[i]
    shown = repr(float(v)) if flat.dtype.kind == "f" or flat.dtype.name == "bfloat16" else str(v)
    return f"{shown} (0x{raw})"


def first_difference(a: Any, b: Any) -> tuple[tuple[int, ...] | None, str, str] | None:
    """None if `a` and `b` are bitwise equal; else (entry index, a's value, b's value).

    A dtype or shape mismatch has no entry index; its values describe the mismatch.
    """
    if exchange.bytes_equal(a, b):
        return None
    x, y = exchange.to_numpy(a), exchange.to_numpy(b)
    if x.dtype.name != y.dtype.name or x.shape != y.shape:
        return None, f"{x.dtype.name}{list(x.shape)}", f"{y.dtype.name}{list(y.shape)}"
    size = x.dtype.itemsize
    xb = np.ascontiguousarray(x).reshape(-1).view(np.uint8).reshape(-1, size)
    yb = np.ascontiguousarray(y).reshape(-1).view(np.uint8).reshape(-1, size)
    i = int(np.argmax((xb != yb).any(axis=1)))
    return tuple(int(j) for j in np.unravel_index(i, x.shape)), _element(x, i), _element(y, i)


def _field_divergence(
    scenario: str,
    rec: OpRecord,
    name: str,
    fa: Field | None,
    fb: Field | None,
    names: tuple[str, str],
) -> Divergence | None:
    def at(slot: int | None, index: tuple[int, ...] | None, a: str, b: str) -> Divergence:
        return Divergence(scenario, rec.rank, rec.step, rec.op, name, slot, index, a, b, names)

    if fa is None or fb is None:
        return at(
            None, None, "absent" if fa is None else "present", "absent" if fb is None else "present"
        )
    diff = first_difference(fa.value, fb.value)
    if diff is None:
        return None
    index, va, vb = diff
    slot = None
    if index is not None and index and index[0] < len(fa.slots):
        slot = int(fa.slots[index[0]])
    return at(slot, index, va, vb)


def _by_rank(run: RunResult) -> dict[int, list[OpRecord]]:
    out: dict[int, list[OpRecord]] = {}
    for rec in run.records:
        out.setdefault(rec.rank, []).append(rec)
    return out


def compare_traces(
    scenario: str, a: RunResult, b: RunResult, names: tuple[str, str] = ("jax", "torch")
) -> Comparison:
    """Compare two runs' traces rank by rank, record by record, field by field, byte by byte.

    A rank's records are matched by position; if their (step, op) differ, the runs took
    different paths on that rank and its comparison stops there (one divergence). A rank
    whose records one run lacks, or a trace that ends early, is a length mismatch. The
    reported first divergence is the earliest step's (the lowest rank on a tie).
    """
    ta, tb = _by_rank(a), _by_rank(b)
    found: list[Divergence] = []
    diverged = compared = 0
    mismatch = False
    for rank in sorted(set(ta) | set(tb)):
        ra_all, rb_all = ta.get(rank, []), tb.get(rank, [])
        for ra, rb in zip(ra_all, rb_all, strict=False):
            if (ra.step, ra.op) != (rb.step, rb.op):
                diverged += 1
                sa, sb = f"step {ra.step} {ra.op}", f"step {rb.step} {rb.op}"
                found.append(
                    Divergence(
                        scenario, rank, ra.step, ra.op, "<op sequence>", None, None, sa, sb, names
                    )
                )
                break
            compared += 1
            for name in sorted(set(ra.fields) | set(rb.fields)):
                d = _field_divergence(
                    scenario, ra, name, ra.fields.get(name), rb.fields.get(name), names
                )
                if d is not None:
                    diverged += 1
                    found.append(d)
        else:
            if len(ra_all) != len(rb_all):
                mismatch = True
                longer = ra_all if len(ra_all) > len(rb_all) else rb_all
                rec = longer[min(len(ra_all), len(rb_all))]
                ended_a, ended_b = len(ra_all) < len(rb_all), len(rb_all) < len(ra_all)
                found.append(
                    Divergence(
                        scenario,
                        rank,
                        rec.step,
                        rec.op,
                        "<trace end>",
                        None,
                        None,
                        f"stopped: {a.error}" if ended_a else "ran on",
                        f"stopped: {b.error}" if ended_b else "ran on",
                        names,
                    )
                )
    first = min(found, key=lambda d: (d.step, d.rank), default=None)
    return Comparison(compared, diverged, mismatch, first)
