"""SGLang's FutureMap as it runs in production: the request-pool-indexed relay with sentinels.

This module models the sentinel protocol; a gather-protocol configuration is built by
`fm_bench.impls.sglang_torch_gather`, SGLang's current class (docs/CONTRACT.md, 'Two protocols').

Follows `python/sglang/srt/managers/overlap_utils.py` in sgl-project/sglang as of late May
2026 (PRs #25862, #25922, #25944, #25962, #26108; docs/CONTRACT.md). Buffers are preallocated int64
(`output_tokens`, `new_seq_lens`; spec: `topk_p` float32, `topk_index` int64, `hidden_states`
in the draft's dtype), one row per request-pool slot, whatever the configuration's dtype.
Every op is eager indexing on the device; nothing reads a value back to the host:

- publish: `new_seq_lens[indices] := lens` (empty indices: nothing);
- stash: `output_tokens[indices] := tokens` (spec: bonus tokens, then the extras);
- resolve: a DECODE batch gathers its lengths, `new_seq_lens[req_pool_indices]`, and asserts
  them positive with `torch._assert_async` (always on); then, without spec,
  `input_ids[:] = where(ids < 0, output_tokens[clamp(-ids, min=0)], ids)` in place, or, with
  a draft, gathers the extras and bonus tokens at its indices;
- invalidate: `input_ids := seq_lens := -indices`.

Debug is SGLang's CI mode: `output_tokens` starts at -1 and every gather from it is followed
by one fused check-and-poison, `values >= 0` asserted and -1 written back at the batch's
slots (torch.compile'd with `torch._assert_async` on CUDA, as in SGLang; eager on CPU, where
`torch._assert_async` checks at once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fm_bench.impls import Op
from fm_bench.impls.torch_common import HIDDEN, device, relay_ops, tensors
from fm_bench.workload import Config, HostData


def _check_and_poison(values: torch.Tensor, buf: torch.Tensor, indices: torch.Tensor) -> None:
    """Consume check: every gathered value is >= 0; the gathered slots go back to -1."""
    torch._assert_async((values >= 0).all())
    buf[indices] = -1


_compiled_check: Callable[..., None] | None = None


def _check_fn(dev: torch.device) -> Callable[..., None]:
    """The consume check as the device runs it: one compiled kernel on CUDA, eager on CPU."""
    global _compiled_check
    if dev.type != "cuda":
        return _check_and_poison
    if _compiled_check is None:
        _compiled_check = torch.compile(_check_and_poison, dynamic=True)
    return _compiled_check


@dataclass
class DraftInfo:
    """A spec batch's draft input: the slots to gather from, then what was gathered."""

    indices: torch.Tensor
    topk_p: torch.Tensor | None = None
    topk_index: torch.Tensor | None = None
    bonus_tokens: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


@dataclass
class Batch:
    """The fields of SGLang's ScheduleBatch that the FutureMap reads and rewrites."""

    is_decode: bool
    req_pool_indices: torch.Tensor
    input_ids: torch.Tensor
    seq_lens: torch.Tensor
    spec_info: DraftInfo | None = None


@dataclass
class Draft:
    """What a spec forward hands to stash."""

    bonus_tokens: torch.Tensor
    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden_states: torch.Tensor | None


class SGLangRelayBuffers:
    """SGLang's relay buffers with their writes, the same in its sentinel-era class and its
    current one: int64 buffers of `pool_size` rows on `dev`, publish and stash.

    Args:
      pool_size: R, request-pool rows (slot 0 is the padding row).
      dev: the buffers' device.
      spec: relay the draft extras, shaped (K, H, hidden dtype) as given.
      debug: SGLang's CI mode (consume tracking).
    """

    def __init__(
        self,
        pool_size: int,
        dev: torch.device,
        *,
        spec: tuple[int, int, torch.dtype] | None = None,
        debug: bool = False,
    ) -> None:
        self.dev, self.spec, self.debug = dev, spec, debug
        r = pool_size
        if debug:
            self.output_tokens = torch.full((r,), -1, dtype=torch.int64, device=dev)
        else:
            self.output_tokens = torch.empty((r,), dtype=torch.int64, device=dev)
        self.new_seq_lens = torch.empty((r,), dtype=torch.int64, device=dev)
        self.publish_ready: torch.Event | None = None
        self._check = _check_fn(dev)
        if spec is not None:
            k, h, hidden_dtype = spec
            self.topk_p = torch.empty((r, k), dtype=torch.float32, device=dev)
            self.topk_index = torch.empty((r, k), dtype=torch.int64, device=dev)
            self.hidden_states = torch.empty((r, h), dtype=hidden_dtype, device=dev)

    def publish(self, indices: torch.Tensor, new_seq_lens: torch.Tensor) -> None:
        """`new_seq_lens[indices] := new_seq_lens`; spec on an accelerator records an event."""
        if indices.shape[0] == 0:
            return  # DP idle
        self.new_seq_lens[indices] = new_seq_lens.to(self.new_seq_lens.dtype)
        if self.spec is not None and self.dev.type != "cpu":
            if self.publish_ready is None:
                self.publish_ready = torch.Event(device=self.dev)
            self.publish_ready.record()

    def stash(self, indices: torch.Tensor, payload: torch.Tensor | Draft) -> None:
        """Tokens (or a draft's bonus tokens and extras) at `indices`."""
        if indices.shape[0] == 0:
            return  # DP idle: the payload is an empty stub
        if isinstance(payload, torch.Tensor):
            self.output_tokens[indices] = payload.to(torch.int64)
            return
        self.output_tokens[indices] = payload.bonus_tokens.to(self.output_tokens.dtype)
        self.topk_p[indices] = payload.topk_p.to(self.topk_p.dtype)
        self.topk_index[indices] = payload.topk_index.to(self.topk_index.dtype)
        if payload.hidden_states is not None:
            self.hidden_states[indices] = payload.hidden_states.to(self.hidden_states.dtype)


class SGLangFutureMap(SGLangRelayBuffers):
    """The production relay of late May 2026: the buffers, publish and stash, then resolve
    and invalidate by sentinels."""

    def resolve(self, batch: Batch) -> None:
        """Fill the batch at forward entry, in place (lengths, then ids or draft extras)."""
        if batch.is_decode:
            batch.seq_lens = self.new_seq_lens[batch.req_pool_indices]
            torch._assert_async((batch.seq_lens > 0).all())
        if self.spec is None:
            ids = batch.input_ids
            ids[:] = torch.where(ids < 0, self.output_tokens[torch.clamp(-ids, min=0)], ids)
            if self.debug:
                self._check(ids, self.output_tokens, batch.req_pool_indices)
            return
        draft = batch.spec_info
        if draft is None:
            return  # prefill: no draft yet
        idx = draft.indices
        draft.topk_p = self.topk_p[idx]
        draft.topk_index = self.topk_index[idx]
        draft.bonus_tokens = self.output_tokens[idx]
        draft.hidden_states = self.hidden_states[idx]
        if self.debug:
            self._check(draft.bonus_tokens, self.output_tokens, idx)

    def invalidate(self, batch: Batch, indices: torch.Tensor) -> None:
        """Sentinels for the next step: `input_ids := seq_lens := -indices`."""
        sentinel = -indices
        batch.input_ids = sentinel
        batch.seq_lens = sentinel


def spec_shape(cfg: Config) -> tuple[int, int, torch.dtype] | None:
    """The draft extras' (K, H, hidden dtype) of a spec `cfg`, else None."""
    return (cfg.topk, cfg.hidden, HIDDEN[cfg.hidden_dtype]) if cfg.spec else None


def scheduler_tensors(
    cfg: Config, data: HostData, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | Draft]:
    """As SGLang's scheduler holds them on `dev`: the int64 slots and lengths, and what a
    forward stashes (the sampled tokens; spec: a `Draft` of them and the extras)."""
    t = tensors(dev)
    i64 = torch.int64
    idx, tokens, lens = t(data.idx, i64), t(data.tokens, i64), t(data.lens, i64)
    if not cfg.spec:
        return idx, lens, tokens
    extras = t(data.topk_p, torch.float32), t(data.topk_index, i64)
    return idx, lens, Draft(tokens, *extras, t(data.hidden, HIDDEN[cfg.hidden_dtype]))


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """The production ops of `cfg` (a sentinel-protocol configuration) on `device()`: the
    sentinel-era class.

    'step' returns what its resolve produced: (input_ids, seq_lens, draft info); the
    resolve ops return the resolved batch.
    """
    dev = device()
    t = tensors(dev)
    fm = SGLangFutureMap(cfg.pool, dev, spec=spec_shape(cfg), debug=debug)
    idx, lens, payload = scheduler_tensors(cfg, data, dev)
    mixed_ids, mixed_lens = t(data.mixed_ids, torch.int64), t(data.mixed_lens, torch.int64)

    def decode_batch() -> Batch:
        draft = DraftInfo(idx) if cfg.spec else None
        return Batch(True, idx, -idx, -idx, draft)

    def mixed_batch() -> Batch:
        return Batch(False, idx, mixed_ids.clone(), mixed_lens)

    def end_step(b: Batch) -> tuple[torch.Tensor, torch.Tensor, DraftInfo | None]:
        # The scheduler's order: resolve, (forward), publish, stash, invalidate. Publish and
        # stash write only the map's buffers, so the batch still holds what resolve produced.
        out = (b.input_ids, b.seq_lens, b.spec_info)
        fm.invalidate(b, idx)
        if cfg.spec:
            b.spec_info = DraftInfo(idx)  # the next forward's draft input
        return out

    batches = (decode_batch, mixed_batch)
    return relay_ops(
        fm, dev, idx, lens, payload, batches, end_step, fm.invalidate, spec=cfg.spec, ops=ops
    )
