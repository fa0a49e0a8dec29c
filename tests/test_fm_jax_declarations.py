"""Constructors and declarations driven with arbitrary arguments: a clear FutureMapError or a
working map, never a raw exception and never a silent coercion (reliability round two)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fm_jax as fj

JUNK = st.sampled_from([None, "x", "", 1.5, -1, 0, True, [], (), {}, object(), b"b", [1, "a"]])
INTS = st.integers(-2, 9)
DTYPES = st.sampled_from(
    [np.int32, np.int16, np.float32, np.float64, np.int64, jnp.bfloat16, np.float16, object, "x"]
)


def fields() -> st.SearchStrategy[Any]:
    shape = st.one_of(st.tuples(INTS), st.just(()), JUNK)
    field = st.builds(
        fj.RelayField,
        name=st.one_of(st.sampled_from(["a", "b", "bonus_tokens", "1x"]), JUNK),
        shape=shape,
        dtype=st.one_of(st.none(), DTYPES),
        consumed=st.one_of(st.booleans(), JUNK),
        bits=st.one_of(st.booleans(), JUNK),
    )
    return st.one_of(st.lists(field, max_size=2).map(tuple), JUNK)


SPECS = st.one_of(
    st.none(),
    JUNK,
    st.builds(
        fj.SpecConfig,
        topk=st.one_of(INTS, JUNK),
        hidden=st.one_of(INTS, JUNK),
        hidden_dtype=st.one_of(DTYPES, JUNK),
        verified_id=st.one_of(st.booleans(), JUNK),
        extra=fields(),
    ),
)
BUCKETS = st.one_of(st.none(), st.lists(st.one_of(INTS, JUNK), max_size=3), JUNK)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    pool=st.one_of(st.integers(-1, 40), JUNK),
    dtype=st.one_of(DTYPES, JUNK),
    spec=SPECS,
    debug=st.one_of(st.booleans(), JUNK),
    batch=BUCKETS,
    tokens=BUCKETS,
    protocol=st.one_of(st.sampled_from(["sentinel", "gather"]), JUNK),
    pack=st.one_of(st.none(), st.booleans(), JUNK),
)
def test_a_map_is_built_or_refused_clearly(
    pool: Any, dtype: Any, spec: Any, debug: Any, batch: Any, tokens: Any, protocol: Any, pack: Any
) -> None:
    """Every argument combination gives a working map (one publish and resolve run) or a
    FutureMapError; a map built keeps exactly the buckets given (an empty list is refused,
    not read as 'the defaults')."""
    try:
        fm = fj.FutureMap(
            pool,
            dtype=dtype,
            spec=spec,
            debug=debug,
            batch_buckets=batch,
            token_buckets=tokens,
            protocol=protocol,
            pack_inputs=pack,
        )
    except fj.FutureMapError:
        return
    if batch is not None:
        assert fm.batch_buckets == tuple(sorted(set(batch)))
    one = np.array([1], np.int32)
    fm.publish(one, one)
    fm.resolve(fj.Batch(fj.ForwardMode.EXTEND, one, one, one))
    fm.check()


@pytest.mark.parametrize(
    "payload",
    [
        fj.DraftPayload(np.array([object()]), np.ones((1, 1), np.float32), np.ones((1, 1), int)),
        fj.DraftPayload(np.array([1]), np.array([[object()]]), np.ones((1, 1), int)),
        fj.DraftPayload(np.array([1]), np.array([["a"]]), np.ones((1, 1), int)),
        fj.DraftPayload(
            np.array([1]), np.ones((1, 1), np.float32), np.ones((1, 1), int), extras=[np.ones(1)]
        ),
        3,
        None,
    ],
    ids=["object bonus", "object topk_p", "str topk_p", "extras a list", "an int", "None"],
)
def test_a_malformed_payload_is_refused_by_name(payload: Any) -> None:
    """Object- and string-dtype rows, `extras` given as a list, a payload that is no
    DraftPayload: FutureMapError before anything is written (they raised raw TypeErrors)."""
    fm = fj.FutureMap(8, spec=fj.SpecConfig(topk=1), batch_buckets=(1,), token_buckets=(1,))
    before = [np.asarray(v).tobytes() for v in fm.buffers().values()]
    with pytest.raises(fj.FutureMapError):
        fm.stash(np.array([2], np.int32), payload)
    assert [np.asarray(v).tobytes() for v in fm.buffers().values()] == before
