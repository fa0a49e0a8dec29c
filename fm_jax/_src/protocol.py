"""The two relay protocols as objects: every rule that differs between them, in one place.

docs/CONTRACT.md, 'Two protocols'. In the sentinel protocol the host leaves `-slot`
placeholders in the next batch (`invalidate`, or the third write of `finish`) and resolve
fills them; in the gather protocol the host leaves nothing: resolve gathers a DECODE
batch's ids at its slots, and a MIXED batch's running rows' ids at its `token_slots`.

A `Protocol` answers what the host path asks (which ids a batch brings, which values its
ids may take, what its token slots must be), what the tail of a step leaves (sentinels or
nothing), and which resolve variants warm-up compiles. `parse_protocol` turns the public
string into one of the two objects, once, where a map is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax._src import refusals, resolve_ops
from fm_jax._src.errors import FutureMapError
from fm_jax._src.types import ForwardMode, SpecConfig, host_mode

PROTOCOLS = ("sentinel", "gather")
"""The relay protocols' public names."""

Modes = Sequence[ForwardMode]
"""Forward modes known on the host: one per DP rank, or one for every rank."""


class Protocol:
    """A relay protocol: the host's rules, the tail's output and the warm-up variants.

    Attributes (the rules as data):
      name: 'sentinel' or 'gather', as the public API spells it.
      invalidates: the tail leaves -slot sentinels that resolve fills; a batch always
        brings ids.
      gathers_decode_ids: resolve gathers a DECODE batch's ids at its slots: a non-spec
        DECODE batch brings none, and only a DECODE batch known on the host may.
      takes_token_slots: a MIXED batch names its running rows' slots per token
        (`token_slots`) instead of carrying sentinels in its ids.
      serves_spec_mixed: a spec map serves MIXED batches (resolve binds their running
        rows' lengths).
    """

    name: str = ""
    invalidates = False
    gathers_decode_ids = False
    takes_token_slots = False
    serves_spec_mixed = False

    def __repr__(self) -> str:
        return f"Protocol({self.name!r})"

    # ------------------------------------------------------------------ host rules
    def check_ids(self, name: str, ids: np.ndarray, pool_size: int) -> None:
        """Host token ids by value (the rule of what an id may be in this protocol)."""
        raise NotImplementedError

    def ids_of(self, ids: Any, rows: Any, mode: Any, dtype: np.dtype, where: str = "") -> Any:
        """A batch's input ids as placement takes them (`rows`: its slots, for a count)."""
        return ids

    def places_no_ids(self, mode: Any) -> bool:
        """A batch of host mode `mode` that places no ids (they are gathered): T = B."""
        return False

    def check_kinds(self, modes: Modes, token_slots: Any, where: str = "") -> None:
        """Modes known on the host (one per rank) against the batch's token slots."""

    def check_modes(self, spec: SpecConfig | None, modes: Modes, idx: Any, slots: Any) -> None:
        """Every rule on a batch whose modes are known on the host (one per rank): its token
        slots against its kinds (`check_kinds`), and a spec map's MIXED batch
        (`check_spec_mixed`)."""
        self.check_kinds(modes, slots)
        self.check_spec_mixed(spec, modes, idx, slots)

    def check_spec_mixed(self, spec: SpecConfig | None, modes: Modes, idx: Any, slots: Any) -> None:
        """A spec map's MIXED batch, modes known on the host."""
        if spec is not None and ForwardMode.MIXED in modes:
            raise refusals.spec_mixed_in_sentinel_protocol()

    def checks_ids_per_row(self, spec: SpecConfig | None) -> bool:
        """A non-spec DECODE batch's ids are one per row, checked on the host."""
        return False

    # ------------------------------------------------------------------ the device
    def resolve(self, cfg: Any, state: Any, batch: Any, idx: jax.Array, mode: Any, chk: Any) -> Any:
        """Inside jit, after resolve's common head (`ops.resolve`): fill the batch's inputs
        from the buffers as this protocol does (`resolve_ops`); (state, Resolved)."""
        raise NotImplementedError

    def sentinels(self, indices: jax.Array) -> jax.Array | None:
        """Inside a step's tail: what the next batch's ids and lengths become (None: the
        batch is left as it is)."""
        return None

    def next_batch(self, batch: Any, sentinels: Any) -> Any:
        """The batch the host schedules next, after the tail left `sentinels`."""
        return batch

    # ------------------------------------------------------------------ warm-up
    def resolve_variants(
        self, spec: SpecConfig | None, tokens: int, decode_tokens: int, traced: bool
    ) -> list[tuple[str, bool]]:
        """The (resolve mode, with token slots) pairs serving reaches at a token bucket:
        mode 'extend' (fixed, not DECODE), 'decode' (fixed DECODE) or 'traced'."""
        raise NotImplementedError

    def step_modes(self, spec: SpecConfig | None, with_slots: bool) -> list[ForwardMode]:
        """The modes an engine step (whose forward sees its mode) serves where a resolve's
        variant is 'extend': every mode that is not DECODE and that this protocol takes
        with (or without) token slots."""
        raise NotImplementedError


class _Sentinel(Protocol):
    name = "sentinel"
    invalidates = True

    def resolve(self, cfg: Any, state: Any, batch: Any, idx: jax.Array, mode: Any, chk: Any) -> Any:
        return resolve_ops.resolve_sentinel(cfg, state, batch, idx, mode, chk)

    def check_ids(self, name: str, ids: np.ndarray, pool_size: int) -> None:
        """A sentinel -s names a slot s in [0, R)."""
        if ids.size and ids.min() <= -pool_size:
            raise FutureMapError(
                f"{name} holds sentinels {ids[ids <= -pool_size].tolist()} naming slots "
                f"outside [0, {pool_size})"
            )

    def check_kinds(self, modes: Modes, token_slots: Any, where: str = "") -> None:
        if token_slots is not None:
            raise refusals.token_slots_in_sentinel_protocol(where or "batch.")

    def checks_ids_per_row(self, spec: SpecConfig | None) -> bool:
        return spec is None

    def sentinels(self, indices: jax.Array) -> jax.Array:
        return -jnp.asarray(indices)

    def next_batch(self, batch: Any, sentinels: Any) -> Any:
        b = batch  # rebuilt field by field: NamedTuple._replace costs ~1 us a step
        return type(b)(b.forward_mode, b.req_pool_indices, sentinels, sentinels, *b[4:])

    def resolve_variants(
        self, spec: SpecConfig | None, tokens: int, decode_tokens: int, traced: bool
    ) -> list[tuple[str, bool]]:
        # A non-spec decode row is one token: DECODE only up to the largest batch's tokens.
        out = [("extend", False)]
        if spec is not None or tokens <= decode_tokens:
            out.append(("decode", False))
        return out + ([("traced", False)] if traced else [])

    def step_modes(self, spec: SpecConfig | None, with_slots: bool) -> list[ForwardMode]:
        mixed = [ForwardMode.MIXED] if spec is None else []  # a spec MIXED is refused
        return [ForwardMode.EXTEND, *mixed, ForwardMode.IDLE]


class _Gather(Protocol):
    name = "gather"
    gathers_decode_ids = True
    takes_token_slots = True
    serves_spec_mixed = True

    def resolve(self, cfg: Any, state: Any, batch: Any, idx: jax.Array, mode: Any, chk: Any) -> Any:
        return resolve_ops.resolve_gather(cfg, state, batch, idx, mode, chk)

    def check_ids(self, name: str, ids: np.ndarray, pool_size: int) -> None:
        """No sentinels: every id is >= 0 (a decode row's id is gathered at its slot)."""
        if ids.size and ids.min() < 0:
            raise FutureMapError(
                f"{name} holds negative ids {ids[ids < 0][:8].tolist()}: the gather protocol "
                "has no sentinels (a decode row's id is gathered at its slot)"
            )

    def places_no_ids(self, mode: Any) -> bool:
        if type(mode) is ForwardMode:
            return mode is ForwardMode.DECODE
        return (
            isinstance(mode, int | np.integer)
            and not isinstance(mode, bool | np.bool_)
            and int(mode) == ForwardMode.DECODE
        )

    def ids_of(self, ids: Any, rows: Any, mode: Any, dtype: np.dtype, where: str = "") -> Any:
        """Only a DECODE batch known on the host comes without ids (a DECODE rank's in a
        mapping: zeros, one per row, never read); any other batch without ids is refused,
        a traced mode's included (its kind is known only on the device)."""
        if ids is not None:
            return ids
        if isinstance(mode, jax.Array):
            raise refusals.no_ids_with_traced_mode(where)
        if isinstance(mode, np.ndarray) and mode.ndim == 1:  # one per rank: idle ones too
            kinds = {host_mode(m, f"{where}forward_mode") for m in mode.tolist()}
            kinds -= {ForwardMode.IDLE}
        else:
            kinds = {host_mode(mode, f"{where}forward_mode")}
        if kinds - {ForwardMode.DECODE}:
            raise refusals.no_ids_for_kind("/".join(sorted(k.name for k in kinds)), where)
        try:
            return np.zeros(len(rows), dtype)
        except TypeError:
            return ids  # not an array: placing the slots names it

    def check_kinds(self, modes: Modes, token_slots: Any, where: str = "") -> None:
        """A MIXED batch brings token slots, a DECODE batch none (it gathers at its
        req_pool_indices), and slots given without a MIXED rank are all 0."""
        if token_slots is None and ForwardMode.MIXED in modes:
            raise refusals.mixed_without_token_slots(where)
        if token_slots is not None and list(modes) == [ForwardMode.DECODE]:
            raise refusals.token_slots_for_decode(where)
        if (
            token_slots is not None
            and ForwardMode.MIXED not in modes
            and not _all_zero(token_slots)
        ):
            kinds = "/".join(sorted({ForwardMode(m).name for m in modes}))
            raise FutureMapError(
                f"{where}token_slots of a batch of kind {kinds} name slots (or are a jax "
                "array, not read here): only a MIXED batch has running rows to gather"
            )

    def check_spec_mixed(self, spec: SpecConfig | None, modes: Modes, idx: Any, slots: Any) -> None:
        """Host arrays: each MIXED rank's running rows are its last live rows in token-slot
        order, as resolve binds their lengths there."""
        if spec is None or ForwardMode.MIXED not in modes:
            return
        if isinstance(idx, jax.Array) or isinstance(slots, jax.Array) or slots is None:
            return  # device arrays: debug checks the order ('batch fields')
        rows = np.asarray(idx).reshape(len(modes), -1)
        toks = np.asarray(slots).reshape(len(modes), -1)
        for r, m in enumerate(modes):
            if m != ForwardMode.MIXED:
                continue
            running = toks[r][toks[r] > 0]
            live = rows[r][rows[r] > 0]
            tail = live[len(live) - len(running) :]
            if len(running) > len(live) or not np.array_equal(tail, running):
                where = f"batch[rank {r}]." if len(modes) > 1 else "batch."
                raise FutureMapError(
                    f"{where}token_slots name running slots {running.tolist()}, but the "
                    f"batch's last live rows hold {tail.tolist()}: a spec MIXED batch lists "
                    "its running rows last, one per nonzero token slot, in that order"
                )

    def resolve_variants(
        self, spec: SpecConfig | None, tokens: int, decode_tokens: int, traced: bool
    ) -> list[tuple[str, bool]]:
        # A MIXED batch (not DECODE, or traced) brings token slots; a non-spec DECODE
        # places no ids (its own variant, per batch bucket).
        out = [("extend", False), ("extend", True)]
        if spec is not None:
            out.append(("decode", False))
        return out + ([("traced", False), ("traced", True)] if traced else [])

    def step_modes(self, spec: SpecConfig | None, with_slots: bool) -> list[ForwardMode]:
        # Token slots come with a MIXED batch, and only with one.
        return [ForwardMode.MIXED] if with_slots else [ForwardMode.EXTEND, ForwardMode.IDLE]


SENTINEL: Protocol = _Sentinel()
GATHER: Protocol = _Gather()
_BY_NAME = {p.name: p for p in (SENTINEL, GATHER)}


def parse_protocol(protocol: object) -> Protocol:
    """The Protocol named `protocol` (or `protocol` itself); FutureMapError otherwise."""
    if isinstance(protocol, Protocol):
        return protocol
    found = _BY_NAME.get(protocol) if isinstance(protocol, str) else None
    if found is None:
        raise FutureMapError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    return found


def _all_zero(slots: Any) -> bool:
    """Host token slots that gather nothing (a jax array is not read: False)."""
    if isinstance(slots, jax.Array):
        return False
    try:
        return not np.any(np.asarray(slots))
    except (TypeError, ValueError):
        return False  # not an array: placing it names the field
