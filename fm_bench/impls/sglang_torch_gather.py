"""SGLang's current FutureMap: the relay with no sentinels (the gather protocol).

Follows `python/sglang/srt/managers/overlap_utils.py` in sgl-project/sglang: the relay with no
sentinels of commit 0178132 (docs/CONTRACT.md, 'Two protocols'), as the class stands in late
2026. The same int64 buffers as the sentinel-era class (`fm_bench.impls.sglang_torch`), the
same stash, and no invalidate. Publish writes the lengths and, on a spec map, records the
publish event (`publish_ready`, on whatever device the map is on, as SGLang's
`torch.get_device_module(device).Event()`) and arms the consume-once flag.

A step's head is two calls, in SGLang's order:

- `resolve_seq_lens_cpu` (spec batches with a draft): wait on the publish event on the
  current stream (`synchronize()` on ROCm, SGLang's MI355 workaround), gather
  `seq_lens = new_seq_lens[future_indices]`, then the host copy of the lengths:

  - `needs_cpu_seq_lens` off: none; the lengths stay on the device (`seq_lens_cpu` and
    `seq_lens_sum` None);
  - CUDA (not ROCm), once a spec publish has recorded the event: a private D2H stream waits
    on that event and copies the WHOLE `new_seq_lens` into a static pinned host buffer
    (non-blocking), the host waits for that stream alone and indexes the pinned copy with
    the batch's host slots, `req_pool_indices_cpu`;
  - otherwise (CPU, ROCm, or before the first spec publish): `seq_lens.cpu()`;

  with a host copy, `seq_lens_sum` is its sum.
- `resolve_forward_inputs` (forward entry) builds the forward's ids by batch kind:

  - a prefill or MIXED batch copies its prefill ids from host staging to the device
    (`prefill_input_ids_cpu.to(device, non_blocking=True)`; a no-op on a CPU device) and,
    MIXED, appends the running rows' tokens: `cat(prefill, output_tokens[mix_running_indices])`;
  - a non-spec DECODE batch, which comes without ids: `output_tokens[req_pool_indices]`;
  - a spec batch with a draft: the extras and bonus tokens at its future indices. SGLang
    gathers the four buffers (topk_p, topk_index, bonus tokens, hidden states) in one Triton
    launch (`gather_spec_extras`). Torch has no fused multi-buffer gather and this repository
    writes no kernels, so `gather_spec_extras` here is one `index_select` per buffer: each
    buffer's rows read once, the same bytes moved, but four launches where SGLang makes one
    (on CUDA the peer pays three launches more than SGLang on a spec resolve).

No `seq_lens > 0` assert: lengths are the host's (non-spec) or gathered for the draft. Not
modelled: the spec MIXED tails (`resolve_mixed_spec_tails`; the bench times no spec MIXED
batch, so this model refuses one), the n-gram and DSA relays, the confidence relay and the
NPU `seq_lens_cpu_last` mirror.

Debug is SGLang's CI mode, as in the sentinel-era model: `output_tokens` and `new_seq_lens`
start at -1; every gather from `output_tokens`, and every resolve of spec lengths, is
followed by the fused `values >= 0` assert and -1 written back at the slots gathered; a
resolve that waits on the publish event without a publish since the last one fails.
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
    `req_pool_indices_cpu` is the host's copy of the slots (read by the pinned host copy);
    `seq_lens_cpu` and `seq_lens_sum` are what `resolve_seq_lens_cpu` leaves on the host.
    """

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    input_ids: torch.Tensor | None = None
    prefill_input_ids_cpu: torch.Tensor | None = None
    mix_running_indices: torch.Tensor | None = None
    spec_info: DraftInfo | None = None
    req_pool_indices_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    seq_lens_sum: int | None = None


def gather_spec_extras(
    indices: torch.Tensor,
    topk_p: torch.Tensor,
    topk_index: torch.Tensor,
    output_tokens: torch.Tensor,
    hidden_states: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rows at `indices` of the four spec buffers: (topk_p, topk_index, bonus tokens,
    hidden states or None). One `index_select` per buffer (see the module docstring)."""
    hidden = None if hidden_states is None else hidden_states.index_select(0, indices)
    return (
        topk_p.index_select(0, indices),
        topk_index.index_select(0, indices),
        output_tokens.index_select(0, indices),
        hidden,
    )


class SGLangGatherFutureMap(SGLangRelayBuffers):
    """SGLang's current relay: the sentinel-era class's int64 buffers and stash (unchanged
    in SGLang), publish with its event, resolve rebuilt and no invalidate (see the module).

    Args:
      pool_size, dev, spec, debug: as `SGLangRelayBuffers`.
      needs_cpu_seq_lens: `resolve_seq_lens_cpu` leaves a host copy of the spec lengths
        (SGLang's default, True); False: the lengths stay on the device.
    """

    def __init__(
        self,
        pool_size: int,
        dev: torch.device,
        *,
        spec: tuple[int, int, torch.dtype] | None = None,
        debug: bool = False,
        needs_cpu_seq_lens: bool = True,
    ) -> None:
        super().__init__(pool_size, dev, spec=spec, debug=debug)
        self.needs_cpu_seq_lens = needs_cpu_seq_lens
        if debug:
            self.new_seq_lens.fill_(-1)  # CI mode: every slot published before it is read
        self._rocm = dev.type == "cuda" and torch.version.hip is not None
        # CUDA only: the static pinned host copy of new_seq_lens and the private stream that
        # fills it (SGLang allocates both whether or not the host copy is needed).
        self._lens_pinned: torch.Tensor | None = None
        self._d2h_stream: torch.cuda.Stream | None = None
        if dev.type == "cuda" and not self._rocm:
            self._lens_pinned = torch.empty((pool_size,), dtype=torch.int64, pin_memory=True)
            self._d2h_stream = torch.cuda.Stream(dev)
        self._publish_fresh = False  # armed by a spec publish, consumed by a resolve

    def publish(self, indices: torch.Tensor, new_seq_lens: torch.Tensor) -> None:
        """`new_seq_lens[indices] := new_seq_lens`; spec: record the publish event."""
        if indices.shape[0] == 0:
            return  # DP idle
        self.new_seq_lens[indices] = new_seq_lens.to(self.new_seq_lens.dtype)
        if self.spec is not None:
            if self.publish_ready is None:
                self.publish_ready = torch.get_device_module(self.dev).Event()
            self.publish_ready.record()
            self._publish_fresh = True

    def resolve_seq_lens_cpu(self, batch: Batch) -> None:
        """Spec: `seq_lens := new_seq_lens[future_indices]` behind the publish event, then
        the host copy `needs_cpu_seq_lens` asks for (see the module docstring)."""
        draft = batch.spec_info
        if draft is None:
            return
        fi = draft.indices
        ready = self.publish_ready
        if ready is not None:
            if self.debug:
                if not self._publish_fresh:
                    raise RuntimeError("resolve without a fresh publish")
                self._publish_fresh = False
            if self._rocm:
                ready.synchronize()
            else:
                ready.wait()
        batch.seq_lens = self.new_seq_lens[fi]
        stream, pinned = self._d2h_stream, self._lens_pinned
        if not self.needs_cpu_seq_lens:
            batch.seq_lens_cpu = batch.seq_lens_sum = None
        elif stream is None or pinned is None or ready is None:
            batch.seq_lens_cpu = batch.seq_lens.cpu()  # non-CUDA, or no spec publish yet
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        else:
            # CUDA: the copy waits on the publish alone, not on the current stream.
            host_ids = batch.req_pool_indices_cpu
            if host_ids is None:
                raise ValueError("the pinned host copy needs req_pool_indices_cpu")
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                pinned.copy_(self.new_seq_lens, non_blocking=True)
            stream.synchronize()
            batch.seq_lens_cpu = pinned[host_ids]
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        if self.debug:
            # After any host copy: the pinned buffer holds the lengths, not the poison.
            self._check(batch.seq_lens, self.new_seq_lens, fi)

    def resolve_forward_inputs(self, batch: Batch) -> None:
        """Build the forward's ids at its entry (see the module docstring), in place."""
        if batch.prefill_input_ids_cpu is not None:
            prefill = batch.prefill_input_ids_cpu.to(self.dev, non_blocking=True)
            mix = batch.mix_running_indices
            if mix is not None:
                if self.spec is not None:
                    raise NotImplementedError("spec MIXED batch (resolve_mixed_spec_tails)")
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
        draft.topk_p, draft.topk_index, draft.bonus_tokens, draft.hidden_states = (
            gather_spec_extras(
                idx, self.topk_p, self.topk_index, self.output_tokens, self.hidden_states
            )
        )
        if self.debug:
            self._check(draft.bonus_tokens, self.output_tokens, idx)

    def resolve(self, batch: Batch) -> None:
        """A step's head, in SGLang's order: the spec lengths, then the forward's inputs."""
        self.resolve_seq_lens_cpu(batch)
        self.resolve_forward_inputs(batch)


def build(cfg: Config, data: HostData, debug: bool, ops: Sequence[str]) -> dict[str, Op]:
    """SGLang's current relay on `device()` for `cfg` (a gather-protocol configuration).

    As the bench's fm_jax maps, with `needs_cpu_seq_lens` off: the spec lengths stay on the
    device. 'step' (resolve, publish, stash) returns what its resolve produced: (input_ids,
    seq_lens, draft info); the resolve ops return the resolved batch.
    """
    dev = device()
    t = tensors(dev)
    i64 = torch.int64
    fm = SGLangGatherFutureMap(
        cfg.pool, dev, spec=spec_shape(cfg), debug=debug, needs_cpu_seq_lens=False
    )
    idx, lens, payload = scheduler_tensors(cfg, data, dev)
    idx_cpu = torch.as_tensor(data.idx).to(i64)  # the scheduler's host copy of the slots
    # A MIXED batch's running slots on the device, its prefill ids in host staging.
    mixed_lens, running = t(data.mixed_lens, i64), t(data.mixed_running, i64)
    prefill_cpu = torch.as_tensor(data.mixed_prefill).to(i64)

    def decode_batch() -> Batch:
        # No ids: resolve gathers them (spec: the host's lengths, replaced by the gathered).
        draft = DraftInfo(idx) if cfg.spec else None
        return Batch(idx, lens, spec_info=draft, req_pool_indices_cpu=idx_cpu)

    def mixed_batch() -> Batch:
        return Batch(
            idx,
            mixed_lens,
            prefill_input_ids_cpu=prefill_cpu,
            mix_running_indices=running,
            req_pool_indices_cpu=idx_cpu,
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
    # Every resolve of a spec map consumes a publish (its event; debug: the lengths too), so
    # an op's setup publishes again before it stashes.
    return relay_ops(
        fm,
        dev,
        idx,
        lens,
        payload,
        batches,
        end_step,
        None,
        spec=cfg.spec,
        ops=ops,
        republish=True,
    )
