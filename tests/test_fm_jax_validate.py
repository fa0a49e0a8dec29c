"""The host checks (fm_jax/host/validate.py) met directly, where a map of this process
cannot reach them: a layout's checker against the general path's check, and the batch
rules of a map of several DP ranks (the in-process maps have one; the 8-device subprocess
tests build the others, end to end); a batch's protocol rules asked once and each of its
host modes parsed once."""

from __future__ import annotations

import itertools
import sys
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import fm_jax as fj
from fm_jax.host import validate

E, D, M = fj.ForwardMode.EXTEND, fj.ForwardMode.DECODE, fj.ForwardMode.MIXED
R = 16

KINDS = ("slots", "ids", "ints", "relayed")
ROW_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.float32)
INTO = (None, np.int16, np.int32, np.int64)
VALUES = ([0, 1, 5], [3, -1], [-R, 2], [2, 2], [R], [40000], [], [7, 2**33])


def _checks(protocol: str) -> Any:
    return fj.FutureMap(R, protocol=protocol)._placement.inputs.checks


def _outcome(f: Any, a: np.ndarray) -> Any:
    """What `f(a)` gives: its array's dtype and bytes, or its refusal's message."""
    try:
        out = f(a)
    except fj.FutureMapError as e:
        return ("refused", str(e))
    return (out.dtype, out.tobytes())


@pytest.mark.parametrize("protocol", ["sentinel", "gather"])
def test_a_checker_does_what_check_does_with_the_dispatch_done_once(protocol: str) -> None:
    """A plan's checker for rows of one dtype (`HostChecks.checker`) is None exactly when
    the dtype alone says the rows pass as they are (an int field's rows, or a declared
    field's, already in the target dtype); otherwise it gives what `check` gives on every
    array of that dtype, the same cast or the same refusal, into the field's own dtype."""
    checks = _checks(protocol)
    cases = [(k, d, i) for k, d, i in itertools.product(KINDS, ROW_DTYPES, INTO)]
    cases += [("values", d, i) for d in (np.float32, np.float16, np.int32) for i in (np.float32,)]
    for kind, dtype, into in cases:
        dt, to = np.dtype(dtype), np.dtype(checks.dtype if into is None else into)
        into = None if into is None else np.dtype(into)
        f = checks.checker(kind, "x", dt, into)
        assert (f is None) == (dt == to and kind in ("ints", "values")), (kind, dt, into)
        for v in VALUES:
            with np.errstate(over="ignore"):  # 2**33 as float16: inf, a value like any
                a = np.array(v, np.int64).astype(dt)
            want = _outcome(lambda x: checks.check(kind, "x", x, into), a)  # noqa: B023
            got = (a.dtype, a.tobytes()) if f is None else _outcome(f, a)
            assert got == want, (kind, dt, into, v)


def test_rows_already_in_the_target_dtype_are_taken_as_they_are() -> None:
    """No copy for rows in the map's int dtype, however the dtype is spelt (an equal dtype
    that is another object, such as its native byte order spelt out)."""
    checks = _checks("sentinel")
    a = np.arange(3, dtype=np.int32)
    b = a.view(a.dtype.newbyteorder("="))
    assert b.dtype == checks.dtype and b.dtype is not checks.dtype
    assert checks.ints("x", a) is a
    assert checks.ints("x", b) is b
    assert checks.ints("x", a, np.dtype(np.int32)) is a


def test_a_relayed_field_is_an_int() -> None:
    """Relayed rows (tokens, lengths, a consumed field's) are ints judged >= 0; an int
    field's rows are ints, cast where they fit; a field of another dtype takes its own
    dtype only."""
    assert validate.row_kind(None, True) == "relayed"
    assert validate.row_kind(np.dtype(np.int16), True) == "relayed"
    assert validate.row_kind(np.dtype(np.uint8), False) == "ints"
    assert validate.row_kind(np.dtype(np.float32), False) == "values"
    assert validate.row_kind(np.dtype(np.float16), False) == "values"


def test_the_order_check_names_the_rank_of_several() -> None:
    """A spec MIXED batch of two DP ranks: a rank that is not MIXED is skipped, a MIXED
    rank in order passes, and one out of order is refused naming its rank."""
    rules = validate.Rules(mixed_order=True)
    rows = np.array([5, 3, 2, 0, 4, 6, 1, 0], np.int32)  # 4 rows per rank

    def run(modes: list[Any], toks: list[int]) -> None:
        validate.batch_values(rules, modes, [None], rows, np.array(toks, np.int32))

    run([E, M], [0, 0, 0, 0, 0, 6, 1, 0])  # rank 1 in order; rank 0 not MIXED
    run([E, M], [9, 9, 0, 0, 0, 0, 6, 1])  # rank 0's slots are not read
    run([M, M], [0, 3, 2, 0, 6, 1, 0, 0])
    with pytest.raises(
        fj.FutureMapError,
        match=r"^batch\[rank 1\]\.token_slots name running slots \[1, 6\], but the batch's "
        r"last live rows hold \[6, 1\]",
    ):
        run([E, M], [0, 0, 0, 0, 0, 1, 6, 0])
    with pytest.raises(fj.FutureMapError, match=r"^batch\[rank 0\]\.token_slots"):
        run([M, M], [0, 2, 3, 0, 6, 1, 0, 0])
    # Jax arrays are not read here (debug checks the order on the device).
    validate.batch_values(rules, [M, M], [None], jnp.asarray(rows), np.zeros(8, np.int32))


def test_one_id_per_decode_row_names_the_rank_of_several() -> None:
    """A DECODE rank's batch has one id per row: with several DP ranks the refusal names
    the rank; a rank that is not DECODE may carry any count; one mode stands for all."""
    rules = validate.Rules(ids_per_row=True)

    def check(ids: Any, rows: Any, decode: list[bool]) -> None:
        modes = [D if d else E for d in decode]
        validate.one_id_per_row(rules, modes, ids, rows)

    check((2, 3), (2, 3), [True, True])
    check((2, 3), (2, 2), [True, False])  # rank 1 is not DECODE
    check(None, (2, 2), [True])  # ids on the device: not counted here
    validate.one_id_per_row(validate.Rules(), [D], (3,), (2,))  # a protocol without the rule
    for decode in ([True, True], [False, True], [True]):
        with pytest.raises(
            fj.FutureMapError,
            match=r"^input_ids of a DECODE batch has 3 ids for 2 rows on DP rank 1: a decode "
            r"row carries one id$",
        ):
            check((2, 3), (2, 2), decode)
    with pytest.raises(fj.FutureMapError, match=r"has 3 ids for 2 rows: a decode row"):
        check((3,), (2,), [True])  # one rank: no rank named


@pytest.mark.parametrize(
    ("slots", "refusal"),
    [
        ("jax", r"^token_slots of a batch of kind EXTEND name slots \(or are a jax array"),
        ("ragged", r"^token_slots is not an array"),
    ],
)
def test_token_slots_of_a_batch_that_is_not_mixed_are_refused_unless_host_zeros(
    slots: str, refusal: str
) -> None:
    """Token slots of a batch whose host mode is not MIXED must gather nothing: a jax array
    of zeros (not read on the host) is refused like nonzero slots, and a value that is no
    array is named as such; nothing is written."""
    fm = fj.FutureMap(R, protocol="gather", batch_buckets=(4,), token_buckets=(4,))
    ts: Any = jnp.zeros(4, jnp.int32) if slots == "jax" else [[0], [0, 0]]
    rows, ids = np.array([1, 2, 0, 0], np.int32), np.array([5, 6, 0, 0], np.int32)
    before = fm.buffers()
    with pytest.raises(fj.FutureMapError, match=refusal):
        fm.resolve(fj.Batch(E, rows, ids, np.ones(4, np.int32), None, ts))
    after = fm.buffers()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert fm.step == 0


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
    for cls in dict.fromkeys((validate.Protocol, type(fm._placement.protocol))):
        for name, fn in list(vars(cls).items()):
            if callable(fn) and not name.startswith("__") and name not in device_side:
                if name == "check_ids":  # the value rule of one ids field, not the batch's
                    continue

                def counted(*args: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
                    asked.append(_name)
                    return _fn(*args, **kw)

                monkeypatch.setattr(cls, name, counted)
    parsed: list[Any] = []
    original = validate.host_mode

    def host_mode(mode: Any, where: str) -> Any:
        parsed.append(mode)
        return original(mode, where)

    for module in list(sys.modules.values()):
        if module.__name__.startswith("fm_jax") and getattr(module, "host_mode", None) is original:
            monkeypatch.setattr(module, "host_mode", host_mode)
    ids = (
        None if protocol == "gather" else -np.array([1, 2], np.int32)
    )  # gather: a DECODE's ids are gathered
    batch = fj.Batch(
        np.array([D], np.int32), np.array([1, 2], np.int32), ids, np.array([3, 4], np.int32)
    )
    fm._placement.resolve(batch)
    assert asked == ["rules"]
    assert len(parsed) == 1, parsed


@pytest.mark.parametrize("name", ["", 5, None, "pos"])
def test_a_declared_input_needs_a_name_of_its_own(name: Any) -> None:
    """An engine step's inputs are named by distinct non-empty strings: an empty name, one
    that is no string, or a name declared twice is refused by name."""
    first = fj.StepInput("pos", "row")
    with pytest.raises(fj.FutureMapError, match="input names must be distinct strings"):
        validate.check_declared([first, fj.StepInput(name, "token")], np.dtype(np.int32))
    assert validate.check_declared([first], np.dtype(np.int32)) == (
        fj.StepInput("pos", "row", (), np.dtype(np.int32)),
    )


@pytest.mark.parametrize(
    ("declared", "refusal"),
    [
        (fj.StepInput("a", "col"), "per must be 'row', 'token' or 'slot', got 'col'"),
        (fj.StepInput("temperature", "slot"), "per='slot' hands the forward one of the map's"),
        (fj.StepInput("new_seq_lens", "slot", (2,)), r"shape \(\) and dtype int32, got \(2,\)"),
        (fj.StepInput("new_seq_lens", "slot", dtype=np.int64), r"got \(\) int64$"),
        (fj.StepInput("new_seq_lens", "slot", dtype="no dtype"), "bad shape or dtype"),
        (fj.StepInput("a", "row", (-1,)), r"shape \(-1,\) and dtype int32 must be ones JAX"),
        (fj.StepInput("a", "row", dtype=np.float64), "float64 must be ones JAX keeps"),
        (fj.StepInput("a", "row", dtype="no dtype"), "bad shape or dtype"),
    ],
)
def test_a_declared_input_is_checked_when_declared(declared: Any, refusal: str) -> None:
    """Each part of a StepInput is judged at the declaration: `per` one of the three, a
    per-slot input one of the map's relay buffers in its own shape and dtype, a shape JAX
    can make and a dtype it keeps (float64 needs x64 mode)."""
    with pytest.raises(fj.FutureMapError, match=refusal):
        validate.check_declared([declared], np.dtype(np.int32))


def test_every_per_is_declared_as_given() -> None:
    """Each `per`, the owned relay buffers' included, is taken and normalised (a tuple
    shape, a numpy dtype); a trailing size of 0 is a shape, not a negative one."""
    given = [
        fj.StepInput("pos", "row", [2], np.int32),
        fj.StepInput("temperature", "token", dtype="float32"),
        fj.StepInput("new_seq_lens", "slot"),
        fj.StepInput("output_tokens", "slot"),
        fj.StepInput("empty", "row", (0,)),  # a size-0 row is a shape JAX makes
    ]
    got = validate.check_declared(given, np.dtype(np.int32))
    assert [(d.name, d.per, d.shape, d.dtype) for d in got] == [
        ("pos", "row", (2,), np.dtype(np.int32)),
        ("temperature", "token", (), np.dtype(np.float32)),
        ("new_seq_lens", "slot", (), np.dtype(np.int32)),
        ("output_tokens", "slot", (), np.dtype(np.int32)),
        ("empty", "row", (0,), np.dtype(np.int32)),
    ]
    # numpy compares a dtype equal to its name and its scalar type: the types, too
    assert all(type(d.shape) is tuple and isinstance(d.dtype, np.dtype) for d in got)


def test_step_inputs_are_a_mapping_of_the_declared_names() -> None:
    """An engine step's `inputs`: a mapping of exactly its declared names (None: none
    declared); anything else is refused naming what came."""
    declared = validate.check_declared([fj.StepInput("pos", "row")], np.dtype(np.int32))
    given = {"pos": np.zeros(2, np.int32)}
    assert validate.given_inputs(declared, given) is given
    assert validate.given_inputs((), None) == {}
    with pytest.raises(fj.FutureMapError, match="name -> array, got list$"):
        validate.given_inputs(declared, [np.zeros(2, np.int32)])  # type: ignore[arg-type]
    with pytest.raises(fj.FutureMapError, match=r"missing \['pos'\], undeclared \['p'\]"):
        validate.given_inputs(declared, {"p": np.zeros(2, np.int32)})


def test_a_batch_forward_mode_is_parsed_by_its_form() -> None:
    """A host mode is one ForwardMode (an enum member or its int) or one per DP rank (a 1-D
    array: not one mode for the batch, so a rank left IDLE is not the batch's kind); a bad
    value is refused naming `forward_mode` and the value, whichever form brought it."""
    a = np.array([1, 2], np.int32)
    for mode in (D, int(D), np.int32(D)):
        part = validate.given_batch(fj.Batch(mode, a, a, a), 2).parts[0]
        assert (part.modes, part.scalar) == ((D,), True)
    part = validate.given_batch(fj.Batch(np.array([D, 3], np.int32), a, a, a), 2).parts[0]
    assert (part.modes, part.scalar) == ((D, fj.ForwardMode.IDLE), False)
    for mode in (9, np.array([1, 9], np.int32)):
        with pytest.raises(fj.FutureMapError, match="^forward_mode must be a ForwardMode, got 9$"):
            validate.given_batch(fj.Batch(mode, a, a, a), 2)


def test_a_mapping_is_parsed_rank_by_rank() -> None:
    """A mapping DP rank -> Batch: each rank one mode of its own (its part scalar, its
    bad mode named with its rank), its fields kept by rank, and only the ranks that bring
    draft indices or token slots listed for them."""
    a, s = np.array([1, 2], np.int32), np.array([0, 1], np.int32)
    given = validate.given_batch(
        {0: fj.Batch(D, a, a, a, draft_indices=a), 1: fj.Batch(M, a, a, a, token_slots=s)}, 2
    )
    assert given.ranks == (0, 1) and given.modes == (D, M) and given.traced is None
    assert [(p.modes, p.scalar, p.ids, p.slots, p.where) for p in given.parts] == [
        ((D,), True, True, False, "batch[rank 0]."),
        ((M,), True, True, True, "batch[rank 1]."),
    ]
    assert given.draft == {0: a} and given.token_slots == {1: s} and given.lens == {0: a, 1: a}
    with pytest.raises(fj.FutureMapError, match=r"^batch\[rank 1\].forward_mode must be a"):
        validate.given_batch({0: fj.Batch(D, a, a, a), 1: fj.Batch(9, a, a, a)}, 2)
