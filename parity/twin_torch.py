"""The PyTorch side of a parity run: fm_torch.FutureMap and the toy model in torch.

resolve, the forward, publish and stash run inside the map's forward_stream() (a
separate CUDA stream on GPU, as in SGLang); invalidate runs on the schedule stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import fm_torch
from parity import exchange
from parity import toy_model_torch as model
from parity.host_batch import HostBatch
from parity.scenario import Scenario
from parity.twin import ForwardOut, ResolvedOut, run_forward

TORCH_INT = {"int32": torch.int32, "int64": torch.int64}


def torch_device(device: str) -> torch.device:
    """The torch device for 'cpu' or 'cuda'; RuntimeError when CUDA is not available."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    return torch.device(device)


class TorchTwin:
    """fm_torch.FutureMap behind the driver's twin interface (see parity.twin.Twin)."""

    name = "torch"
    errors = (fm_torch.InvariantViolation, fm_torch.FutureMapError)

    def __init__(self, scenario: Scenario, dtype: str, debug: bool, device: str) -> None:
        self.device = torch_device(device)
        self.on_host = self.device.type == "cpu"
        self.dtype = TORCH_INT[dtype]
        sp = scenario.spec
        self.spec = None if sp is None else (sp.topk, sp.hidden)
        self.fm = fm_torch.FutureMap(
            scenario.pool_size,
            device=self.device,
            dtype=self.dtype,
            spec=sp is not None,
            debug=debug,
        )

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

    def buffers(self, extras: bool) -> dict[str, Any]:
        """Buffer snapshots, slots 1..R-1 (slot 0 is padding garbage)."""
        fm = self.fm
        out = {"output_tokens": fm.output_tokens, "new_seq_lens": fm.new_seq_lens}
        if extras:
            out.update(topk_p=fm.topk_p, topk_index=fm.topk_index)
            if fm.hidden_states is not None:
                out["hidden_states"] = fm.hidden_states
        return {k: self.snap(v[1:]) for k, v in out.items()}

    def check(self) -> None:
        """Nothing is pending on CPU (violations raise at the op); sync on CUDA."""
        if not self.on_host:
            torch.cuda.synchronize(self.device)

    # -------------------------------------------------------------------------------- ops
    def resolve_seq_lens_cpu(self, slots: np.ndarray) -> np.ndarray:
        return self.fm.resolve_seq_lens_cpu(self._t(slots)).numpy()

    def resolve(self, hb: HostBatch) -> ResolvedOut:
        slots = self._t(hb.slots)
        batch = fm_torch.ScheduleBatch(
            fm_torch.ForwardMode(hb.mode),
            slots,
            self._t(hb.input_ids),
            self._t(hb.seq_lens),
            fm_torch.DraftInput(slots) if hb.spec_decode else None,
        )
        with self.fm.forward_stream():
            self.fm.resolve(batch)
        draft = None if batch.draft is None else batch.draft.payload
        return ResolvedOut(batch.input_ids, batch.seq_lens, draft, batch)

    def forward(self, res: ResolvedOut, hb: HostBatch, offset: int) -> ForwardOut:
        slots, last = self._t(hb.slots), self._t(hb.last_index)
        with self.fm.forward_stream():
            return run_forward(
                model, fm_torch.DraftPayload, res, hb, slots, last, self.spec, offset
            )

    def publish(self, slots: np.ndarray, lens: Any) -> None:
        with self.fm.forward_stream():
            self.fm.publish(self._t(slots), self._t(lens))

    def stash(self, slots: np.ndarray, payload: Any) -> None:
        if isinstance(payload, fm_torch.DraftPayload):
            payload = fm_torch.DraftPayload(
                self._t(payload.bonus_tokens),
                self._t(payload.topk_p),
                self._t(payload.topk_index),
                None if payload.hidden_states is None else self._t(payload.hidden_states),
            )
        with self.fm.forward_stream():
            self.fm.stash(self._t(slots), self._t(payload))

    def draft_payload(self, bonus: np.ndarray, draft: Any) -> Any:
        """A host draft (toy_model.Draft of numpy rows) as the map's DraftPayload."""
        return fm_torch.DraftPayload(bonus, draft.topk_p, draft.topk_index, draft.hidden)

    def invalidate(self, hb: HostBatch, res: ResolvedOut | None) -> tuple[Any, Any]:
        slots = self._t(hb.slots)
        if res is not None:
            batch = res.batch
        else:
            batch = fm_torch.ScheduleBatch(
                fm_torch.ForwardMode(hb.mode),
                slots,
                self._t(hb.input_ids),
                self._t(hb.seq_lens),
            )
        self.fm.invalidate(batch, slots)
        return batch.input_ids, batch.seq_lens
