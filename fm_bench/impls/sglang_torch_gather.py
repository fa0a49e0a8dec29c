"""SGLang's current FutureMap: the relay with no sentinels (the gather protocol).

Follows `python/sglang/srt/managers/overlap_utils.py` in sgl-project/sglang at commit
0178132 (docs/CONTRACT.md, 'Two protocols'): the same int64 buffers as the sentinel-era class
(`fm_bench.impls.sglang_torch`), the same publish and stash, and no invalidate. At forward entry
(`resolve_forward_inputs`) the relay builds the forward's ids by batch kind:

- a prefill or MIXED batch copies its prefill ids from host staging to the device
  (`prefill_input_ids_cpu.to(device, non_blocking=True)`; a no-op on a CPU device) and, MIXED,
  appends the running rows' tokens: `cat(prefill, output_tokens[mix_running_indices])`;
- a non-spec DECODE batch, which comes without ids: `output_tokens[req_pool_indices]`;
- a spec batch with a draft: the lengths the last publish wrote,
  `seq_lens = new_seq_lens[future_indices]` (what `resolve_seq_lens_cpu` does on the device;
  modelled with `needs_cpu_seq_lens` off, so no host copy), then the extras and bonus tokens
  at the same indices. On CUDA SGLang gathers the extras in one Triton kernel; this model
  uses its torch fallback, one index gather per buffer.

No `seq_lens > 0` assert: lengths are the host's (non-spec) or gathered for the draft. Debug
is SGLang's CI mode, as in the sentinel-era model: every gather from `output_tokens` is
followed by the fused `values >= 0` assert and -1 written back at the slots gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fm_bench.impls import Op
from fm_bench.impls.sglang_torch import (
    DraftInfo,
    SGLangRelayBuffers,
    scheduler_tensors,
    spec_shape,
)
from fm_bench.impls.torch_common import device, relay_ops, tensors
from fm_bench.workload import Config, HostData


@dataclass
class Batch:
    """The fields of SGLang's current ScheduleBatch that its relay reads and rewrites.

    `input_ids` is None until resolve builds it; `prefill_input_ids_cpu` holds a prefill or
    MIXED batch's prefill ids on the host, `mix_running_indices` a MIXED batch's running
    slots; both are cleared by resolve. `spec_info.indices` are the future indices.
    """

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    input_ids: torch.Tensor | None = None
    prefill_input_ids_cpu: torch.Tensor | None = None
    mix_running_indices: torch.Tensor | None = None
    spec_info: DraftInfo | None = None


class SGLangGatherFutureMap(SGLangRelayBuffers):
    """SGLang's current relay: the sentinel-era class's int64 buffers, publish and stash
    (unchanged in SGLang), with resolve rebuilt and no invalidate (see the module)."""

    def resolve_seq_lens(self, batch: Batch) -> None:
        """Spec: `seq_lens := new_seq_lens[future_indices]` once the last publish landed
        (no host copy: `needs_cpu_seq_lens` off)."""
        draft = batch.spec_info
        if draft is None:
            return
        if self.publish_ready is not None:
            self.publish_ready.wait()
        batch.seq_lens = self.new_seq_lens[draft.indices]

    def resolve_forward_inputs(self, batch: Batch) -> None:
        """Build the forward's ids at its entry (see the module docstring), in place."""
        if batch.prefill_input_ids_cpu is not None:
            prefill = batch.prefill_input_ids_cpu.to(self.dev, non_blocking=True)
            mix = batch.mix_running_indices
            if mix is not None:
                running = self.output_tokens[mix]
                if self.debug:
                    self._check(running, self.output_tokens, mix)
                batch.input_ids = torch.cat([prefill, running])
            else:
                batch.input_ids = prefill
            batch.prefill_input_ids_cpu = None
            batch.mix_running_indices = None
        elif batch.input_ids is None and self.spec is None:
            batch.input_ids = self.output_tokens[batch.req_pool_indices]
            if self.debug:
                self._check(batch.input_ids, self.output_tokens, batch.req_pool_indices)
        if self.spec is not None:
            self._resolve_spec_extras(batch)

    def _resolve_spec_extras(self, batch: Batch) -> None:
        draft = batch.spec_info
        if draft is None or draft.indices.shape[0] == 0:
            return  # prefill: no draft yet; or DP idle
        idx = draft.indices
        if self.dev.type == "cuda":
            idx.record_stream(torch.cuda.current_stream(self.dev))
        draft.topk_p = self.topk_p[idx]
        draft.topk_index = self.topk_index[idx]
        draft.bonus_tokens = self.output_tokens[idx]
        draft.hidden_states = self.hidden_states[idx]
        if self.debug:
            self._check(draft.bonus_tokens, self.output_tokens, idx)

    def resolve(self, batch: Batch) -> None:
        """A step's head, in SGLang's order: the spec lengths, then the forward's inputs."""
        self.resolve_seq_lens(batch)
        self.resolve_forward_inputs(batch)


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """SGLang's current relay on `device()` for `cfg` (a gather-protocol configuration).

    'step' (resolve, publish, stash) returns what its resolve produced: (input_ids,
    seq_lens, draft info); the resolve ops return the resolved batch.
    """
    dev = device()
    t = tensors(dev)
    i64 = torch.int64
    fm = SGLangGatherFutureMap(cfg.pool, dev, spec=spec_shape(cfg), debug=debug)
    idx, lens, payload = scheduler_tensors(cfg, data, dev)
    # A MIXED batch's running slots on the device, its prefill ids in host staging.
    mixed_lens, running = t(data.mixed_lens, i64), t(data.mixed_running, i64)
    prefill_cpu = torch.as_tensor(data.mixed_prefill).to(i64)

    def decode_batch() -> Batch:
        # No ids: resolve gathers them (spec: the host's lengths, replaced by the gathered).
        return Batch(idx, lens, spec_info=DraftInfo(idx) if cfg.spec else None)

    def mixed_batch() -> Batch:
        return Batch(
            idx, mixed_lens, prefill_input_ids_cpu=prefill_cpu, mix_running_indices=running
        )

    def end_step(b: Batch) -> tuple[torch.Tensor | None, torch.Tensor, DraftInfo | None]:
        # The scheduler's order: resolve, (forward), publish, stash; no invalidate. Publish
        # and stash write only the map's buffers, so the batch still holds what resolve
        # produced.
        out = (b.input_ids, b.seq_lens, b.spec_info)
        # The next batch: its ids empty, its lengths the host's, a fresh draft input.
        b.input_ids, b.seq_lens = None, lens
        if cfg.spec:
            b.spec_info = DraftInfo(idx)
        return out

    batches = (decode_batch, mixed_batch)
    return relay_ops(fm, dev, idx, lens, payload, batches, end_step, None, spec=cfg.spec, ops=ops)
