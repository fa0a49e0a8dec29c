"""A batch's placement decided, in one direction: as given, ruled, sized, keyed.

What `Placement` does with a batch whose layout it has not decided before (and every time
for a call with no layout: a mapping of DP ranks, lists, a plain int mode):
1. the batch as given (`Given`): each part's fields, its forward modes parsed once;
2. the protocol's rules on that layout, asked once (`Protocol.rules`): what it refuses,
   and what it leaves to the values (`validate.batch_values`, run with the decision);
3. its sizes (`buckets.resolve_sizes`: one pair per token bucket), then every field's
   `HostInputs` decision (forms, shapes, counts, its placer);
4. its key: the mode (one executable per kind; an engine step's, per mode) and sizes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.host.buckets import resolve_sizes
from fm_jax.host.decisions import Decision, Field, Key, constant
from fm_jax.host.host_inputs import HostInputs
from fm_jax.host.validate import StepInput, batch_values, given_inputs, one_id_per_row
from fm_jax.ops import errors
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import Part, Protocol, Rules
from fm_jax.ops.relay_fields import SpecConfig
from fm_jax.ops.types import Batch, ForwardMode, host_mode


class Given(NamedTuple):
    """A batch as its caller gave it, its forward modes parsed (`BatchPlacement.given`).

    Attributes:
      parts: the batch, or each DP rank's batch of a mapping, as its protocol judges it.
      ranks: a mapping's ranks in order (one per part; () for an empty mapping, every
        rank idle); None for a Batch.
      traced: a traced forward_mode (an int32 jax array); None where modes are on the host.
      modes: the host modes: a Batch's (one, or one per DP rank), a mapping's one per rank.
      slots, ids, lens, draft, token_slots: the fields (a mapping's by rank; its drafts and
        token slots only of the ranks that give some).
    """

    parts: tuple[Part, ...]
    ranks: tuple[Any, ...] | None
    traced: Any
    modes: tuple[ForwardMode, ...]
    slots: Any
    ids: Any
    lens: Any
    draft: Any
    token_slots: Any


class BatchPlacement:
    """The general path of one map: its host inputs, protocol and spec."""

    def __init__(self, inputs: HostInputs, protocol: Protocol, spec: SpecConfig | None) -> None:
        self.inputs = inputs
        self.protocol = protocol
        self.spec = spec
        self.dp = inputs.dp

    def decide(
        self,
        batch: Batch | Mapping[int, Batch],
        rows: int | None,
        tokens: int | None,
        step: Sequence[StepInput] | None,
        inputs: Mapping[str, Any] | None,
    ) -> tuple[Decision, tuple[Any, ...]]:
        """The decision of a resolve (or, with `step` and its declared `inputs`, an engine
        step) from the batch's layout, and the values it places in decision order: the
        batch's fields, then the declared inputs (a mapping's filled for every rank).
        Every refusal of a form, shape, count or bucket is made here; the values' own
        checks are the decision's to run."""
        given = self.given(batch)
        rules = self.protocol.rules(self.spec, given.parts, by_rank=given.ranks is not None)
        ids = self._ids(given, rules)
        if ids is not None:
            rows, tokens = self._sizes(given.slots, ids, rows, tokens)
        modes = self._rank_modes(given)
        key, mode = self._mode_key(given.traced, modes, exact=step is not None)
        token_slots, draft = self._filled(given, ids)
        host = self.inputs
        idx = host.flat("req_pool_indices", given.slots, rows, slots=True)
        fid = None if ids is None else host.flat("input_ids", ids, tokens, slots=False)
        placers: list[Any] = [
            None if given.traced is not None else constant(mode),
            idx.place,
            None if fid is None else fid.place,
            host.matched("seq_lens", given.lens, idx),
            None,
            None,
        ]
        if given.ranks is None and ids is not given.ids:  # zeros, never read: placed once
            placers[2] = constant(None if fid is None else fid.rows(ids).array)
        if fid is not None and token_slots is not None:  # (a batch without ids has none)
            placers[5] = host.token_slots("token_slots", token_slots, fid).place
        if draft is not None:
            fdraft = host.flat("draft_indices", draft, idx.size, slots=True)
            if None not in (fdraft.counts, idx.counts) and fdraft.counts != idx.counts:
                raise FutureMapError(
                    f"draft_indices has {fdraft.counts} rows per rank, req_pool_indices "
                    f"{idx.counts}: one draft slot per row"
                )
            placers[4] = fdraft.place
        if fid is not None and given.traced is None:
            one_id_per_row(rules, modes, fid.counts, idx.counts)
        by_name = given_inputs(step, inputs) if step is not None else {}
        names = [d.name for d in step or ()]
        for d in step or ():
            like = idx if d.per == "row" or fid is None else fid
            placers.append(self._declared(d, by_name[d.name], like))
        key = key._replace(
            op="resolve" if step is None else "step",
            rows=idx.size,
            tokens=idx.size if fid is None else fid.size,
            draft=draft is not None,
            slots=fid is not None and token_slots is not None,
            ids=fid is not None,
        )
        check = None
        if rules.zero_slots or rules.mixed_order:
            parts = None if given.ranks is None else _part_slots(given)
            check = functools.partial(_batch_check, rules, modes, parts)

        def assemble(p: list[Any]) -> tuple[Any, ...]:
            b = Batch(*p[:6])
            return (b,) if step is None else (b, dict(zip(names, p[6:], strict=True)))

        decision = Decision(
            key,
            placers,
            assemble,
            idx=idx,
            idx_at=1,
            batch_check=check,
            packed=step is not None,
        )
        head = (
            None if given.ranks is not None else batch.forward_mode,  # type: ignore[union-attr]
            given.slots,
            ids,
            given.lens,
            draft,
            token_slots if given.ranks is not None else given.token_slots,
        )
        return decision, head + tuple(by_name[n] for n in names)

    def _declared(self, d: StepInput, x: Any, like: Field) -> Any:
        """The placer of an engine's declared input `x`: a jax array taken as it is (its
        dtype and shape checked), host rows (or a mapping of ranks) of the declared trailing
        shape, cast to its dtype where no value can change, laid out like `like`."""
        name = f"inputs[{d.name!r}]"
        if isinstance(x, jax.Array):
            if x.dtype != d.dtype or x.shape[1:] != d.shape:
                raise FutureMapError(
                    f"{name} is {x.dtype}{list(x.shape)}, declared {d.dtype} rows of "
                    f"shape {list(d.shape)}"
                )
        elif not isinstance(x, Mapping):
            self.inputs.declared(name, x, d.shape, d.dtype)
        else:
            for r, v in x.items():
                self.inputs.declared(f"{name}[rank {r}]", v, d.shape, d.dtype)
        return self.inputs.matched(name, x, like, d.dtype, per=d.per, cast=d.dtype)

    # ------------------------------------------------------------------ as given
    def given(self, batch: Batch | Mapping[int, Batch]) -> Given:
        """`batch` as given, its forward modes parsed: a Batch, or a mapping of ranks."""
        if isinstance(batch, Mapping):
            return self._by_rank(batch)
        if not isinstance(batch, Batch):
            raise FutureMapError(
                f"resolve takes a Batch or a mapping DP rank -> Batch, got {batch!r}"
            )
        mode, traced, scalar = batch.forward_mode, None, True
        modes: tuple[ForwardMode, ...] = ()
        if isinstance(mode, jax.Array):
            if mode.dtype != np.int32 or mode.shape not in ((), (self.dp,)):
                raise FutureMapError(
                    f"a traced forward_mode must be int32 of shape () or ({self.dp},), "
                    f"got {mode.dtype}{list(mode.shape)}"
                )
            traced = mode
        elif type(mode) is ForwardMode:  # the per-step case: one mode known on the host
            modes = (mode,)
        elif isinstance(mode, np.ndarray) and mode.ndim == 1:
            modes, scalar = tuple(host_mode(m, "forward_mode") for m in mode.tolist()), False
        else:
            modes = (host_mode(mode, "forward_mode"),)
        ids, token_slots = batch.input_ids, batch.token_slots
        part = Part(
            None if traced is not None else modes,
            scalar,
            ids is not None,
            token_slots is not None,
            "",
        )
        return Given(
            (part,),
            None,
            traced,
            modes,
            batch.req_pool_indices,
            ids,
            batch.seq_lens,
            batch.draft_indices,
            token_slots,
        )

    def _by_rank(self, batches: Mapping[int, Batch]) -> Given:
        for r, b in batches.items():
            if not isinstance(b, Batch):
                raise FutureMapError(f"batch[rank {r}] must be a Batch, got {type(b).__name__}")
        parts, modes = [], []
        for r, b in batches.items():
            m = host_mode(b.forward_mode, f"batch[rank {r}].forward_mode")
            where = f"batch[rank {r}]."
            modes.append(m)
            parts.append(
                Part((m,), True, b.input_ids is not None, b.token_slots is not None, where)
            )
        field = lambda f: {r: getattr(b, f) for r, b in batches.items()}  # noqa: E731
        drafts = {r: d for r, d in field("draft_indices").items() if d is not None}
        slots = {r: s for r, s in field("token_slots").items() if s is not None}
        return Given(
            tuple(parts),
            tuple(batches),
            None,
            tuple(modes),
            field("req_pool_indices"),
            field("input_ids"),
            field("seq_lens"),
            drafts,
            slots,
        )

    # ------------------------------------------------------------------ sizes
    def _ids(self, given: Given, rules: Rules) -> Any:
        """The ids to place: as given, zeros (one per row) for the parts the rules say;
        None for a batch that places none (its ids gathered)."""
        if not rules.places_ids:
            return None
        dt = self.inputs.dtype
        if given.ranks is None:
            return _zeros(given.slots, dt) if rules.zero_ids else given.ids
        ids = dict(given.ids)
        for i in rules.zero_ids:
            r = given.ranks[i]
            ids[r] = _zeros(given.slots[r], dt)
        return ids

    def _sizes(
        self, slots: Any, ids: Any, rows: int | None, tokens: int | None
    ) -> tuple[int | None, int | None]:
        """A resolve's per-rank padded sizes: for host inputs the (rows, tokens) pair its
        token bucket fixes (`buckets.resolve_sizes`: one executable per token bucket);
        jax arrays keep the sizes they have."""
        if isinstance(slots, jax.Array) or isinstance(ids, jax.Array):
            return rows, tokens
        inputs = self.inputs
        batch_buckets, token_buckets = inputs.batch_buckets, inputs.token_buckets
        for size, buckets, what in (
            (rows, batch_buckets, "rows"),
            (tokens, token_buckets, "tokens"),
        ):
            if size is not None and size not in buckets:
                raise FutureMapError(f"{what}={size} is not one of the buckets {buckets}")
        n = rows if rows is not None else _rows_per_rank(slots, self.dp)
        t = tokens if tokens is not None else _rows_per_rank(ids, self.dp)
        if n is None or t is None:
            return rows, tokens  # not an array: placing it names the field
        return resolve_sizes(n, t, batch_buckets, token_buckets)

    # ------------------------------------------------------------------ fields
    def _rank_modes(self, given: Given) -> list[ForwardMode]:
        """The host modes, one per DP rank (a mapping's ranks left out are IDLE; a key that
        names no rank is refused placing its slots); one standing for every rank for a
        Batch."""
        if given.ranks is None:
            return list(given.modes)
        modes = [ForwardMode.IDLE] * self.dp
        for r, m in zip(given.ranks, given.modes, strict=True):
            if isinstance(r, int | np.integer) and not isinstance(r, bool) and 0 <= r < self.dp:
                modes[int(r)] = m
        return modes

    def _filled(self, given: Given, ids: Any) -> tuple[Any, Any]:
        """The token slots and draft slots to place: as given for a Batch; a mapping's
        for every rank (ranks without token slots gather nothing, all 0; ranks without a
        draft input read padding slot 0: garbage, unused), None where no rank gives any
        (or, token slots, where no rank is MIXED: every slot given is 0, by the rules)."""
        draft, slots = given.draft, given.token_slots
        if self.spec is None and (draft if given.ranks is not None else draft is not None):
            raise errors.draft_indices_on_plain_map()
        if given.ranks is None:
            return (slots if ids is not None else None), draft
        dt = self.inputs.dtype
        if slots and ForwardMode.MIXED in given.modes:
            slots = {r: slots.get(r, np.zeros(len(ids[r]), dt)) for r in given.ranks}
        else:
            slots = None
        if not draft:
            return slots, None
        for r, m in zip(given.ranks, given.modes, strict=True):
            if r not in draft and m == ForwardMode.DECODE:
                raise FutureMapError(
                    f"batch[rank {r}].draft_indices missing: beside ranks with a draft "
                    "input a spec DECODE rank brings its own (its lengths are gathered at "
                    "them)"
                )
        return slots, {r: draft.get(r, np.zeros(len(given.slots[r]), dt)) for r in given.ranks}

    # ------------------------------------------------------------------ the key
    def _mode_key(self, traced: Any, modes: list[ForwardMode], *, exact: bool) -> tuple[Key, Any]:
        """The resolve's key (its mode) and the mode the executable takes (None: fixed).
        `exact` (an engine step, whose forward sees the mode): one executable per mode,
        not per kind."""
        if traced is not None:
            return Key("resolve", 0, mode="traced"), traced  # rows not checked against it
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


def _part_slots(given: Given) -> list[Any]:
    """Each part's token slots as given, in part order (`Rules.zero_slots` indexes them)."""
    if given.ranks is None:
        return [given.token_slots]
    return [given.token_slots.get(r) for r in given.ranks]


def _batch_check(
    rules: Rules, modes: list[ForwardMode], parts: Any, values: Sequence[Any], placed: list[Any]
) -> None:
    """A batch's value rules on a call's values: its parts' token slots as given (a
    Batch's, from its values; a mapping's, decided with it) and its placed slots and token
    slots (`validate.batch_values`)."""
    given = (values[5],) if parts is None else parts
    batch_values(rules, modes, given, placed[1], placed[5])


def _zeros(rows: Any, dtype: np.dtype) -> Any:
    """Ids that are never read: zeros, one per row (None where `rows` has no length:
    placing the slots names it)."""
    try:
        return np.zeros(len(rows), dtype)
    except TypeError:
        return None


def _rows_per_rank(x: Any, dp: int) -> int | None:
    """Rows per DP rank of a host input before it is placed (a mapping: its largest
    rank's); None when `x` has no length (placing it then names what is wrong)."""
    try:
        if isinstance(x, Mapping):
            return max((len(v) for v in x.values()), default=0)
        return len(x) // dp
    except TypeError:
        return None
