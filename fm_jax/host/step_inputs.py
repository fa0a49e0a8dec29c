"""An engine step's declared inputs: the engine's own per-step host arrays (`StepInput`),
their declaration checked once, and what a call gives for them.

Placed with the batch (`host_batch`), padded like its rows or tokens; or, `per='slot'`,
one of the map's relay buffers handed to the forward inside the step (`engine_step`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.ops.errors import FutureMapError


class StepInput(NamedTuple):
    """One of the engine's own per-step host arrays (positions, offsets, sampling params).

    Attributes:
      name: its key in the step's `inputs` mapping, and in `forward`'s.
      per: "row" ([B, *shape], padded like `req_pool_indices`) or "token" ([T, *shape],
        padded like `input_ids`; a gather-protocol DECODE batch has T = B). Padding is 0.
        Or "slot": not a host array but one of the map's relay buffers (`name`
        "new_seq_lens" or "output_tokens", shape (), the map's int dtype), handed to the
        forward as the step's resolve left it; the forward writes it itself and returns it
        where `StepOutput` relays that value, and the map takes it with no scatter of its
        own (docs/CONTRACT.md, 'Engine-owned relay buffers').
      shape: the trailing shape of one row or token.
      dtype: its dtype; host arrays of another dtype are cast only where no value can
        change (numpy's 'safe' casting, or ints into an int dtype their values fit: a
        Python list of ints included), else refused.
    """

    name: str
    per: str
    shape: tuple[int, ...] = ()
    dtype: Any = np.int32


OWNABLE = ("new_seq_lens", "output_tokens")
"""The relay buffers an engine's forward may own (`StepInput(name, per="slot")`)."""


def check_declared(inputs: Sequence[StepInput], map_dtype: np.dtype) -> tuple[StepInput, ...]:
    """The engine's declared inputs checked and normalised (tuple shapes, numpy dtypes):
    StepInputs of distinct names, per 'row', 'token' or 'slot' (a relay buffer of
    `OWNABLE`, declared as the map stores it: shape (), the map's int dtype `map_dtype`,
    whatever the inputs declared before it), shapes and dtypes JAX keeps."""
    out, seen = [], set()
    for d in inputs:
        if not isinstance(d, StepInput):
            raise FutureMapError(f"engine_step inputs must be StepInputs, got {d!r}")
        if not isinstance(d.name, str) or not d.name or d.name in seen:
            raise FutureMapError(f"engine_step input names must be distinct strings: {d.name!r}")
        if d.per not in ("row", "token", "slot"):
            raise FutureMapError(
                f"StepInput {d.name!r}: per must be 'row', 'token' or 'slot', got {d.per!r}"
            )
        if d.per == "slot":
            if d.name not in OWNABLE:
                raise FutureMapError(
                    f"StepInput {d.name!r}: per='slot' hands the forward one of the map's "
                    f"relay buffers {OWNABLE}, not {d.name!r}"
                )
            if tuple(d.shape) != () or np.dtype(d.dtype) != map_dtype:
                raise FutureMapError(
                    f"StepInput {d.name!r}: the map's {d.name} buffer is one {map_dtype} "
                    f"per slot: declare shape () and dtype {map_dtype}, got {d.shape} "
                    f"{d.dtype}"
                )
        try:
            shape = tuple(int(n) for n in d.shape)
            dtype = np.dtype(d.dtype)
        except TypeError:
            raise FutureMapError(f"StepInput {d.name!r}: bad shape or dtype {d}") from None
        if any(n < 0 for n in shape) or jax.dtypes.canonicalize_dtype(dtype) != dtype:
            raise FutureMapError(
                f"StepInput {d.name!r}: shape {shape} and dtype {dtype} must be ones JAX keeps "
                "(float64 and int64 need x64 mode)"
            )
        seen.add(d.name)
        out.append(d._replace(shape=shape, dtype=dtype))
    return tuple(out)


def given_inputs(
    declared: Sequence[StepInput], given: Mapping[str, Any] | None
) -> Mapping[str, Any]:
    """An engine step's `inputs`, refused unless a mapping of exactly the declared names."""
    given = {} if given is None else given
    if not isinstance(given, Mapping):
        raise FutureMapError(f"inputs must be a mapping name -> array, got {type(given).__name__}")
    names = {d.name for d in declared}
    if set(given) != names:
        missing, extra = sorted(names - set(given)), sorted(set(given) - names)
        raise FutureMapError(
            f"inputs must be exactly the declared StepInputs: missing {missing}, undeclared {extra}"
        )
    return given
