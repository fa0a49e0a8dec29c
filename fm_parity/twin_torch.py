"""The PyTorch side of a parity run: one fm_torch.FutureMap per DP rank, and the toy model.

As in SGLang, every DP rank has its own FutureMap; one device holds them all. resolve, the
forward, publish and stash run inside a map's forward_stream() (a separate CUDA stream on
GPU, as in SGLang); invalidate (sentinel protocol only) runs on the schedule stream.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

import fm_torch
from fm_parity import exchange, payloads
from fm_parity import toy_model as tm
from fm_parity import toy_model_torch as model
from fm_parity.host_batch import HostBatch
from fm_parity.scenario import Scenario
from fm_parity.twin import ForwardOut, ResolvedOut, Sizes, check_protocol, run_forward

TORCH_INT = {"int32": torch.int32, "int64": torch.int64}


def torch_device(device: str) -> torch.device:
    """The torch device for 'cpu' or 'cuda'; RuntimeError when CUDA is not available."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    return torch.device(device)


class TorchTwin:
    """fm_torch.FutureMap per DP rank behind the driver's twin interface (fm_parity.twin.Twin).

    Args:
      scenario: the scenario every rank runs a seed of (pool size, spec).
      dtype: 'int32' or 'int64'.
      debug: the maps' debug mode.
      device: 'cpu' or 'cuda'.
      ranks: the DP ranks to hold a map for.
      protocol: the maps' relay protocol, 'sentinel' or 'gather' (fm_parity.twin.PROTOCOLS).
    """

    name = "torch"
    errors: tuple[type[Exception], ...] = (fm_torch.InvariantViolation, fm_torch.FutureMapError)

    def __init__(
        self,
        scenario: Scenario,
        dtype: str,
        debug: bool,
        device: str,
        *,
        ranks: tuple[int, ...] = (0,),
        protocol: str = "sentinel",
    ) -> None:
        self.device = torch_device(device)
        self.protocol = check_protocol(protocol)
        self.on_host = self.device.type == "cpu"
        self.dtype = TORCH_INT[dtype]
        sp = scenario.spec
        self.spec = None if sp is None else payloads.layout(sp)
        # fm_torch relays verified ids when the first draft stashed brings them: every
        # draft of a verified-id scenario does (forward, bootstrap and IDLE alike).
        self.verified = sp is not None and sp.verified_id
        self.ranks = tuple(ranks)
        # An engine-owned relay: each rank's lengths and tokens buffers, which its maps
        # adopt and its engine writes itself (`publish`, `stash`).
        r_ = scenario.pool_size
        self.relay = {
            r: fm_torch.RelayBuffers(
                torch.empty(r_, dtype=self.dtype, device=self.device),
                torch.empty(r_, dtype=self.dtype, device=self.device),
            )
            for r in self.ranks
            if scenario.owned_relay
        }
        self.fms = {
            r: fm_torch.FutureMap(
                scenario.pool_size,
                device=self.device,
                dtype=self.dtype,
                spec=sp is not None,
                debug=debug,
                protocol=self.protocol,
                relay=self.relay.get(r),
                needs_confidence_relay=sp is not None and sp.confidence > 0,
            )
            for r in self.ranks
        }

    # ---------------------------------------------------------------------------- helpers
    def error_kind(self, exc: BaseException) -> str:
        """'debug' for an invariant violation, 'checks' for rejected input."""
        return "debug" if isinstance(exc, fm_torch.InvariantViolation) else "checks"

    def _t(self, x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return exchange.to_torch(x).to(self.device)
        return x

    def snap(self, x: Any, n: int | None = None) -> Any:
        """A copy of `x` (first `n` rows) that the next in-place op cannot change."""
        if n is not None:
            x = x[:n]
        if self.on_host:
            return exchange.to_numpy(x.clone())
        torch.cuda.synchronize(self.device)
        return x.clone()

    def host(self, x: Any) -> np.ndarray:
        """`x` on the host."""
        return exchange.to_numpy(x)

    def buffers(self, extras: Mapping[int, Collection[str]]) -> dict[int, dict[str, Any]]:
        """Each rank's buffer snapshots, slots 1..R-1 (slot 0 is padding garbage): the
        spec buffers of the fields in `extras[rank]` only (a stash has made each)."""
        out: dict[int, dict[str, Any]] = {}
        for rank, spec in extras.items():
            fm = self.fms[rank]
            bufs: dict[str, torch.Tensor] = {
                "output_tokens": fm.output_tokens,
                "new_seq_lens": fm.new_seq_lens,
            }
            if spec:
                kept = {
                    "topk_p": fm.topk_p,
                    "topk_index": fm.topk_index,
                    "hidden_states": fm.hidden_states,
                    "verified_id": fm.verified_id,
                }
                bufs.update(
                    {k: v for k, v in (kept | fm.extras).items() if v is not None and k in spec}
                )
            out[rank] = {k: self.snap(v[1:]) for k, v in bufs.items()}
        return out

    def check(self) -> None:
        """Nothing is pending on CPU (violations raise at the op); sync on CUDA."""
        if not self.on_host:
            torch.cuda.synchronize(self.device)

    def mesh_report(self) -> dict[str, Any] | None:
        """None: the torch maps live on one device."""
        return None

    def _payload(self, payload: Any) -> Any:
        if isinstance(payload, fm_torch.DraftPayload):
            return payloads.convert(payload, self._t)
        return self._t(payload)

    def transfers(self) -> list[str]:
        """No 'sync' check on fm_torch's maps: always []."""
        return []

    # -------------------------------------------------------------------------------- ops
    def resolve_seq_lens_cpu(
        self, slots: Mapping[int, np.ndarray], sizes: Sizes
    ) -> dict[int, np.ndarray]:
        return {r: self.fms[r].resolve_seq_lens_cpu(self._t(s)).numpy() for r, s in slots.items()}

    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]:
        out = {}
        for r, hb in batches.items():
            slots = self._t(hb.slots)
            batch = fm_torch.ScheduleBatch(
                fm_torch.ForwardMode(hb.mode),
                slots,
                self._t(hb.input_ids),
                self._t(hb.seq_lens),
                fm_torch.DraftInput(slots) if hb.spec_decode else None,
            )
            if self.protocol == "gather":
                self._gather_layout(batch, hb)
            with self.fms[r].forward_stream():
                self.fms[r].resolve(batch)
            draft = None if batch.draft is None else batch.draft.payload
            tails = None
            if batch.seq_lens_cpu is not None:
                assert batch.prefix_lens is not None and batch.seq_lens_sum is not None
                prefix = np.array(batch.prefix_lens, np.int64)
                tails = (batch.seq_lens_cpu.numpy(), batch.seq_lens_sum, prefix)
            out[r] = ResolvedOut(batch.input_ids, batch.seq_lens, draft, batch, tails)
        return out

    def _gather_layout(self, batch: Any, hb: HostBatch) -> None:
        """The gather protocol's host batch, SGLang's layout: a non-spec DECODE batch brings
        no ids; a MIXED batch brings only its prefill ids (unpadded: the running rows' tokens
        are appended after them) and its running rows' slots."""
        if hb.mode == fm_torch.ForwardMode.DECODE and self.spec is None:
            batch.input_ids = None
        elif hb.mode == fm_torch.ForwardMode.MIXED:
            batch.input_ids = self._t(hb.input_ids[: hb.n_prefill_tokens])
            batch.mix_running_indices = self._t(hb.running)
            if self.spec is not None:  # the host's fields, rebound by resolve (as SGLang's)
                batch.seq_lens_cpu = torch.from_numpy(hb.seq_lens.astype(np.int64))
                batch.prefix_lens = hb.prefix_lens.tolist()

    def forward(self, rank: int, res: ResolvedOut, hb: HostBatch, offset: int) -> ForwardOut:
        slots, last = self._t(hb.slots), self._t(hb.last_index)
        with self.fms[rank].forward_stream():
            return run_forward(
                model, fm_torch.DraftPayload, res, hb, slots, last, self.spec, offset, self.verified
            )

    def publish(
        self,
        slots: Mapping[int, np.ndarray],
        lens: Mapping[int, Any],
        sizes: Sizes,
        confidence: Mapping[int, np.ndarray] | None = None,
        generation: Mapping[int, np.ndarray] | None = None,
    ) -> None:
        conf, gens = confidence or {}, generation or {}
        for r, s in slots.items():
            idx, rows = self._t(s), self._t(lens[r])
            relay = self.relay.get(r)
            with self.fms[r].forward_stream():
                if relay is not None and len(s):  # the engine writes its rows itself
                    relay.new_seq_lens[idx] = rows.to(self.dtype)
                    relay.published_seq_lens = rows
                if r in conf:  # the host's generation counters stay on the host
                    self.fms[r].publish(
                        idx,
                        rows,
                        confidence=self._t(conf[r]),
                        generation=torch.from_numpy(gens[r]),
                    )
                else:
                    self.fms[r].publish(idx, rows)

    def resolve_confidence_cpu(
        self, slots: Mapping[int, np.ndarray]
    ) -> dict[int, tuple[np.ndarray, np.ndarray] | None]:
        out: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}
        for r, s in slots.items():
            got = self.fms[r].resolve_confidence_cpu(torch.from_numpy(s), wait=True)
            out[r] = None if got is None else (got.confidence.numpy(), got.generation.numpy())
        return out

    def stash(
        self, slots: Mapping[int, np.ndarray], payload: Mapping[int, Any], sizes: Sizes
    ) -> None:
        for r, s in slots.items():
            idx, p = self._t(s), self._payload(payload[r])
            relay = self.relay.get(r)
            with self.fms[r].forward_stream():
                tokens = getattr(p, "bonus_tokens", p)
                if relay is not None and len(s) and tokens is not None:
                    relay.output_tokens[idx] = tokens.to(self.dtype)
                    relay.published_bonus = tokens
                self.fms[r].stash(idx, p)

    def draft_payload(self, bonus: np.ndarray, draft: tm.Draft) -> Any:
        """A host draft (toy_model.Draft of numpy rows) as the map's DraftPayload."""
        assert self.spec is not None
        host = payloads.to_payload(fm_torch.DraftPayload, draft._replace(bonus=bonus), self.spec)
        return payloads.convert(host, self._t)

    def invalidate(
        self,
        batches: Mapping[int, HostBatch],
        res: Mapping[int, ResolvedOut],
        sizes: Sizes,
    ) -> dict[int, tuple[Any, Any]]:
        out = {}
        for r, hb in batches.items():
            slots = self._t(hb.slots)
            if r in res:
                batch = res[r].batch  # the batch this step resolved (in place)
            else:
                batch = fm_torch.ScheduleBatch(
                    fm_torch.ForwardMode(hb.mode),
                    slots,
                    self._t(hb.input_ids),
                    self._t(hb.seq_lens),
                )
            self.fms[r].invalidate(batch, slots)
            out[r] = (batch.input_ids, batch.seq_lens)
        return out
