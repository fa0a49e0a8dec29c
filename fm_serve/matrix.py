"""End-to-end correctness matrix: overlap tokens equal the synchronous run's in every setting.

As vLLM tests its async scheduling: the same requests served synchronously and with overlap,
across relay protocol (sentinel, gather) x debug (off, on) x chunked prefill (on, off) x
MIXED batches (on, off) x slot reuse (heavy: a few slots for many requests; none: a slot
per request). The model is batch-invariant (`tiles.by_tiles`), so every setting's synchronous
run must also give the same tokens as every other's: one reference for the whole matrix.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fm_serve.config import TINY_REQUESTS, EngineConfig, ModelConfig, tiny_model
from fm_serve.engine import Engine, ServeResult
from fm_serve.model import toy
from fm_serve.requests import Request, make_requests
from fm_serve.sweep import diff_outputs

AXES = ("protocol", "debug", "chunked", "mixed", "reuse")


@dataclass(frozen=True)
class Cell:
    """One setting of the matrix."""

    protocol: str
    debug: bool
    chunked: bool
    mixed: bool
    reuse: bool

    def name(self) -> str:
        """The setting in words, e.g. 'gather debug chunked mixed reuse'."""
        flags = [f if getattr(self, f) else f"no-{f}" for f in AXES[1:]]
        return " ".join([self.protocol, *flags])


def engine_config(cell: Cell, requests: int, row_tile: int) -> EngineConfig:
    """The engine for a cell: a prefill budget below the longest prompt (chunked) or above
    it; 3 slots (heavy reuse) or one per request."""
    running = 3 if cell.reuse else requests
    budget = 12 if cell.chunked else TINY_REQUESTS.prompt_len[1] + 2
    up = lambda n: n + (-n % row_tile)  # noqa: E731
    batch = tuple(sorted({up(min(4, running)), up(running)}))
    tokens = tuple(sorted({up(running), up(budget + running)}))
    return EngineConfig(
        max_running=running,
        prefill_budget=budget,
        batch_buckets=batch,
        token_buckets=tokens,
        mixed=cell.mixed,
    )


def cells(half: bool = False) -> list[Cell]:
    """Every cell of the matrix (32), or (`half`) the half fraction of 16 cells in which an
    even number of the five axes take their second value (the 2^(5-1) design of defining
    relation I = ABCDE): any four axes still meet in all 16 of their combinations, so a
    fault that needs up to four settings at once shows in the half as in the whole."""
    values: tuple[tuple[Any, Any], ...] = (
        ("sentinel", "gather"),
        (False, True),
        (True, False),
        (True, False),
        (True, False),
    )
    every = itertools.product(*((0, 1),) * len(AXES))
    return [
        Cell(*(axis[i] for axis, i in zip(values, at, strict=True)))
        for at in every
        if not half or sum(at) % 2 == 0
    ]


def run_matrix(
    n_requests: int = 24,
    model: ModelConfig | None = None,
    only: Sequence[Cell] | None = None,
    half: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, list[str]]:
    """Serve the requests in every cell; returns cell name -> mismatches (empty: equal).

    Each cell's sync and overlap runs are compared with the first cell's sync run. `only`
    picks cells; `half` runs the half fraction (`cells(half=True)`).
    """
    model = model or tiny_model()
    shape = TINY_REQUESTS
    requests: list[Request] = make_requests(
        n_requests, vocab=model.vocab, prompt_len=shape.prompt_len, max_new=shape.max_new
    )
    ref: ServeResult | None = None
    out: dict[str, list[str]] = {}
    for cell in only or cells(half):
        cfg = engine_config(cell, n_requests, model.row_tile)
        engine = Engine(*toy(model), cfg, debug=cell.debug, protocol=cell.protocol)
        sync = engine.run_sync(requests)
        ref = ref or sync
        got = engine.run_overlap(requests)
        bad = diff_outputs("sync", ref, sync) + diff_outputs("overlap", ref, got)
        if cell.mixed and cell.chunked and "MIXED" not in got.modes:
            bad.append("no MIXED batch was served")
        if not cell.mixed and "MIXED" in got.modes:
            bad.append("a MIXED batch was served with MIXED off")
        out[cell.name()] = bad
        log(f"{cell.name()}: {'equal' if not bad else f'{len(bad)} mismatches'}")
    return out
