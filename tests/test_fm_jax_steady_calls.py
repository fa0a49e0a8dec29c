"""A steady call (a layout seen before) runs through few of fm_jax's modules: the host
path a reader follows, and the Python calls an overlap engine pays on its critical path.

Traced with `sys.setprofile`: the fm_jax modules whose Python functions a call enters.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import fm_jax as fj

PACKAGE = Path(fj.__file__).resolve().parent
MAX_STEADY_MODULES = 5
"""fm_jax modules a steady engine step, resolve or finish enters (layers: map, host)."""


def _modules_entered(call: Callable[[], object]) -> list[str]:
    entered: list[str] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        path = Path(frame.f_code.co_filename)
        if event == "call" and PACKAGE in path.parents:
            name = path.relative_to(PACKAGE).as_posix()
            if name not in entered:
                entered.append(name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_a_steady_call_enters_at_most_five_modules(protocol: str) -> None:
    d = fj.ForwardMode.DECODE
    slots = np.arange(1, 9, dtype=np.int32)
    fm = fj.FutureMap(64, batch_buckets=[8], token_buckets=[8], protocol=protocol)

    def forward(res: fj.Resolved, batch: fj.Batch, inputs: dict) -> fj.StepOutput:
        return fj.StepOutput(res.seq_lens + 1, res.input_ids + 1, res.input_ids)

    step = fm.engine_step(forward, inputs=[fj.StepInput("temp", "row", (), np.float32)])
    ids = None if protocol == "gather" else -slots
    batch = fj.Batch(d, slots, ids, slots.copy())
    temp = np.ones(8, np.float32)
    calls = {
        "engine step": lambda: step(batch, inputs={"temp": temp}),
        "resolve": lambda: fm.resolve(batch),
        "finish": lambda: fm.finish(batch, slots, slots, slots),
    }
    for call in calls.values():  # the layouts decided, the executables compiled
        call()
    entered = {name: _modules_entered(call) for name, call in calls.items()}
    assert {n: m for n, m in entered.items() if len(m) > MAX_STEADY_MODULES} == {}
    assert all("ops/" not in m for mods in entered.values() for m in mods), entered
