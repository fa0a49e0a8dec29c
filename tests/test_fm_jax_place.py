"""Placement met directly (fm_jax/host/place.py): which inputs a debug map checks on the
device."""

from __future__ import annotations

import jax
import numpy as np

import fm_jax as fj
from fm_jax.host import place

R = 8
DECODE = fj.ForwardMode.DECODE


def a(*xs: int) -> np.ndarray:
    return np.array(xs, np.int32)


def test_which_inputs_a_debug_map_checks_on_the_device() -> None:
    """`on_device`: an input holding a jax array anywhere (alone, in a tuple, a list, a
    mapping, a DraftPayload) is checked on the device; host rows, lists of numbers and
    empty containers are not."""
    dev = jax.device_put(a(1))
    assert place.on_device(dev) and place.on_device((a(1), dev)) and place.on_device({0: dev})
    assert place.on_device(fj.DraftPayload(dev, a(1), a(1)))
    assert (
        not place.on_device(a(1))
        and not place.on_device([1, 2])
        and not place.on_device((a(1), a(2)))
    )
    assert not place.on_device({0: a(1)}) and not place.on_device(()) and not place.on_device(None)
    assert not place.on_device(3)
