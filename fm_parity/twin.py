"""The interface the overlap driver sees: one FutureMap twin over its DP ranks, plus its toy model.

`JaxTwin` (twin_jax.py: one fm_jax.FutureMap, on one device or a mesh) and `TorchTwin`
(twin_torch.py: one fm_torch.FutureMap per rank, as each SGLang DP rank holds its own)
implement it; mutations.py wraps either to make a deliberately broken FutureMap variant.
Every op takes a mapping DP rank -> host rows for the ranks that take part in it; a rank
left out is idle for that op. A twin's map runs one relay protocol (docs/CONTRACT.md, 'Two
protocols'), fixed when it is built: the driver reads it from `Twin.protocol`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np

from fm_parity import payloads
from fm_parity import toy_model as tm
from fm_parity.host_batch import HostBatch

PROTOCOLS = ("sentinel", "gather")
"""The relay protocols (docs/CONTRACT.md, 'Two protocols'): 'sentinel', where decode rows
carry -slot until resolve and invalidate leaves them, and 'gather', where resolve gathers
the tokens (spec: lengths) at slots the host names and nothing is invalidated."""


def check_protocol(protocol: str) -> str:
    """`protocol` if it is one of PROTOCOLS; ValueError naming the known ones otherwise."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; known: {', '.join(PROTOCOLS)}")
    return protocol


class Sizes(NamedTuple):
    """The per-rank padded sizes of one step, as the DP ranks agreed on them.

    The largest rank's batch rows and flat tokens (each a scenario bucket, or 0 when no
    rank has any); a map that pads every rank to one size pads to these.
    """

    rows: int
    tokens: int


class ResolvedOut(NamedTuple):
    """What resolve hands one rank's forward (framework arrays, the rank's own rows)."""

    input_ids: Any  # [T]
    seq_lens: Any  # [B]
    draft: Any  # the twin's DraftPayload gathered for a spec DECODE batch, else None
    batch: Any  # the twin's batch object where it resolves in place (torch), else None
    # A spec MIXED batch's host fields with its running rows rebound (gather protocol):
    # (seq_lens_cpu [B], seq_lens_sum, prefix_lens [B]) as host int64; else None.
    tails: Any = None


class ForwardOut(NamedTuple):
    """What the toy model produced for one rank's batch (framework arrays, padded rows)."""

    new_lens: Any  # [B] what publish writes
    payload: Any  # what stash writes: tokens [B] or the twin's DraftPayload
    token: Any  # [B] sampled token (non-spec) or bonus token (spec)
    accept: Any  # [B] spec accept lengths, else None
    draft: Any  # the twin's DraftPayload (spec), else None


class Twin(Protocol):
    """One framework's FutureMap over DP ranks `ranks`, and its model; slots are host numpy."""

    name: str
    protocol: str  # one of PROTOCOLS, the map's
    errors: tuple[type[Exception], ...]
    ranks: tuple[int, ...]

    def error_kind(self, exc: BaseException) -> str: ...
    def snap(self, x: Any, n: int | None = None) -> Any: ...
    def host(self, x: Any) -> np.ndarray: ...
    # extras: per rank, the spec fields whose buffers to record (those a stash has written)
    def buffers(self, extras: Mapping[int, Collection[str]]) -> dict[int, dict[str, Any]]: ...
    def check(self) -> None: ...
    # The device-to-host transfers seen inside map ops since the last call (the 'sync'
    # check, fm_jax under the gather protocol); a twin without the check returns [].
    def transfers(self) -> list[str]: ...
    def mesh_report(self) -> dict[str, Any] | None: ...
    def resolve_seq_lens_cpu(
        self, slots: Mapping[int, np.ndarray], sizes: Sizes
    ) -> dict[int, np.ndarray]: ...
    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]: ...
    def forward(self, rank: int, res: ResolvedOut, hb: HostBatch, offset: int) -> ForwardOut: ...
    # `confidence` (host [B, gamma] float32 rows) and `generation` (host [R] ints) for the
    # ranks that publish confidence (fm_parity.confidence), or None.
    def publish(
        self,
        slots: Mapping[int, np.ndarray],
        lens: Mapping[int, Any],
        sizes: Sizes,
        confidence: Mapping[int, np.ndarray] | None = None,
        generation: Mapping[int, np.ndarray] | None = None,
    ) -> None: ...
    # Each rank's confidence read at host slots, waiting for its ring entry: (rows, generations)
    # as host arrays, or None.
    def resolve_confidence_cpu(
        self, slots: Mapping[int, np.ndarray]
    ) -> dict[int, tuple[np.ndarray, np.ndarray] | None]: ...
    def stash(
        self, slots: Mapping[int, np.ndarray], payload: Mapping[int, Any], sizes: Sizes
    ) -> None: ...
    def draft_payload(self, bonus: np.ndarray, draft: tm.Draft) -> Any: ...
    # Sentinel protocol only: a gather-protocol map refuses it, and the driver skips it.
    def invalidate(
        self,
        batches: Mapping[int, HostBatch],
        res: Mapping[int, ResolvedOut],
        sizes: Sizes,
    ) -> dict[int, tuple[Any, Any]]: ...


def run_forward(
    model: Any,
    payload_type: Any,
    res: ResolvedOut,
    hb: HostBatch,
    slots: Any,
    last: Any,
    spec: tm.Layout | None,
    offset: int,
    verified: bool = False,
) -> ForwardOut:
    """The toy model's forward for one rank's batch, shared by both twins.

    Args:
      model: the framework's toy model entry points (toy_model_jax or toy_model_torch).
      payload_type: the twin's DraftPayload class (spec payloads are built as it).
      res: what resolve handed the forward; hb: the host batch.
      slots, last: hb's slots and last-token indices as framework arrays.
      spec: the scenario's draft layout, or None; offset: the token offset.
      verified: the scenario relays verified ids: a spec verify hashes the gathered ones,
        and every draft it stashes carries the next (`DraftPayload.verified_id`).
    """
    if spec is None:
        tokens, new_lens = model.forward_tokens(res.input_ids, res.seq_lens, slots, last, offset)
        return ForwardOut(new_lens, tokens, tokens, None, None)
    if hb.spec_decode:
        draft = payloads.gathered(res.draft)
        accept, new_lens, nd = model.forward_spec_decode(
            draft, res.seq_lens, slots, spec, offset, verified=verified
        )
    else:
        accept, new_lens, nd = model.forward_spec_extend(
            res.input_ids, res.seq_lens, slots, last, spec, offset, verified=verified
        )
    payload = payloads.to_payload(payload_type, nd, spec)
    return ForwardOut(new_lens, payload, nd.bonus, accept, payload)
