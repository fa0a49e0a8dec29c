"""The PyTorch FutureMap: the contract's twin (docs/CONTRACT.md), modelled on SGLang's
request-pool-indexed relay.

One device-side buffer row per request-pool slot, written by a forward's `publish` and
`stash` and read by the next forward's `resolve`. Two protocols ('Two protocols' in the
contract), chosen when the map is built; buffers, publish, stash, resolve_seq_lens_cpu and
the debug consume check are the same in both:
- "sentinel" (the default; SGLang's relay of late May 2026, PRs #25862 to #26108): between
  two forwards `invalidate` leaves sentinels (-slot) in a batch's ids and lengths, and
  `resolve` replaces them from the buffers.
- "gather" (SGLang's later relay, `overlap_utils.py` at commit 0178132): no sentinels and
  no invalidate. `resolve` gathers a DECODE batch's ids at its slots, appends a MIXED
  batch's running tokens (gathered at `mix_running_indices`) to its prefill ids and, with
  spec, gathers the lengths and draft extras at the draft's slots and binds a MIXED batch's
  running rows' lengths; host ids are taken as given and must be >= 0. A spec MIXED batch
  is a gather-protocol feature: the sentinel protocol refuses it.

Checks SGLang's class does not have ('Checks beyond SGLang' in the contract). Always on
(metadata only, no device sync): rank, shape, dtype and device of every input, the forward
mode, spec payload shapes against the lazily fixed K, H and hidden dtype. On CPU tensors,
and in debug mode on any device (they read values): slots in [0, R) (publish, stash,
resolve, invalidate, resolve_seq_lens_cpu), no live slot twice in a batch, int values
(slots, tokens, lengths, top-k ids, input ids, an int field's rows) of any int dtype fit the
buffer's dtype (then cast: a uint8 token or an int64 length into an int32 buffer; a value
that does not fit is refused), sentinels name slots in [0, R), tokens and lengths relayed
are >= 0, and (gather protocol) input ids are >= 0.
Every check runs before anything is written: a rejected call leaves the buffers and the
batch as they were.
Debug-mode invariants (consume tracking, positive restored or gathered lengths): on CPU they raise
InvariantViolation at the call; on CUDA they are `torch._assert_async` device asserts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from fm_torch import validate as v
from fm_torch.batch import DraftPayload, ForwardMode, ScheduleBatch
from fm_torch.confidence import ConfidenceRelay, ResolvedConfidence, not_declared
from fm_torch.errors import FutureMapError, InvariantViolation
from fm_torch.relay import RelayBuffers

DEBUG_ENV = "FM_DEBUG"
"""Environment variable that turns debug mode on for every FutureMap built without `debug=`."""

POISON = -1
"""Debug-mode content of an `output_tokens` slot that has no unread write."""


def debug_from_env() -> bool:
    """Whether FM_DEBUG asks for debug mode ('1', 'true', 'yes', 'on')."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class FutureMap:
    """Device relay of last tokens, lengths and spec extras, indexed by request-pool slot.

    Args:
      pool_size: R, rows of the request pool (max running requests + 1). Slot 0 is padding.
      device: where the buffers live ('cpu', 'cuda', 'cuda:1', ...).
      dtype: int dtype of token and length buffers: torch.int64 (SGLang's) or torch.int32.
      spec: relay speculative-decoding extras (bonus tokens, topk_p, topk_index,
        hidden_states, verified ids and the engine's own fields). The first non-empty
        draft `stash` fixes the consume-tracked ones (every draft carries them); each
        other field's buffer, its K, H or shape and dtype, is made by the first draft that
        carries it (SGLang's buffers created on first use).
      debug: consume tracking and invariant checks; None reads FM_DEBUG.
      consumed: the engine's own draft fields (`DraftPayload.extras` names) that debug
        consume-tracks, as it does the bonus tokens and verified ids.
      protocol: "sentinel" (invalidate leaves -slot placeholders that resolve fills) or
        "gather" (no placeholders: resolve gathers a DECODE batch's ids at its slots, a
        MIXED batch's running tokens at `mix_running_indices`, spec lengths and extras at
        the draft's slots; invalidate is refused).
      relay: engine-owned `new_seq_lens` and `output_tokens` buffers to adopt
        (`RelayBuffers`): [R] each, of `dtype`, on `device`.
      needs_confidence_relay: (spec, DSpark) `publish` takes `confidence=` rows and the
        host's `generation=` counters, and `resolve_confidence_cpu` reads them back from
        a host ring without waiting (fm_torch.confidence; SGLang's `ConfidenceRelay`).
    """

    def __init__(
        self,
        pool_size: int,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.int64,
        spec: bool = False,
        debug: bool | None = None,
        consumed: tuple[str, ...] = (),
        protocol: str = "sentinel",
        relay: RelayBuffers | None = None,
        needs_confidence_relay: bool = False,
    ) -> None:
        if not isinstance(pool_size, int) or pool_size < 2:
            raise FutureMapError(
                f"pool_size must be an int >= 2 (slot 0 is padding), got {pool_size}"
            )
        if dtype not in v.INT_DTYPES:
            raise FutureMapError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
        self.protocol = v.check_protocol(protocol)
        v.check_flag("spec", spec)
        v.check_flag("debug", debug, none=True)
        v.check_flag("needs_confidence_relay", needs_confidence_relay)
        if needs_confidence_relay and not spec:
            raise FutureMapError("needs_confidence_relay is a spec feature (DSpark): spec=True")
        self.pool_size = pool_size
        self.device = v.check_device(device)
        self.dtype = dtype
        self.spec = spec
        self.debug = debug_from_env() if debug is None else debug
        self._values_checked = self.debug or self.device.type == "cpu"

        # Slot 0 mirrors the KV pool's padding row: padded batch rows write garbage there.
        fill = POISON if self.debug else 0
        self.output_tokens = torch.full((pool_size,), fill, dtype=dtype, device=self.device)
        # Debug: a length with no unread publish is POISON too (SGLang's poisoned init).
        self.new_seq_lens = torch.full((pool_size,), fill, dtype=dtype, device=self.device)
        self._relay: RelayBuffers | None = None
        if relay is not None:
            self._adopt(relay)
        # Each spec buffer is made by the first draft that carries its field (K, H unknown
        # until then); a resolve before that gathers None for it.
        self.bonus_tokens = True  # whether drafts relay bonus tokens (in output_tokens)
        self.topk_p: torch.Tensor | None = None
        self.topk_index: torch.Tensor | None = None
        self.hidden_states: torch.Tensor | None = None
        self.verified_id: torch.Tensor | None = None
        self.extras: dict[str, torch.Tensor] = {}
        self.consumed = v.check_names("consumed", consumed)  # consume-tracked extras, by name
        self._spec_shaped = False
        # Recorded after each spec publish on accelerators; resolve_seq_lens_cpu waits on it.
        self.publish_ready: torch.Event | None = None
        # Spec: armed by a publish, consumed by the resolve_seq_lens_cpu that waits for it
        # (debug: a wait with no fresh publish behind it is a violation).
        self._publish_fresh = False
        self._forward_stream = self._make_forward_stream()
        self.needs_confidence_relay = needs_confidence_relay
        self.confidence_relay = ConfidenceRelay(pool_size, self.device)

    def _adopt(self, relay: RelayBuffers) -> None:
        """The engine's buffers become this map's, holding its initial contents."""
        if not isinstance(relay, RelayBuffers):
            raise FutureMapError(f"relay must be a RelayBuffers, got {type(relay).__name__}")
        if relay.adopted:
            raise FutureMapError("relay buffers already adopted by another FutureMap")
        for name in ("new_seq_lens", "output_tokens"):
            v.check_tensor(
                f"relay.{name}", getattr(relay, name), self.device, (self.pool_size,), (self.dtype,)
            )
        if relay.new_seq_lens.data_ptr() == relay.output_tokens.data_ptr():
            raise FutureMapError("relay.new_seq_lens and relay.output_tokens share memory")
        relay.new_seq_lens.copy_(self.new_seq_lens)
        relay.output_tokens.copy_(self.output_tokens)
        self.new_seq_lens, self.output_tokens = relay.new_seq_lens, relay.output_tokens
        relay.published_seq_lens = relay.published_bonus = None
        relay.adopted = True
        self._relay = relay

    def _rows(self, buf: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`buf[indices]`. One row whose slot is on the host (a CPU map, values checked):
        a copy of the row's slice, no gather."""
        if indices.shape[0] == 1 and indices.device.type == "cpu":
            i = int(indices[0])
            if 0 <= i < buf.shape[0]:
                return buf[i : i + 1].clone()
        return buf[indices]

    def _ints(self, name: str, t: torch.Tensor, checked: bool | None = None) -> torch.Tensor:
        """1-D int rows of any int dtype as the map computes with them: where values are
        checked (`checked`, default the map's rule), every value fits the map's dtype
        (FutureMapError naming `name` otherwise); rows neither int32 nor int64 are cast to
        the map's dtype (torch indexes and computes with those two only)."""
        if self._values_checked if checked is None else checked:
            v.check_fits(name, t, self.dtype)
        return v.as_ints(t, self.dtype)

    def _slots(self, name: str, t: torch.Tensor, checked: bool | None = None) -> torch.Tensor:
        """Slots as `_ints`, and where values are checked each in [0, R), no live slot twice."""
        t = self._ints(name, t, checked)
        if self._values_checked if checked is None else checked:
            v.check_slots(name, t, self.pool_size)
        return t

    # ----------------------------------------------------------------------------- streams
    def _make_forward_stream(self) -> torch.cuda.Stream | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.Stream(device=self.device)

    @contextlib.contextmanager
    def forward_stream(self) -> Iterator[None]:
        """Run the enclosed forward on the forward stream, after the schedule stream's work.

        On CUDA this is SGLang's discipline: a forward stream separate from the schedule
        (current) stream, which waits for the schedule stream first. On CPU it does nothing.
        """
        if self._forward_stream is None:
            yield
            return
        self._forward_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._forward_stream):
            yield

    # ----------------------------------------------------------------------------- writes
    def publish(
        self,
        indices: torch.Tensor,
        new_seq_lens: torch.Tensor,
        confidence: torch.Tensor | None = None,
        generation: torch.Tensor | None = None,
    ) -> None:
        """Write each slot's sequence length after this forward: `new_seq_lens[indices] := lens`.

        Empty `indices` (an idle data-parallel rank) is a no-op. With spec on an accelerator,
        records `publish_ready` for `resolve_seq_lens_cpu`. With `needs_confidence_relay`,
        `confidence` ([B, gamma] float32) is written at `indices` too and the buffer copied
        to the host ring with a snapshot of `generation` (the host's per-slot counters,
        [R] CPU ints); None leaves the rows as they are.
        """
        indices = v.check_1d_int("indices", indices, self.device)
        if indices.numel() == 0:
            return  # DP idle: nothing ran, nothing to relay
        new_seq_lens = v.check_1d_int("new_seq_lens", new_seq_lens, self.device)
        v.check_rows("new_seq_lens", new_seq_lens, indices.shape[0])
        gen = None
        if confidence is not None:
            if not self.needs_confidence_relay:
                raise not_declared()
            confidence, gen = self.confidence_relay.check(confidence, generation, indices.shape[0])
        indices = self._slots("indices", indices)
        if self._values_checked:
            v.check_fits("new_seq_lens", new_seq_lens, self.dtype)
            v.check_non_negative("new_seq_lens", new_seq_lens)
        relay = self._relay
        if relay is not None and new_seq_lens is relay.published_seq_lens:
            relay.published_seq_lens = None  # the engine's forward wrote these rows
        else:
            self.new_seq_lens[indices] = new_seq_lens.to(self.dtype)
        if confidence is not None:
            self.confidence_relay.scatter(indices, confidence)
        if self.spec:
            self._publish_fresh = True
            if self.device.type != "cpu":
                if self.publish_ready is None:
                    self.publish_ready = torch.Event(device=self.device)
                self.publish_ready.record()
        if gen is not None:
            self.confidence_relay.issue_ring_copy(gen, self.publish_ready)

    def resolve_confidence_cpu(
        self, indices: torch.Tensor, *, wait: bool = False
    ) -> ResolvedConfidence | None:
        """The confidence rows of host slots `indices` from the publish LAG (2) publishes with
        confidence back, with their generations, without waiting: None before two such
        publishes, for no slots, or (unless `wait`) while that copy is not done."""
        if not self.needs_confidence_relay:
            raise FutureMapError(
                "resolve_confidence_cpu: the map relays no confidence; build it with "
                "needs_confidence_relay=True"
            )
        v.check_flag("wait", wait)
        indices = v.check_1d_int("indices", indices, torch.device("cpu"))
        indices = self._slots("indices", indices, checked=True)  # host slots: always read
        return self.confidence_relay.resolve(indices, wait)

    def stash(self, indices: torch.Tensor, payload: torch.Tensor | DraftPayload) -> None:
        """Write this forward's output for the next step to read.

        Non-spec: `payload` is the sampled tokens, `output_tokens[indices] := tokens`.
        Spec: `payload` is a DraftPayload; bonus tokens (when relayed) go to `output_tokens`,
        the extras it carries to their buffers (each made by the first draft carrying it);
        a field it leaves out keeps its rows (a partial stash: a draft of bonus tokens
        alone is SGLang's `stash_bonus_tokens`). Empty `indices` is a no-op.
        """
        indices = v.check_1d_int("indices", indices, self.device)
        if indices.numel() == 0:
            return  # DP idle: nothing ran, nothing to relay
        rows = indices.shape[0]
        if isinstance(payload, DraftPayload):
            if not self.spec:
                raise FutureMapError("stash got a DraftPayload but this FutureMap has spec=False")
            tokens, name = self._check_draft(payload, rows), "draft.bonus_tokens"
        else:
            if self.spec:
                raise FutureMapError(
                    f"stash on a spec FutureMap takes a DraftPayload, got {type(payload).__name__}"
                )
            tokens, name = v.check_1d_int("tokens", payload, self.device), "tokens"
            v.check_rows("tokens", tokens, rows)
        indices = self._slots("indices", indices)
        if self._values_checked:
            if tokens is not None:
                v.check_fits(name, tokens, self.dtype)
                v.check_non_negative(name, tokens)
            if isinstance(payload, DraftPayload):
                if payload.topk_index is not None:
                    v.check_fits("draft.topk_index", payload.topk_index, self.dtype)
                if payload.verified_id is not None:
                    v.check_fits("draft.verified_id", payload.verified_id, self.dtype)
                    v.check_non_negative("draft.verified_id", payload.verified_id)
                for name, x in (payload.extras or {}).items():
                    if name in self.extras and self.extras[name].dtype in v.INTEGERS:
                        v.check_fits(f"draft.{name}", x, self.extras[name].dtype)
                    if name in self.consumed:
                        v.check_non_negative(f"draft.{name}", x.reshape(-1))
        # Every check has passed: only now is anything written.
        relay = self._relay
        if relay is not None and tokens is not None and tokens is relay.published_bonus:
            relay.published_bonus = None  # the engine's forward wrote these rows
        elif tokens is not None:
            self.output_tokens[indices] = tokens.to(self.dtype)
        if isinstance(payload, DraftPayload):
            self._stash_extras(indices, payload)

    def _check_draft(self, draft: DraftPayload, rows: int) -> torch.Tensor | None:
        """Check a draft's structure against the buffers; return its bonus tokens (None
        when drafts relay none).

        A draft writes the fields it carries; the others keep their rows (SGLang's partial
        stash). The consume-tracked fields (bonus tokens, verified ids, the tracked
        extras) are fixed by the first draft stashed and carried by every one: each draft
        gather consumes them. Any other field may be left out; its buffer is made by the
        first draft that carries it, which fixes its shape and dtype."""
        if self._spec_shaped:
            for name, kept in (
                ("bonus_tokens", self.bonus_tokens),
                ("verified_id", self.verified_id is not None),
            ):
                if (getattr(draft, name) is not None) != kept:
                    want = name if kept else f"no {name}"
                    raise FutureMapError(
                        f"draft does not match the first draft stashed: expected {want}"
                    )
        tokens = None
        if draft.bonus_tokens is not None:
            tokens = v.check_1d_int("draft.bonus_tokens", draft.bonus_tokens, self.device)
            v.check_rows("draft.bonus_tokens", tokens, rows)
        topk_p = draft.topk_p
        for given, missing in (("topk_p", "topk_index"), ("topk_index", "topk_p")):
            if getattr(draft, given) is not None and getattr(draft, missing) is None:
                raise FutureMapError(
                    f"draft.{given} given without draft.{missing}: top-k comes whole"
                )
        if topk_p is not None:
            if not isinstance(topk_p, torch.Tensor) or topk_p.dim() != 2:
                raise FutureMapError("draft.topk_p must be a 2-D tensor [B, K]")
            k = topk_p.shape[1] if self.topk_p is None else self.topk_p.shape[1]
            v.check_tensor("draft.topk_p", topk_p, self.device, (rows, k), (torch.float32,))
            v.check_tensor("draft.topk_index", draft.topk_index, self.device, (rows, k), v.INTEGERS)
        hidden = draft.hidden_states
        if hidden is not None and self.hidden_states is not None:
            v.check_tensor(
                "draft.hidden_states",
                hidden,
                self.device,
                (rows, self.hidden_states.shape[1]),
                (self.hidden_states.dtype,),
            )
        elif hidden is not None:
            if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
                raise FutureMapError("draft.hidden_states must be a 2-D tensor [B, H]")
            v.check_tensor(
                "draft.hidden_states", hidden, self.device, (rows, hidden.shape[1]), v.HIDDEN_DTYPES
            )
        self._check_declared_fields(draft, rows)
        carried = (draft.bonus_tokens, draft.topk_p, draft.hidden_states, draft.verified_id)
        if all(x is None for x in carried) and not draft.extras:
            raise FutureMapError("the draft stashed relays no field")
        return tokens

    def _check_declared_fields(self, draft: DraftPayload, rows: int) -> None:
        """Verified ids and the engine's own fields, [rows, ...] each: a field with a buffer
        in its shape and dtype, a field first carried now in its own (which then fixes
        them); every tracked extra in every draft."""
        vid = draft.verified_id
        extras = draft.extras or {}
        if not isinstance(extras, dict) or not all(isinstance(k, str) for k in extras):
            raise FutureMapError("draft.extras must be a dict of name -> tensor")
        if vid is not None:
            v.check_rows(
                "draft.verified_id", v.check_1d_int("draft.verified_id", vid, self.device), rows
            )
        for name, x in extras.items():
            where = f"draft.{name}"
            if not isinstance(x, torch.Tensor) or x.dim() < 1:
                raise FutureMapError(f"{where} must be a tensor [B, ...]")
            if name in self.extras:
                buf = self.extras[name]
                allowed = v.field_dtypes(buf.dtype)
                v.check_tensor(where, x, self.device, (rows, *buf.shape[1:]), allowed)
            else:  # its first draft: its rows fix the field's shape and dtype
                v.check_tensor(where, x, self.device, (rows, *x.shape[1:]), (x.dtype,))
                if name in self.consumed and x.dtype not in v.INT_DTYPES:
                    raise FutureMapError(
                        f"{where} is consume-tracked: an int tensor, got {x.dtype}"
                    )
        if not self.consumed <= set(extras):
            raise FutureMapError(
                f"consume-tracked fields {sorted(self.consumed - set(extras))} missing from the "
                "draft: every draft stash writes them (each draft gather consumes them)"
            )

    def _stash_extras(self, indices: torch.Tensor, draft: DraftPayload) -> None:
        """Write the draft's fields but the bonus tokens; a field's buffer is made by the
        first draft that carries it (zeros; a consume-tracked one poisoned in debug)."""
        r = self.pool_size
        fill = POISON if self.debug else 0  # consume-tracked fields start as output_tokens
        if not self._spec_shaped:
            self.bonus_tokens = draft.bonus_tokens is not None
            if draft.verified_id is not None:
                self.verified_id = torch.full((r,), fill, dtype=self.dtype, device=self.device)
            self._spec_shaped = True
        if draft.topk_p is not None and draft.topk_index is not None:
            if self.topk_p is None or self.topk_index is None:
                k = draft.topk_p.shape[1]
                self.topk_p = torch.zeros((r, k), dtype=torch.float32, device=self.device)
                self.topk_index = torch.zeros((r, k), dtype=self.dtype, device=self.device)
            self.topk_p[indices] = draft.topk_p
            self.topk_index[indices] = draft.topk_index.to(self.dtype)
        if draft.hidden_states is not None:
            if self.hidden_states is None:
                h, dt = draft.hidden_states.shape[1], draft.hidden_states.dtype
                self.hidden_states = torch.zeros((r, h), dtype=dt, device=self.device)
            self.hidden_states[indices] = draft.hidden_states
        if self.verified_id is not None and draft.verified_id is not None:
            self.verified_id[indices] = draft.verified_id.to(self.dtype)
        for name, x in (draft.extras or {}).items():
            if name not in self.extras:
                self.extras[name] = torch.full(
                    (r, *x.shape[1:]),
                    fill if name in self.consumed else 0,
                    dtype=x.dtype,
                    device=self.device,
                )
            self.extras[name][indices] = x.to(self.extras[name].dtype)

    # ------------------------------------------------------------------------------ reads
    def resolve(self, batch: ScheduleBatch) -> None:
        """Build the forward's inputs from the buffers, at forward entry (in place).

        Sentinel protocol, filling the batch's placeholders:
        1. DECODE: `seq_lens := new_seq_lens[req_pool_indices]` (debug: live rows > 0).
        2. Non-spec: `input_ids := where(ids < 0, output_tokens[max(-ids, 0)], ids)`.
           Spec: if the batch carries a draft input, gather its extras and bonus tokens.
        3. Debug: consume check on what was gathered from `output_tokens`.
        Gather protocol (no placeholders), by batch kind:
        - EXTEND: ids and lengths as given.
        - DECODE, non-spec: `input_ids := output_tokens[req_pool_indices]` (the batch
          brings None: ids given are refused), lengths as given.
        - MIXED: `input_ids := cat(input_ids, output_tokens[mix_running_indices])`; spec:
          the running rows (the last live rows, in `mix_running_indices` order; refused
          otherwise) get `new_seq_lens[mix_running_indices] + 1` (debug: > 0 published).
        - IDLE: nothing.
        - spec with a draft input: the extras and bonus tokens gathered at its slots and,
          on a DECODE batch, `seq_lens := new_seq_lens[draft.indices]` (debug: live rows
          > 0); ids as given.
        Debug: consume check on every gather from `output_tokens`, which poisons exactly
        the slots gathered.

        Every input check (and, on CPU, every debug invariant) runs before the batch or a
        buffer is written, so a raise leaves both as they were. Assumes the batch's tensors
        are on this map's device.
        """
        if self.protocol == "gather":
            self._resolve_gather(batch)
            return
        indices = v.check_1d_int("req_pool_indices", batch.req_pool_indices, self.device)
        if batch.mix_running_indices is not None:
            raise FutureMapError(
                "mix_running_indices is for the gather protocol; this map relays by sentinels "
                "(a MIXED batch's running rows carry theirs in input_ids)"
            )
        if batch.input_ids is None:
            raise FutureMapError(
                "input_ids is None: the sentinel protocol needs every batch's ids "
                "(a decode row's -slot sentinel); only the gather protocol gathers them"
            )
        ids = v.check_1d_int("input_ids", batch.input_ids, self.device)
        host_lens = v.check_1d_int("seq_lens", batch.seq_lens, self.device)
        v.check_rows("seq_lens", host_lens, indices.shape[0])
        mode = v.check_mode(batch.forward_mode)
        if self.spec and mode == ForwardMode.MIXED:
            raise FutureMapError(
                "a spec MIXED batch is a gather-protocol feature (its running rows' lengths "
                "are bound at resolve); this map relays by sentinels"
            )
        is_decode = mode == ForwardMode.DECODE
        if is_decode and not self.spec:
            v.check_rows("input_ids of a DECODE batch", ids, indices.shape[0])
        draft_indices = None
        if batch.draft is not None:
            if not self.spec:
                raise FutureMapError("batch.draft given but this FutureMap has spec=False")
            draft_indices = v.check_1d_int("draft.indices", batch.draft.indices, self.device)
            v.check_rows("draft.indices", draft_indices, indices.shape[0])
            if not self._spec_shaped:
                raise FutureMapError("resolve of spec extras before any draft was stashed")
        indices = self._slots("req_pool_indices", indices)
        if draft_indices is not None:
            draft_indices = self._slots("draft.indices", draft_indices)
        ids = self._ints("input_ids", ids)
        if self._values_checked:
            v.check_sentinels("input_ids", ids, self.pool_size)
            v.check_fits("seq_lens", host_lens, self.dtype)

        seq_lens = self._rows(self.new_seq_lens, indices) if is_decode else None
        if seq_lens is not None and self.debug:
            self._check_positive_lengths(seq_lens, indices)
        if not self.spec:
            is_ref = ids < 0
            gathered = self._rows(self.output_tokens, torch.clamp(-ids, min=0))
            resolved = torch.where(is_ref, gathered, ids.to(self.dtype))
            if self.debug:
                self._consume(resolved, indices, source_slots=torch.where(is_ref, -ids, 0))
            batch.input_ids = resolved
        elif draft_indices is not None:
            assert batch.draft is not None
            batch.draft.payload = self._gather_extras(draft_indices)
        if seq_lens is not None and self.spec and self.debug:
            self._consume_lengths(indices)
        if seq_lens is not None:
            batch.seq_lens = seq_lens

    def _gather_extras(self, indices: torch.Tensor) -> DraftPayload:
        """Spec: the draft state stashed at `indices` (debug: every consume-tracked field
        checked, then poisoned at `indices`)."""
        payload = self._read_extras(indices)
        if self.debug:
            self._check_consumed_fields(payload, indices)
            if payload.bonus_tokens is not None:
                self._consume(payload.bonus_tokens, indices, source_slots=indices)
            self._poison_fields(indices)
        return payload

    def _tracked(self) -> list[tuple[str, torch.Tensor]]:
        """(name, buffer) of each consume-tracked field besides the bonus tokens: the
        verified ids and the tracked extras the first draft brought."""
        out = [("verified_id", self.verified_id)] if self.verified_id is not None else []
        return out + [(k, self.extras[k]) for k in sorted(self.consumed & set(self.extras))]

    def _check_consumed_fields(self, payload: DraftPayload, indices: torch.Tensor) -> None:
        """Consume check of the tracked fields gathered at `indices` (besides the bonus
        tokens): each row read from a live slot is >= 0. Checks only: `_poison_fields`
        writes."""
        for name, _ in self._tracked():
            got = payload.verified_id if name == "verified_id" else (payload.extras or {})[name]
            assert got is not None
            low = got.reshape(got.shape[0], -1).amin(dim=1) if got.dim() > 1 else got
            self._report_consume((low >= 0) | (indices == 0), indices)

    def _poison_fields(self, indices: torch.Tensor) -> None:
        """POISON at `indices` (whole rows) in every tracked field besides the bonus tokens."""
        for _, buf in self._tracked():
            buf[indices] = POISON

    def _read_extras(self, indices: torch.Tensor) -> DraftPayload:
        """Spec: the draft state stashed at `indices`, read only (no consume check)."""
        rows = self._rows
        return DraftPayload(
            bonus_tokens=rows(self.output_tokens, indices) if self.bonus_tokens else None,
            topk_p=None if self.topk_p is None else rows(self.topk_p, indices),
            topk_index=None if self.topk_index is None else rows(self.topk_index, indices),
            hidden_states=None if self.hidden_states is None else rows(self.hidden_states, indices),
            verified_id=None if self.verified_id is None else rows(self.verified_id, indices),
            extras={k: rows(b, indices) for k, b in self.extras.items()} or None,
        )

    def _resolve_gather(self, batch: ScheduleBatch) -> None:
        """The gather protocol's resolve (see `resolve`): checks, gathers, then writes."""
        indices = v.check_1d_int("req_pool_indices", batch.req_pool_indices, self.device)
        host_lens = v.check_1d_int("seq_lens", batch.seq_lens, self.device)
        v.check_rows("seq_lens", host_lens, indices.shape[0])
        mode = v.check_mode(batch.forward_mode)
        ids = None
        if batch.input_ids is not None and mode == ForwardMode.DECODE and not self.spec:
            raise FutureMapError(
                "input_ids given for a DECODE batch: in the gather protocol its ids are "
                "gathered at req_pool_indices (pass None)"
            )
        if batch.input_ids is not None:
            ids = v.check_1d_int("input_ids", batch.input_ids, self.device)
        elif mode != ForwardMode.DECODE:
            raise FutureMapError(
                f"input_ids is None with forward_mode {mode.name}: only a DECODE batch "
                "comes without ids in the gather protocol"
            )
        mix = None
        if mode == ForwardMode.MIXED:
            if batch.mix_running_indices is None:
                raise FutureMapError(
                    "mix_running_indices is required for a MIXED batch in the gather "
                    "protocol: the slots of its running rows"
                )
            mix = v.check_1d_int("mix_running_indices", batch.mix_running_indices, self.device)
        elif batch.mix_running_indices is not None:
            raise FutureMapError(
                f"mix_running_indices given with forward_mode {mode.name}: only a MIXED "
                "batch has running rows to gather"
            )
        draft_indices = None
        if batch.draft is not None:
            if not self.spec:
                raise FutureMapError("batch.draft given but this FutureMap has spec=False")
            draft_indices = v.check_1d_int("draft.indices", batch.draft.indices, self.device)
            # The gathered lengths replace seq_lens: one per batch row.
            v.check_rows("draft.indices", draft_indices, indices.shape[0])
            if not self._spec_shaped:
                raise FutureMapError("resolve of spec extras before any draft was stashed")
        host_tails = False
        if mix is not None and self.spec:
            # Spec MIXED: the running rows are the batch's last rows, in mix order.
            v.check_at_most("mix_running_indices", mix, indices.shape[0])
            host_tails = self._check_host_fields(batch, indices.shape[0])
        indices = self._slots("req_pool_indices", indices)
        if mix is not None:
            mix = self._slots("mix_running_indices", mix)
            if self.spec and self._values_checked:
                v.check_running_rows(indices, mix)
        if draft_indices is not None:
            draft_indices = self._slots("draft.indices", draft_indices)
        if ids is not None:
            ids = self._ints("input_ids", ids)
            if self._values_checked:
                v.check_no_sentinels("input_ids", ids)
        if self._values_checked:
            v.check_fits("seq_lens", host_lens, self.dtype)

        # Gathers, in SGLang's order: the forward's ids, then the spec state. Each read of
        # output_tokens is listed with the slots it read, for the consume check.
        reads: list[tuple[torch.Tensor, torch.Tensor]] = []
        new_ids: torch.Tensor | None = None
        if mode == ForwardMode.DECODE and not self.spec:
            new_ids = self._rows(self.output_tokens, indices)
            reads.append((new_ids, indices))
        elif mix is not None:
            assert ids is not None
            running_ids = self.output_tokens[mix]
            reads.append((running_ids, mix))
            new_ids = torch.cat([ids.to(self.dtype), running_ids])
        seq_lens: torch.Tensor | None = None
        fresh: torch.Tensor | None = None
        running: torch.Tensor | None = None  # spec MIXED: the running rows' mask
        if mix is not None and self.spec and mix.numel():
            # Spec MIXED (SGLang's late binding): the host planned this batch before the last
            # verify's accept lengths landed; its running rows (the last len(mix) live rows;
            # padding rows, slot 0, are not counted) get the published length plus the token
            # this forward feeds. A mask, not a slice: the live row count stays on the device.
            live = indices > 0
            order = torch.cumsum(live, 0) - 1  # a live row's place among the live rows
            running = live & (order >= live.sum() - mix.shape[0])
            if self.debug:  # the lengths the binding reads, checked below
                fresh = self.new_seq_lens[mix]
            bound = self.new_seq_lens[indices] + 1
            seq_lens = torch.where(running, bound, host_lens.to(self.dtype))
        payload: DraftPayload | None = None
        if draft_indices is not None:
            # A spec DECODE batch's lengths are the verified ones last published.
            if mode == ForwardMode.DECODE:
                seq_lens = self._rows(self.new_seq_lens, draft_indices)
            payload = self._read_extras(draft_indices)
            if self.debug and mix is not None and payload.bonus_tokens is not None:
                # Read after the running rows' consume: a slot both gathered finds the
                # poison that consume wrote, as it would in sequence.
                consumed = torch.isin(draft_indices, mix)
                payload.bonus_tokens = torch.where(
                    consumed, torch.full_like(payload.bonus_tokens, POISON), payload.bonus_tokens
                )
            if payload.bonus_tokens is not None:
                reads.append((payload.bonus_tokens, draft_indices))

        if self.debug:
            if fresh is not None:
                assert mix is not None
                self._check_positive_lengths(fresh, mix)
            elif seq_lens is not None:
                assert draft_indices is not None
                self._check_positive_lengths(seq_lens, draft_indices)
            # Every read checked before any slot is poisoned.
            if payload is not None:
                assert draft_indices is not None
                self._check_consumed_fields(payload, draft_indices)
            if reads:  # one consume over every read of output_tokens
                values = torch.cat([r[0] for r in reads])
                slots = torch.cat([r[1].to(torch.int64) for r in reads])
                self._consume(values, slots, source_slots=slots)
            if payload is not None and draft_indices is not None:
                self._poison_fields(draft_indices)
                if mode == ForwardMode.DECODE:  # the verified lengths it read
                    self._consume_lengths(draft_indices)
        if new_ids is not None:
            batch.input_ids = new_ids
        if seq_lens is not None:
            batch.seq_lens = seq_lens
        if payload is not None:
            assert batch.draft is not None
            batch.draft.payload = payload
        if host_tails and running is not None:
            assert seq_lens is not None
            self._rebind_host_tails(batch, indices, running, seq_lens)

    def _check_host_fields(self, batch: ScheduleBatch, rows: int) -> bool:
        """A spec MIXED batch's host fields: `seq_lens_cpu` a 1-D int CPU tensor and
        `prefix_lens` a list of ints, one per row, lengths >= 0 (fm_jax's
        `resolve_mixed_tails_cpu` refuses the same). Whether there are any."""
        cpu = torch.device("cpu")
        if batch.seq_lens_cpu is not None:
            v.check_rows(
                "seq_lens_cpu",
                v.check_1d_int("seq_lens_cpu", batch.seq_lens_cpu, cpu, v.INT_DTYPES),
                rows,
            )
            v.check_non_negative("seq_lens_cpu", batch.seq_lens_cpu)
        prefix = batch.prefix_lens
        if prefix is not None and (
            not isinstance(prefix, list)
            or len(prefix) != rows
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in prefix)
        ):
            raise FutureMapError(f"prefix_lens must be a list of {rows} ints, one per row")
        if prefix is not None and min(prefix, default=0) < 0:
            bad = [x for x in prefix if x < 0]
            raise FutureMapError(
                f"prefix_lens holds negative values {bad}: token ids and lengths are >= 0"
            )
        return batch.seq_lens_cpu is not None or prefix is not None

    def _rebind_host_tails(
        self,
        batch: ScheduleBatch,
        indices: torch.Tensor,
        running: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> None:
        """Spec MIXED, the host's side of the late binding (SGLang's
        `resolve_mixed_spec_tails`; a host sync): the running rows' `seq_lens_cpu` become
        their bound lengths, `prefix_lens` the published ones, `seq_lens_sum` the sum
        over the live rows. `out_cache_loc` (the KV pool's) is the engine's."""
        run, bound, live = running.cpu(), seq_lens.cpu(), indices.cpu() > 0
        if batch.seq_lens_cpu is not None:
            host = torch.where(run, bound.to(batch.seq_lens_cpu.dtype), batch.seq_lens_cpu)
            batch.seq_lens_cpu = host
            batch.seq_lens_sum = int(host[live].sum())
        if batch.prefix_lens is not None:
            fresh = (bound - 1).tolist()
            batch.prefix_lens = [
                fresh[i] if r else p
                for i, (r, p) in enumerate(zip(run.tolist(), batch.prefix_lens, strict=True))
            ]

    def invalidate(self, batch: ScheduleBatch, indices: torch.Tensor) -> None:
        """Leave sentinels for the next step: `input_ids := -indices`, `seq_lens := -indices`.

        A padding row (slot 0) gets sentinel 0. Runs after the forward is launched.
        Sentinel protocol only: the gather protocol refuses it.
        """
        if self.protocol == "gather":
            raise FutureMapError(
                "invalidate: the gather protocol leaves no sentinels; after a forward the "
                "host leaves the batch's ids empty and resolve gathers them"
            )
        indices = self._slots("indices", v.check_1d_int("indices", indices, self.device))
        sentinel = -indices.to(self.dtype)
        batch.input_ids = sentinel
        batch.seq_lens = sentinel.clone()

    def resolve_seq_lens_cpu(self, indices: torch.Tensor) -> torch.Tensor:
        """Host copy of `new_seq_lens[indices]`, after the last spec publish has landed.

        Debug: on a spec map a read with rows must follow a publish no earlier read
        followed ('fresh publish', SGLang's consume-once wait), and every live slot read
        must hold a length >= 0 ('consume lengths (WRWR)': published, and not consumed by
        a resolve since). Both raise InvariantViolation here, on any device.
        """
        indices = self._slots("indices", v.check_1d_int("indices", indices, self.device))
        if self.debug and self.spec and indices.numel():
            fresh, self._publish_fresh = self._publish_fresh, False
            if not fresh:
                raise InvariantViolation(
                    "fresh publish",
                    "resolve_seq_lens_cpu waited for a publish that an earlier read already "
                    "consumed, or that never came",
                )
        if self.publish_ready is not None:
            self.publish_ready.synchronize()
        out = self.new_seq_lens[indices].cpu()
        if self.debug:
            bad = (out < 0) & (indices.cpu() != 0)  # slot 0 is padding: never checked
            if bool(bad.any()):
                raise InvariantViolation(
                    "consume lengths (WRWR)",
                    "read a length never published, or consumed by a resolve since its "
                    "last publish",
                    indices.cpu()[bad].tolist(),
                )
        return out

    # ------------------------------------------------------------------------ debug checks
    def _consume_lengths(self, indices: torch.Tensor) -> None:
        """Spec, debug: the verified lengths a resolve read at `indices` (checked > 0
        already) are consumed: POISON written back, so a second read with no publish
        between finds it (SGLang poisons them after its `resolve_seq_lens_cpu` read)."""
        self.new_seq_lens[indices] = POISON

    def _check_positive_lengths(self, seq_lens: torch.Tensor, indices: torch.Tensor) -> None:
        """Restored lengths of live rows are > 0; a sentinel there was never published."""
        ok = (seq_lens > 0) | (indices == 0)  # slot 0 is padding: its length is garbage
        if self.device.type != "cpu":
            torch._assert_async(ok.all(), "FutureMap invariant 'seq_lens > 0' violated")
            return
        if not bool(ok.all()):
            slots = indices[~ok].tolist()
            raise InvariantViolation(
                "seq_lens > 0",
                f"DECODE restored non-positive lengths {seq_lens[~ok].tolist()}: "
                "the slot's length was never published (spec: or a resolve read it since "
                "its last publish)",
                slots,
            )

    def _report_consume(self, ok: torch.Tensor, slots: torch.Tensor) -> None:
        """The consume check's verdict: InvariantViolation naming the `slots` of rows not
        `ok` (CPU), or a device assert (other devices: no host sync)."""
        if self.device.type != "cpu":
            torch._assert_async(ok.all(), "FutureMap invariant 'consume (WRWR)' violated")
        elif not bool(ok.all()):
            raise InvariantViolation(
                "consume (WRWR)",
                "read a slot with no write since its last read (RR) or before its first write",
                slots[~ok].tolist(),
            )

    def _consume(
        self, values: torch.Tensor, indices: torch.Tensor, source_slots: torch.Tensor
    ) -> None:
        """Consume tracking: values gathered from live slots are >= 0, then the batch's
        slots and the slots read (`source_slots`, 0 where a row read nothing) are poisoned
        again. Reads of slot 0 (padding rows) are garbage, never checked.

        On a valid batch every slot read is one of the batch's (SGLang poisons only those):
        the same bytes. A sentinel naming a slot outside the batch is consumed by its read
        too, so a second read of that slot is caught.
        """
        self._report_consume((values >= 0) | (source_slots == 0), source_slots)
        self.output_tokens[indices] = POISON
        # Rows that read nothing write slot 0's current value back to it: no device sync
        # (a boolean mask would need one), and slot 0 keeps what the line above left.
        read = source_slots.to(torch.int64)
        self.output_tokens[read] = torch.where(
            read != 0, torch.full_like(values, POISON), self.output_tokens[read]
        )
