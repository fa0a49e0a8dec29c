"""A DP x TP mesh for a FutureMap, and what its compiled ops do beyond relaying bytes.

`MeshHealth` watches a mesh map's calls: a call whose executable and shapes were seen
before must compile nothing (an idle rank changes no shape), the state must keep its
sharding from op to op, and the compiled ops must hold no collective (each rank's gathers
and scatters stay in its own block).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

import fm_jax
from fm_parity import payloads

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def make_mesh(dp: int, tp: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A ('dp', 'tp') mesh over the first dp*tp devices (DP-major: a rank's TP group adjacent).

    Across processes `jax.devices()` lists every process's devices in process order, so a
    process holds whole TP groups when its device count is a multiple of tp.
    """
    devs = list(devices if devices is not None else jax.devices())
    if len(devs) < dp * tp:
        raise ValueError(f"dp={dp} x tp={tp} needs {dp * tp} devices, have {len(devs)}")
    return Mesh(np.array(devs[: dp * tp], dtype=object).reshape(dp, tp), ("dp", "tp"))


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
    """Collect one entry per XLA backend compile made inside the block."""
    seen: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == BACKEND_COMPILE_EVENT:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def count_collectives(hlo_text: str) -> int:
    """Cross-device collective instructions (sync or async start) in an HLO module's text."""
    return sum(hlo_text.count(f" {c}(") + hlo_text.count(f" {c}-start(") for c in COLLECTIVES)


def hlo_collectives(fm: fm_jax.FutureMap, rows: int, tokens: int) -> dict[str, int]:
    """Collectives in each op's compiled HLO at per-rank sizes (rows, tokens), mode traced
    (a spec map: stash of a whole draft, resolve with draft indices; a gather-protocol map:
    resolve with token slots, and no invalidate, which that protocol never runs)."""
    dp, dt = fm.layout.dp, fm.dtype
    sh = fm.layout.sharding

    def arr(n: int, *tail: int, dtype: Any = dt) -> Any:
        return jax.ShapeDtypeStruct((dp * n, *tail), dtype, sharding=sh)

    state = jax.tree.map(
        lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=b.sharding), fm.state
    )
    spec = fm.spec
    payload, draft = arr(rows), None
    if spec is not None:  # every declared field
        rows_of = {
            f.name: arr(rows, *f.shape, dtype=dt if f.dtype is None else f.dtype)
            for f in spec.fields()
        }
        extras = {k: v for k, v in rows_of.items() if k not in payloads.STANDARD} or None
        std = {k: v for k, v in rows_of.items() if k in payloads.STANDARD}
        payload = fm_jax.DraftPayload(**std, extras=extras)
        draft = arr(rows)
    mode: Any = jax.ShapeDtypeStruct((dp,), np.int32)  # traced: one per rank
    gather = fm.protocol == "gather"
    token_slots = arr(tokens) if gather else None
    batch = fm_jax.Batch(mode, arr(rows), arr(tokens), arr(rows), draft, token_slots)
    ex = fm.executables()
    lowered = {
        "publish": ex["publish"].lower(state, arr(rows), arr(rows)),
        "stash": ex["stash"].lower(state, arr(rows), payload),
        "resolve": ex["resolve"].lower(state, batch),
    }
    if not gather:
        lowered["invalidate"] = ex["sentinels"].lower(state, arr(rows))
    return {op: count_collectives(low.compile().as_text()) for op, low in lowered.items()}


@dataclass
class MeshHealth:
    """What a mesh map's calls showed, beyond the bytes they relayed.

    Attributes:
      recompiles: backend compiles during calls whose key (op and shapes) was seen before.
      compiles_total: backend compiles during all calls.
      resharded: some call left the state with another sharding than it started with.
      largest: the largest (rows, tokens) a call used (where collectives are counted).
    """

    recompiles: int = 0
    compiles_total: int = 0
    resharded: bool = False
    largest: tuple[int, int] = (0, 0)
    _seen: set[Hashable] = field(default_factory=set)

    @contextlib.contextmanager
    def call(
        self, fm: fm_jax.FutureMap, key: Hashable | None, rows: int, tokens: int = 0
    ) -> Iterator[None]:
        """Watch one call of `fm`: compiles during it, and the state's sharding after it.

        `key` names the executable and shapes the call runs; None for a call that runs
        none (publish or stash with no rows on any of this process's ranks).
        """
        sharding = fm.state.output_tokens.sharding
        with count_compiles() as compiles:
            yield
        self.compiles_total += len(compiles)
        if key is not None:
            if key in self._seen:
                self.recompiles += len(compiles)
            self._seen.add(key)
        self.resharded |= fm.state.output_tokens.sharding != sharding
        self.largest = (max(self.largest[0], rows), max(self.largest[1], tokens))

    def report(self, fm: fm_jax.FutureMap) -> dict[str, Any]:
        """The report keys: recompiles, compiles_total, collectives (per op), resharded."""
        rows, tokens = self.largest
        rows = rows or fm.batch_buckets[0]
        tokens = tokens or fm.token_buckets[0]
        return {
            "recompiles": self.recompiles,
            "compiles_total": self.compiles_total,
            "collectives": hlo_collectives(fm, rows, tokens),
            "resharded": self.resharded,
        }


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report for the processes of one run: counts summed, collectives at their most."""
    ops = list(dict.fromkeys(op for r in reports for op in r["collectives"]))
    return {
        "recompiles": sum(r["recompiles"] for r in reports),
        "compiles_total": sum(r["compiles_total"] for r in reports),
        "collectives": {op: max(r["collectives"].get(op, 0) for r in reports) for op in ops},
        "resharded": any(r["resharded"] for r in reports),
    }
