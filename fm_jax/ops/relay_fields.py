"""The fields a spec map relays, declared once: what stash writes, resolve gathers and debug
consume-tracks follows this list (docs/CONTRACT.md, 'Relay fields').

A field lives in one buffer of the state, [R, *shape]: the bonus tokens in `output_tokens`
(shared with non-spec tokens), the other standard fields in their own `FutureMapState`
attribute, an engine's own fields in `FutureMapState.extras` by name. A DraftPayload holds
the same fields the same way (standard attributes, `extras` by name).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax.ops import errors
from fm_jax.ops.errors import FutureMapError

HIDDEN_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
STANDARD = ("bonus_tokens", "verified_id", "topk_p", "topk_index", "hidden_states")
"""The standard fields' names, in the order a map declares them."""


class RelayField(NamedTuple):
    """One per-row value a spec map relays from a step's stash to the next step's resolve.

    Attributes:
      name: the field's name (an entry of `DraftPayload.extras` for an engine's own field).
      shape: the per-row shape; () for one value per row.
      dtype: the element dtype, one a buffer stores (`storable`: bool, ints, floats up to
        64 bits, complex, bfloat16, the float8s; 64-bit ones need x64); None for the map's
        int dtype.
      consumed: debug consume tracking (an int field): the buffer starts at -1, every value
        gathered from a live slot must be >= 0, and -1 is written back at the slots read.
      bits: deprecated, changes nothing: every real-float field (bfloat16 and the float8s
        included) is stored as its raw bits (`stored_as_bits`). Kept so declarations that
        set it still build; True on a field that is not a real float is refused.
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: Any = None
    consumed: bool = False
    bits: bool = False


def storable(dtype: np.dtype) -> bool:
    """Whether a buffer can hold values of `dtype` as they are: numpy's bool, ints, floats
    up to 64 bits and complex up to 128, and JAX's whole-byte floats (bfloat16, the
    float8s), which numpy reports as kind 'V'. Not: long double, void and structured
    dtypes, strings, objects, dates, or sub-byte floats (JAX packs a float4's bits)."""
    if dtype.kind in "biu":
        return True
    if dtype.kind in "fc":
        return dtype.itemsize <= (8 if dtype.kind == "f" else 16)
    if dtype.kind == "V" and dtype.fields is None and jnp.issubdtype(dtype, jnp.floating):
        return int(jnp.finfo(dtype).bits) == 8 * dtype.itemsize
    return False


def bits_dtype(dtype: Any) -> np.dtype:
    """The unsigned int dtype of `dtype`'s width, which stores its raw bits."""
    return np.dtype(f"uint{np.dtype(dtype).itemsize * 8}")


def stored_as_bits(field: RelayField) -> bool:
    """Whether the field's buffer holds its values' raw bits: every real float does. Rows
    then move as unsigned ints of the same width, so every byte stashed (NaN payloads and
    signs, -0.0, infinities) is the byte resolved, under either kernel and on every backend:
    XLA computes a bfloat16 or float8 scatter in f32 on CPU, which rewrites NaNs (and
    e5m2's NaN sign) and passes over the whole buffer. A bitcast of the rows costs nothing."""
    return field.dtype is not None and bool(jnp.issubdtype(field.dtype, jnp.floating))


def standard_fields(
    topk: int, hidden: int, hidden_dtype: Any, verified_id: bool, bonus_tokens: bool = True
) -> tuple[RelayField, ...]:
    """A draft's standard fields: bonus tokens (unless a draft brings none, as an n-gram
    one) and verified ids (if declared), both consume-tracked; top-k probabilities and ids
    when K > 0; hidden states when H > 0."""
    out = [RelayField("bonus_tokens", consumed=True)] if bonus_tokens else []
    if verified_id:
        out.append(RelayField("verified_id", consumed=True))
    if topk:
        out += [
            RelayField("topk_p", (topk,), np.dtype(np.float32)),
            RelayField("topk_index", (topk,)),
        ]
    if hidden:
        out.append(RelayField("hidden_states", (hidden,), np.dtype(hidden_dtype)))
    return tuple(out)


def count_at_least(x: Any, low: int) -> bool:
    """`x` is an int (not a bool) >= low."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_) and bool(x >= low)


def check_extra(fields: tuple[Any, ...]) -> tuple[RelayField, ...]:
    """An engine's own fields, normalised (dtype a numpy dtype or None); FutureMapError
    naming what is wrong: a name taken or repeated, a bad shape or dtype, a consumed
    field that is not an int."""
    out, seen = [], set(STANDARD)
    for f in fields:
        if not isinstance(f, RelayField):
            raise FutureMapError(f"spec.extra holds RelayFields, got {f!r}")
        if not isinstance(f.name, str) or not f.name.isidentifier() or f.name in seen:
            raise FutureMapError(f"spec.extra: field name {f.name!r} is not a new identifier")
        seen.add(f.name)
        if not isinstance(f.shape, tuple | list) or not all(count_at_least(d, 1) for d in f.shape):
            raise FutureMapError(
                f"spec.extra[{f.name}]: shape must hold ints >= 1 (a tuple), got {f.shape!r}"
            )
        shape = tuple(int(d) for d in f.shape)
        if not isinstance(f.consumed, bool) or not isinstance(f.bits, bool):
            raise FutureMapError(f"spec.extra[{f.name}]: consumed and bits must be bools")
        try:
            dt = None if f.dtype is None else np.dtype(f.dtype)
        except TypeError:
            raise FutureMapError(f"spec.extra[{f.name}]: dtype {f.dtype!r} is not one") from None
        if dt is not None and not storable(dt):
            raise FutureMapError(
                f"spec.extra[{f.name}]: dtype {dt} is not a numeric one a buffer stores (bool, "
                "ints, floats up to 64 bits, complex, bfloat16, the float8s)"
            )
        if dt is not None and jax.dtypes.canonicalize_dtype(dt) != dt:
            raise FutureMapError(
                f"spec.extra[{f.name}]: dtype {dt} needs JAX's x64 mode, which is off: no "
                "stash could store it"
            )
        if f.consumed and dt is not None and dt.kind != "i":
            raise FutureMapError(
                f"spec.extra[{f.name}]: a consumed field is a signed int (poison -1), got {dt}"
            )
        # bits (deprecated, no effect) was only ever meaningful on a real float: bfloat16 is
        # one whose numpy kind is 'V'; a complex value is two floats.
        if f.bits and (dt is None or not jnp.issubdtype(dt, jnp.floating)):
            raise FutureMapError(
                f"spec.extra[{f.name}]: bits=True stores a real float's bits, got "
                f"{'the map int' if dt is None else dt}"
            )
        out.append(f._replace(shape=shape, dtype=dt))
    return tuple(out)


def element_dtype(field: RelayField, int_dtype: np.dtype) -> np.dtype:
    """The dtype of the field's values (as stashed and resolved)."""
    return int_dtype if field.dtype is None else np.dtype(field.dtype)


def buffer_dtype(field: RelayField, int_dtype: np.dtype) -> np.dtype:
    """The dtype of the field's buffer: its values' dtype, or their bits (`stored_as_bits`)."""
    dt = element_dtype(field, int_dtype)
    return bits_dtype(dt) if stored_as_bits(field) else dt


def to_buffer(field: RelayField, x: jax.Array) -> jax.Array:
    """Values (of the field's dtype) as the buffer stores them."""
    return jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype)) if stored_as_bits(field) else x


def from_buffer(field: RelayField, x: jax.Array, int_dtype: np.dtype) -> jax.Array:
    """Gathered buffer rows as the field's values."""
    if not stored_as_bits(field):
        return x
    return jax.lax.bitcast_convert_type(x, element_dtype(field, int_dtype))


def get(holder: Any, name: str) -> Any:
    """A field's entry in a FutureMapState or DraftPayload (None when absent); the bonus
    tokens of a state are its `output_tokens`."""
    if name == "bonus_tokens" and hasattr(holder, "output_tokens"):
        return holder.output_tokens
    if name in STANDARD:
        return getattr(holder, name)
    return (holder.extras or {}).get(name)


def put(holder: Any, name: str, value: Any) -> Any:
    """`holder` with the field's entry replaced."""
    if name == "bonus_tokens" and hasattr(holder, "output_tokens"):
        return holder._replace(output_tokens=value)
    if name in STANDARD:
        return holder._replace(**{name: value})
    return holder._replace(extras={**(holder.extras or {}), name: value})


def check_declared(fields: tuple[RelayField, ...], draft: Any) -> None:
    """FutureMapError if `draft` (a DraftPayload) gives a field the spec does not declare:
    every value given is relayed, none is dropped."""
    names = {f.name for f in fields}
    if draft.extras is not None and not isinstance(draft.extras, Mapping):
        raise FutureMapError(
            f"draft.extras must be a mapping field name -> rows, got {type(draft.extras).__name__}"
        )
    if draft.hidden_states is not None and "hidden_states" not in names:
        raise FutureMapError("draft.hidden_states given but spec declares hidden=0")
    for name in ("bonus_tokens", "verified_id", "topk_p", "topk_index"):
        if getattr(draft, name) is not None and name not in names:
            raise FutureMapError(f"draft.{name} given but spec does not declare it")
    for name in draft.extras or {}:
        if name not in names or name in STANDARD:
            raise FutureMapError(f"draft.extras[{name!r}] is not a field the spec declares")


def carried(fields: tuple[RelayField, ...], draft: Any) -> tuple[RelayField, ...]:
    """The declared fields a draft stash writes: those `draft` gives, in stash order (a
    partial stash keeps the others' rows as they were). FutureMapError if it leaves out a
    consume-tracked field (every draft gather consumes each), gives one of `topk_p` and
    `topk_index` without the other, or gives no field at all."""
    out = []
    for f in fields:
        if get(draft, f.name) is not None:
            out.append(f)
        elif f.consumed:
            raise errors.tracked_field_missing(f.name)
    for given, missing in (("topk_p", "topk_index"), ("topk_index", "topk_p")):
        if getattr(draft, given) is not None and getattr(draft, missing) is None:
            raise errors.topk_half(given, missing)
    if not out:
        raise errors.empty_draft()
    return tuple(out)


def optional(fields: tuple[RelayField, ...]) -> tuple[str, ...]:
    """The names of the fields a draft stash may leave out: every field not
    consume-tracked."""
    return tuple(f.name for f in fields if not f.consumed)
