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
# Beside the usual ones, dtypes numpy has and JAX does not store (long double, void,
# structured, dates) or stores packed (float4), and JAX's own floats (numpy kind 'V').
ODD = [np.longdouble, np.dtype("V2"), np.dtype([("a", np.int32)]), "datetime64[s]"]
ODD += [np.complex64, np.bool_, np.uint8, jnp.float8_e4m3fn, jnp.float8_e5m2]
ODD += [getattr(jnp, "float4_e2m1fn", np.float16)]
DTYPES = st.sampled_from(
    [np.int32, np.int16, np.float32, np.float64, np.int64, jnp.bfloat16, np.float16, object, "x"]
    + ODD
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


def _dtype(field: fj.RelayField, fm: fj.FutureMap) -> np.dtype:
    """A declared field's value dtype (None: the map's int dtype)."""
    return np.dtype(fm.dtype if field.dtype is None else field.dtype)


# The arguments the class and the pure ops' constructor share.
SHARED = {
    "pool": st.one_of(st.integers(-1, 40), JUNK),
    "dtype": st.one_of(DTYPES, JUNK),
    "spec": SPECS,
    "debug": st.one_of(st.booleans(), JUNK),
    "protocol": st.one_of(st.sampled_from(["sentinel", "gather"]), JUNK),
}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    **SHARED,
    batch=BUCKETS,
    tokens=BUCKETS,
)
def test_a_map_is_built_or_refused_clearly(
    pool: Any, dtype: Any, spec: Any, debug: Any, batch: Any, tokens: Any, protocol: Any
) -> None:
    """Every argument combination gives a working map (one publish and resolve run; a spec
    map also stashes a draft of every declared field and resolves it) or a FutureMapError;
    a map built keeps exactly the buckets given (an empty list is refused, not read as 'the
    defaults'). Defect (reliability round two): declarations no stash could serve were
    accepted (complex with bits=True, a void or long double dtype raised raw TypeErrors
    when the map was built; a float8 field refused every host stash)."""
    try:
        fm = fj.FutureMap(
            pool,
            dtype=dtype,
            spec=spec,
            debug=debug,
            batch_buckets=batch,
            token_buckets=tokens,
            protocol=protocol,
        )
    except fj.FutureMapError:
        return
    if batch is not None:
        assert fm.batch_buckets == tuple(sorted(set(batch)))
    one = np.array([1], np.int32)
    fm.publish(one, one)
    fm.resolve(fj.Batch(fj.ForwardMode.EXTEND, one, one, one))
    if fm.spec is not None:
        rows = {f.name: np.ones((1, *f.shape), _dtype(f, fm)) for f in fm.spec.fields()}
        std = {k: rows.pop(k) for k in fj.DraftPayload._fields if k in rows}
        fm.stash(one, fj.DraftPayload(**std, extras=rows or None))
        r = fm.resolve(fj.Batch(fj.ForwardMode.DECODE, one, one, one, draft_indices=one))
        assert r.draft is not None
        for f in fm.spec.extra:
            assert r.draft.extras is not None
            got = np.asarray(r.draft.extras[f.name])[:1]
            assert got.dtype == _dtype(f, fm), f
    fm.check()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(**SHARED)
def test_the_pure_ops_are_built_or_refused_clearly(
    pool: Any, dtype: Any, spec: Any, debug: Any, protocol: Any
) -> None:
    """The pure ops' constructor (`fm_jax.future_map`) with arbitrary arguments: ops whose
    state initialises, or a FutureMapError."""
    try:
        ops = fj.future_map(pool, dtype=dtype, spec=spec, debug=debug, protocol=protocol)
    except fj.FutureMapError:
        return
    state = ops.init()
    assert state.output_tokens.shape == (pool,)


def _rows(dtype: np.dtype, shape: tuple[int, ...], nonnegative: bool) -> np.ndarray:
    """Two rows of `dtype` from a byte pattern holding NaNs with payloads and -0.0 (floats),
    all bits set (ints, unless `nonnegative`)."""
    n = int(np.prod((2, *shape)))
    if dtype == np.bool_:
        return (np.arange(n) % 2 == 0).reshape(2, *shape)
    if nonnegative:
        return np.arange(n).astype(dtype).reshape(2, *shape)
    pattern = np.array([0xFF, 0xC1, 0x7F, 0x80, 0x00, 0x01, 0x7C, 0x3F], np.uint8)
    raw = np.resize(pattern, n * dtype.itemsize)
    return raw.view(dtype).reshape(2, *shape)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    dtype=st.one_of(st.none(), DTYPES),
    bits=st.booleans(),
    consumed=st.booleans(),
    shape=st.sampled_from([(), (3,), (2, 2)]),
    on_device=st.booleans(),
    protocol=st.sampled_from(["sentinel", "gather"]),
)
def test_a_declared_field_is_served_or_refused_when_declared(
    dtype: Any, bits: bool, consumed: bool, shape: tuple[int, ...], on_device: bool, protocol: str
) -> None:
    """A RelayField of any dtype is refused when the map is built, or served: stashed from
    host or device rows and resolved with its dtype and shape, byte for byte where bits=True
    asks for it or the values are not floats. Defect (reliability round two): complex with
    bits=True, a void, structured or long double dtype raised raw TypeErrors; a float8
    field was declared and then refused every host stash."""
    field = fj.RelayField("x", shape, dtype, consumed=consumed, bits=bits)
    try:
        spec = fj.SpecConfig(topk=0, bonus_tokens=False, extra=(field,))
        fm = fj.FutureMap(8, spec=spec, protocol=protocol, batch_buckets=(2,), token_buckets=(2,))
    except fj.FutureMapError:
        return
    assert fm.spec is not None
    (declared,) = fm.spec.extra
    dt = _dtype(declared, fm)
    rows = _rows(dt, shape, consumed)
    slots = np.array([3, 5], np.int32)
    fm.stash(slots, fj.DraftPayload(extras={"x": jnp.asarray(rows) if on_device else rows}))
    fm.publish(slots, np.array([2, 2], np.int32))
    ids = slots if protocol == "gather" else -slots
    r = fm.resolve(fj.Batch(fj.ForwardMode.DECODE, slots, ids, ids, draft_indices=slots))
    assert r.draft is not None and r.draft.extras is not None
    got = np.asarray(r.draft.extras["x"])[:2]
    assert got.dtype == dt and got.shape == rows.shape
    if bits or not jnp.issubdtype(dt, jnp.inexact):
        assert got.tobytes() == rows.tobytes(), (dt, bits)


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
