"""A batch's placement decided (fm_jax/host/host_batch.py): its protocol's rules
asked once, each of its host modes parsed once."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

import fm_jax as fj
from fm_jax.host import host_batch

R = 8
DECODE = fj.ForwardMode.DECODE


def a(*xs: int) -> np.ndarray:
    return np.array(xs, np.int32)


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_a_batch_asks_its_protocol_once_and_parses_each_mode_once(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pins the general path ping-ponging between the batch and its protocol: the host
    rules asked at four sites per batch (which ids, kinds against token slots, modes, spec
    MIXED, ids per row), each parsing the forward mode again. A batch's layout is ruled by
    one call (`Protocol.rules`) and each of its host modes parsed once."""
    fm = fj.FutureMap(R, protocol=protocol, batch_buckets=(2, 4), token_buckets=(2, 4))
    asked: list[str] = []
    device_side = {"resolve", "sentinels", "next_batch", "resolve_variants", "step_modes"}
    for cls in (host_batch.Protocol, type(fm._placement.protocol)):
        for name, fn in list(vars(cls).items()):
            if callable(fn) and not name.startswith("__") and name not in device_side:
                if name == "check_ids":  # the value rule of one ids field, not the batch's
                    continue

                def counted(*args: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
                    asked.append(_name)
                    return _fn(*args, **kw)

                monkeypatch.setattr(cls, name, counted)
    parsed: list[Any] = []
    original = host_batch.host_mode

    def host_mode(mode: Any, where: str) -> Any:
        parsed.append(mode)
        return original(mode, where)

    for module in list(sys.modules.values()):
        if module.__name__.startswith("fm_jax") and getattr(module, "host_mode", None) is original:
            monkeypatch.setattr(module, "host_mode", host_mode)
    ids = None if protocol == "gather" else -a(1, 2)  # gather: a DECODE's ids are gathered
    batch = fj.Batch(np.array([DECODE], np.int32), a(1, 2), ids, a(3, 4))
    fm._placement.resolve(batch)
    assert asked == ["rules"]
    assert len(parsed) == 1, parsed
