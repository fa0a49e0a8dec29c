"""The relayed fields' rules: a SpecConfig checked, how each field is stored (its values,
or a real float's raw bits), where it lives in a state or a draft, and which fields a
draft stash writes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax.ops import errors
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.types import HIDDEN_DTYPES, KERNELS, STANDARD, DraftPayload, RelayField, SpecConfig


def storable(dtype: np.dtype) -> bool:
    """Whether a buffer holds values of `dtype`: bool, ints, floats up to 64 bits, complex
    up to 128, and JAX's whole-byte floats (bfloat16, the float8s)."""
    if dtype.kind in "biu":
        return True
    if dtype.kind in "fc":
        return dtype.itemsize <= (8 if dtype.kind == "f" else 16)
    if dtype.kind == "V" and dtype.fields is None and jnp.issubdtype(dtype, jnp.floating):
        return int(jnp.finfo(dtype).bits) == 8 * dtype.itemsize
    return False


def stored_as_bits(field: RelayField) -> bool:
    """Whether the field's buffer holds its values' raw bits: every real float's, so NaN
    payloads and -0.0 survive (XLA:CPU scatters bfloat16 in f32, rewriting NaNs)."""
    return field.dtype is not None and bool(jnp.issubdtype(field.dtype, jnp.floating))


def count_at_least(x: Any, low: int) -> bool:
    """`x` is an int (not a bool) >= low."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_) and bool(x >= low)


def check_extra(fields: tuple[Any, ...]) -> tuple[RelayField, ...]:
    """An engine's own fields, normalised (dtype a numpy dtype or None), or FutureMapError."""
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
    """The dtype of the field's buffer: its values', or the unsigned int of their width
    that holds their bits (`stored_as_bits`)."""
    dt = element_dtype(field, int_dtype)
    return np.dtype(f"uint{dt.itemsize * 8}") if stored_as_bits(field) else dt


def to_buffer(field: RelayField, x: jax.Array, int_dtype: np.dtype) -> jax.Array:
    """Values (of the field's dtype) as the buffer stores them."""
    if not stored_as_bits(field):
        return x
    return jax.lax.bitcast_convert_type(x, buffer_dtype(field, int_dtype))


def from_buffer(field: RelayField, x: jax.Array, int_dtype: np.dtype) -> jax.Array:
    """Gathered buffer rows as the field's values."""
    if not stored_as_bits(field):
        return x
    return jax.lax.bitcast_convert_type(x, element_dtype(field, int_dtype))


def get(holder: Any, name: str) -> Any:
    """A field's entry in a FutureMapState or DraftPayload (None when absent)."""
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


def carried(fields: tuple[RelayField, ...], draft: DraftPayload) -> tuple[RelayField, ...]:
    """The declared fields a draft stash writes, in stash order (a partial stash keeps the
    others' rows); FutureMapError if it leaves out a consume-tracked field or half of top-k."""
    out = []
    for f in fields:
        if get(draft, f.name) is not None:
            out.append(f)
        elif f.consumed:
            raise FutureMapError(
                f"draft.{f.name} is missing: a consume-tracked field, which every draft stash "
                "writes (each draft gather consumes it)"
            )
    for given, missing in (("topk_p", "topk_index"), ("topk_index", "topk_p")):
        if getattr(draft, given) is not None and getattr(draft, missing) is None:
            raise FutureMapError(f"draft.{given} given without draft.{missing}: top-k comes whole")
    if not out:
        raise FutureMapError("the draft stashed relays no field")
    return tuple(out)


def optional(fields: tuple[RelayField, ...]) -> tuple[str, ...]:
    """The fields a draft stash may leave out: those not consume-tracked."""
    return tuple(f.name for f in fields if not f.consumed)


def check_spec(spec: Any) -> SpecConfig:
    """A SpecConfig normalised (numpy dtypes, a tuple of fields), or FutureMapError naming
    what no map could serve."""
    if not isinstance(spec, SpecConfig):
        raise FutureMapError(f"spec must be a SpecConfig or None, got {spec!r}")
    if not count_at_least(spec.topk, 0) or not count_at_least(spec.hidden, 0):
        raise FutureMapError(f"spec needs topk >= 0 and hidden >= 0 (ints), got {spec}")
    if not count_at_least(spec.confidence, 0):
        raise FutureMapError(f"spec.confidence must be an int >= 0, got {spec.confidence!r}")
    try:
        hidden_dtype = np.dtype(spec.hidden_dtype)
    except TypeError:
        hidden_dtype = None
    if hidden_dtype not in HIDDEN_DTYPES:
        raise FutureMapError(f"spec.hidden_dtype must be bf16, f16 or f32, got {spec.hidden_dtype}")
    for flag in ("verified_id", "bonus_tokens"):  # a bool, or an int 0 / 1 for one
        value = getattr(spec, flag)
        if not isinstance(value, bool | np.bool_) and value not in (0, 1):
            raise FutureMapError(f"spec.{flag} must be a bool, got {value!r}")
    if isinstance(spec.extra, str | bytes | RelayField) or not isinstance(spec.extra, tuple | list):
        raise FutureMapError(f"spec.extra must be a tuple of RelayFields, got {spec.extra!r}")
    extra = check_extra(tuple(spec.extra))
    if not isinstance(spec.kernel, str) or spec.kernel not in KERNELS:
        raise FutureMapError(f"spec.kernel must be one of {KERNELS}, got {spec.kernel!r}")
    out = spec._replace(
        topk=int(spec.topk),
        hidden=int(spec.hidden),
        hidden_dtype=hidden_dtype,
        verified_id=bool(spec.verified_id),
        bonus_tokens=bool(spec.bonus_tokens),
        extra=extra,
        confidence=int(spec.confidence),
    )
    if not out.fields():
        raise FutureMapError(f"spec declares no field to relay: {spec}")
    for f in out.fields() if out.kernel == "pallas" else ():
        # Triton loads no bool or complex, and XLA bitcasts them to no unsigned int.
        if f.dtype is not None and np.dtype(f.dtype).kind in ("b", "c"):
            raise FutureMapError(
                f"spec.kernel='pallas' moves real numbers and ints; field {f.name} is "
                f"{f.dtype} (use kernel='xla')"
            )
    return out


def draft_payload(values: Mapping[str, Any]) -> DraftPayload:
    """A DraftPayload of fields by name (the engine's own in `extras`)."""
    extras = {k: v for k, v in values.items() if k not in STANDARD}
    return DraftPayload(**{k: values.get(k) for k in STANDARD}, extras=extras or None)


def payload_rows(spec: SpecConfig | None, payload: Any) -> list[tuple[str, Any]]:
    """Stash's payload by name once its kind is checked: `tokens`, or each declared field
    of a DraftPayload as `draft.<name>` (None where not given); FutureMapError if a draft
    gives a field the spec does not declare."""
    if spec is None:
        if isinstance(payload, DraftPayload):
            raise FutureMapError("stash got a DraftPayload but the map was built without spec")
        if payload is None:
            raise FutureMapError("tokens is missing: stash on a map without spec takes [B] ints")
        return [("tokens", payload)]
    if not isinstance(payload, DraftPayload):
        raise errors.tokens_on_spec_map()
    fields = spec.fields()
    names = {f.name for f in fields}  # every value given is relayed, none dropped
    if payload.extras is not None and not isinstance(payload.extras, Mapping):
        raise FutureMapError(
            "draft.extras must be a mapping field name -> rows, got "
            f"{type(payload.extras).__name__}"
        )
    if payload.hidden_states is not None and "hidden_states" not in names:
        raise FutureMapError("draft.hidden_states given but spec declares hidden=0")
    for name in ("bonus_tokens", "verified_id", "topk_p", "topk_index"):
        if getattr(payload, name) is not None and name not in names:
            raise FutureMapError(f"draft.{name} given but spec does not declare it")
    for name in payload.extras or {}:
        if name not in names or name in STANDARD:
            raise FutureMapError(f"draft.extras[{name!r}] is not a field the spec declares")
    return [(f"draft.{f.name}", get(payload, f.name)) for f in fields]
