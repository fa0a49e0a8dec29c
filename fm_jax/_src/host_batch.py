"""A batch placed by the general path: every field checked and padded, its key worked out.

What `Placement` does with a batch the first time its layout is seen (and every time for a
layout no plan takes: a mapping of DP ranks, lists, a plain int mode). Sizes come from
the buckets (`buckets.resolve_sizes`), forms and values from `HostInputs`, the rules that
differ between the protocols from the map's `Protocol`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax._src import packing, refusals
from fm_jax._src.errors import FutureMapError
from fm_jax._src.host_inputs import HostInputs, Rows
from fm_jax._src.keys import Key
from fm_jax._src.plans import Placed
from fm_jax._src.protocol import Protocol
from fm_jax._src.types import Batch, ForwardMode, SpecConfig, host_mode


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


class BatchPlacement:
    """The general path of one map: its host inputs, protocol and spec."""

    def __init__(self, inputs: HostInputs, protocol: Protocol, spec: SpecConfig | None) -> None:
        self.inputs = inputs
        self.protocol = protocol
        self.spec = spec
        self.dp = inputs.dp

    def place(
        self,
        batch: Batch | Mapping[int, Batch],
        rows: int | None,
        tokens: int | None,
        step: Sequence[StepInput] | None,
        inputs: Mapping[str, Any] | None,
        packed: Callable[[Key, tuple[Any, ...], Rows], Placed],
    ) -> Placed:
        """A batch checked by value and padded to buckets, its key; a class resolve's
        arguments handed to `packed` (which packs them where the map packs), an engine
        step's (with its declared `inputs`) packed with their device leaves beside."""
        if isinstance(batch, Mapping):
            mode, idx, ids, lens, draft, slots = self._by_rank(batch, rows, tokens)
        elif not isinstance(batch, Batch):
            raise FutureMapError(
                f"resolve takes a Batch or a mapping DP rank -> Batch, got {batch!r}"
            )
        else:
            mode, idx, ids, lens, draft, slots = self._one_batch(batch, rows, tokens)
        key, mode = self._mode_key(mode, idx, ids, slots, exact=step is not None)
        draft_idx = self._draft(draft, idx)
        placed_batch = Batch(
            mode, idx.array, None if ids is None else ids.array, lens, draft_idx, slots
        )
        t = idx.size if ids is None else ids.size
        key = key._replace(
            rows=idx.size,
            tokens=t,
            draft=draft is not None,
            slots=slots is not None,
            ids=ids is not None,
        )
        if step is None:
            return packed(key, (placed_batch,), idx)
        host = self._step_inputs(step, inputs, idx, ids)
        spec, buf, device = packing.pack((placed_batch, host))
        return Placed(key._replace(op="step"), (buf, device), spec, idx)

    def _one_batch(self, batch: Batch, rows: int | None, tokens: int | None) -> tuple[Any, ...]:
        inputs, protocol = self.inputs, self.protocol
        if protocol.places_no_ids(batch.forward_mode) and (
            batch.input_ids is None or self.spec is None
        ):
            # No ids to place (T = B): a non-spec DECODE's are all gathered on the device, a
            # spec DECODE's are unused by the relay (None: zeros, made on the device).
            if batch.input_ids is not None:
                raise refusals.ids_for_gathered_decode()
            if batch.token_slots is not None:
                protocol.check_kinds([ForwardMode.DECODE], batch.token_slots)
            idx = inputs.slots("req_pool_indices", batch.req_pool_indices, rows)
            lens = inputs.matched("seq_lens", batch.seq_lens, idx)
            return batch.forward_mode, idx, None, lens, batch.draft_indices, None
        given = protocol.ids_of(
            batch.input_ids, batch.req_pool_indices, batch.forward_mode, inputs.dtype
        )
        rows, tokens = self.inputs.resolve_sizes(batch.req_pool_indices, given, rows, tokens)
        idx = inputs.slots("req_pool_indices", batch.req_pool_indices, rows)
        ids = inputs.token_ids("input_ids", given, tokens)
        lens = inputs.matched("seq_lens", batch.seq_lens, idx)
        slots = self._token_slots(batch.token_slots, ids)
        return batch.forward_mode, idx, ids, lens, batch.draft_indices, slots

    def _by_rank(
        self, batches: Mapping[int, Batch], rows: int | None, tokens: int | None
    ) -> tuple[Any, ...]:
        inputs, protocol, dt = self.inputs, self.protocol, self.inputs.dtype
        for r, b in batches.items():
            if not isinstance(b, Batch):
                raise FutureMapError(f"batch[rank {r}] must be a Batch, got {type(b).__name__}")
        field = lambda f: {r: getattr(b, f) for r, b in batches.items()}  # noqa: E731
        given = {
            r: protocol.ids_of(
                b.input_ids, b.req_pool_indices, b.forward_mode, dt, f"batch[rank {r}]."
            )
            for r, b in batches.items()
        }
        rows, tokens = self.inputs.resolve_sizes(field("req_pool_indices"), given, rows, tokens)
        idx = inputs.slots("req_pool_indices", field("req_pool_indices"), rows)
        ids = inputs.token_ids("input_ids", given, tokens)
        lens = inputs.matched("seq_lens", field("seq_lens"), idx)
        modes = np.full(self.dp, int(ForwardMode.IDLE), np.int32)
        for r, b in batches.items():
            modes[int(r)] = host_mode(b.forward_mode, f"batch[rank {r}].forward_mode")
            if b.input_ids is not None and self.spec is None and protocol.places_no_ids(modes[r]):
                raise refusals.ids_for_gathered_decode(f"batch[rank {r}].")
        drafts = {r: d for r, d in field("draft_indices").items() if d is not None}
        if drafts and self.spec is None:
            raise refusals.draft_indices_on_plain_map()
        for r in batches:
            if drafts and r not in drafts and modes[int(r)] == ForwardMode.DECODE:
                raise FutureMapError(
                    f"batch[rank {r}].draft_indices missing: beside ranks with a draft input "
                    "a spec DECODE rank brings its own (its lengths are gathered at them)"
                )
        if drafts:  # a rank without a draft input reads padding slot 0 (garbage, unused)
            drafts = {
                r: drafts.get(r, np.zeros(len(b.req_pool_indices), dt)) for r, b in batches.items()
            }
        given_slots = {r: s for r, s in field("token_slots").items() if s is not None}
        for r in batches:  # each rank by the one-batch rule, before the slots are placed
            where = f"batch[rank {r}]."
            protocol.check_kinds([ForwardMode(modes[int(r)])], given_slots.get(r), where)
        slots = None
        if given_slots and ForwardMode.MIXED in modes:
            # Ranks without token slots (not MIXED) gather nothing: all 0, 'keep the id'.
            # Without a MIXED rank every slot given is 0: there is nothing to gather.
            full = {r: given_slots.get(r, np.zeros(len(given[r]), dt)) for r in batches}
            slots = self._token_slots(full, ids)
        return modes, idx, ids, lens, drafts or None, slots

    def _mode_key(
        self, mode: Any, idx: Rows, ids: Rows | None, slots: Any, *, exact: bool
    ) -> tuple[Key, Any]:
        """The resolve's key (its mode) and the mode the executable takes (None: fixed);
        the protocol's rules for modes known on the host. `exact` (an engine step, whose
        forward sees the mode): one executable per mode, not per kind."""
        protocol = self.protocol
        if isinstance(mode, jax.Array):
            if mode.dtype != np.int32 or mode.shape not in ((), (self.dp,)):
                raise FutureMapError(
                    f"a traced forward_mode must be int32 of shape () or ({self.dp},), "
                    f"got {mode.dtype}{list(mode.shape)}"
                )
            return Key("resolve", 0, mode="traced"), mode  # rows not checked against it
        if type(mode) is ForwardMode:  # the per-step case: one mode known on the host
            modes = [mode]
        elif isinstance(mode, np.ndarray) and mode.ndim == 1:
            modes = [host_mode(m, "forward_mode") for m in mode.tolist()]
        else:
            modes = [host_mode(mode, "forward_mode")]
        protocol.check_modes(self.spec, modes, idx.array, slots)
        decoding = [m == ForwardMode.DECODE for m in modes]
        if ids is not None and protocol.checks_ids_per_row(self.spec):
            self.inputs.one_id_per_row(ids, idx, decoding)
        if exact:
            kinds: set[Any] = set(modes)
        else:
            kinds = {m == ForwardMode.DECODE for m in modes if m != ForwardMode.IDLE}
        if len(kinds) > 1:  # ranks differ: one executable with the modes traced
            return Key("resolve", 0, mode="traced"), np.asarray(modes, np.int32)
        if exact:
            return Key("resolve", 0, mode=ForwardMode(modes[0]).name.lower()), None
        # Known on the host: an executable with the mode fixed (no branch inside).
        return Key("resolve", 0, mode="decode" if kinds == {True} else "extend"), None

    def _draft(self, draft: Any, idx: Rows) -> Any:
        """A spec batch's draft slots, one per row, placed like its slots."""
        if draft is None:
            return None
        if self.spec is None:
            raise refusals.draft_indices_on_plain_map()
        placed = self.inputs.slots("draft_indices", draft, idx.size)
        if None not in (placed.counts, idx.counts) and placed.counts != idx.counts:
            raise FutureMapError(
                f"draft_indices has {placed.counts} rows per rank, req_pool_indices "
                f"{idx.counts}: one draft slot per row"
            )
        return placed.array

    def _token_slots(self, x: Any, ids: Rows) -> Any:
        """A MIXED batch's token slots (gather protocol) placed like its input ids."""
        if x is None:
            return None
        if not self.protocol.takes_token_slots:
            raise refusals.token_slots_in_sentinel_protocol()
        return self.inputs.token_slots("token_slots", x, ids).array

    def _step_inputs(
        self,
        declared: Sequence[StepInput],
        given: Mapping[str, Any] | None,
        idx: Rows,
        ids: Rows | None,
    ) -> dict[str, Any]:
        """The engine's declared inputs padded like the batch's rows (`idx`) or tokens."""
        given = {} if given is None else given
        if not isinstance(given, Mapping):
            raise FutureMapError(
                f"inputs must be a mapping name -> array, got {type(given).__name__}"
            )
        names = {d.name for d in declared}
        if set(given) != names:
            missing, extra = sorted(names - set(given)), sorted(set(given) - names)
            raise FutureMapError(
                f"inputs must be exactly the declared StepInputs: missing {missing}, "
                f"undeclared {extra}"
            )
        out = {}
        for d in declared:
            like = idx if d.per == "row" or ids is None else ids
            x, name = given[d.name], f"inputs[{d.name!r}]"
            if isinstance(x, jax.Array):
                if x.dtype != d.dtype or x.shape[1:] != d.shape:
                    raise FutureMapError(
                        f"{name} is {x.dtype}{list(x.shape)}, declared {d.dtype} rows of "
                        f"shape {list(d.shape)}"
                    )
            elif not isinstance(x, Mapping):
                x = self.inputs.declared(name, x, d.shape, d.dtype)
            else:
                x = {
                    r: self.inputs.declared(f"{name}[rank {r}]", v, d.shape, d.dtype)
                    for r, v in x.items()
                }
            out[d.name] = self.inputs.matched(name, x, like, d.dtype, per=d.per)
        return out
