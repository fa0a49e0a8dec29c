"""The JAX side of a parity run: fm_jax.FutureMap fed numpy host batches, and the toy model.

Host inputs are numpy arrays padded to the scenario's buckets; the map's own buckets are
set to the same sizes, so it pads nothing further and its outputs line up row for row
with the torch twin's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax
from parity import exchange
from parity import toy_model_jax as model
from parity.host_batch import HostBatch
from parity.scenario import Scenario
from parity.twin import ForwardOut, ResolvedOut, run_forward


def jax_device(device: str) -> jax.Device:
    """The JAX device for 'cpu' or 'cuda'; RuntimeError naming what is missing."""
    if device == "cpu":
        return jax.devices("cpu")[0]
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as e:
        raise RuntimeError(f"--device cuda: JAX sees no GPU ({e})") from e


class JaxTwin:
    """fm_jax.FutureMap behind the driver's twin interface (see parity.twin.Twin)."""

    name = "jax"
    errors = (fm_jax.InvariantViolation, fm_jax.FutureMapError)

    def __init__(self, scenario: Scenario, dtype: str, debug: bool, device: str) -> None:
        if dtype == "int64" and not jax.config.read("jax_enable_x64"):
            raise RuntimeError("the int64 pass needs JAX_ENABLE_X64=1 (run it in its own process)")
        self.dtype = np.dtype(dtype)
        self.on_host = device == "cpu"
        self.device = jax_device(device)
        sp = scenario.spec
        self.spec = None if sp is None else (sp.topk, sp.hidden)
        cfg = None if sp is None else fm_jax.SpecConfig(sp.topk, sp.hidden, jnp.bfloat16)
        self.fm = fm_jax.FutureMap(
            scenario.pool_size,
            dtype=self.dtype,
            spec=cfg,
            debug=debug,
            batch_buckets=scenario.batch_buckets,
            token_buckets=sorted(set(scenario.token_buckets) | set(scenario.batch_buckets)),
            device=self.device,
        )

    # ---------------------------------------------------------------------------- helpers
    def error_kind(self, exc: BaseException) -> str:
        """'debug' for an invariant violation, 'checks' for rejected input."""
        return "debug" if isinstance(exc, fm_jax.InvariantViolation) else "checks"

    def snap(self, x: Any, n: int | None = None) -> Any:
        """A copy of `x` (first `n` rows) that outlives the next donated op."""
        if self.on_host:
            a = np.array(x)
            return a if n is None else a[:n]
        return exchange.to_torch(jnp.array(x if n is None else x[:n], copy=True))

    def host(self, x: Any) -> np.ndarray:
        """`x` on the host."""
        return np.asarray(jax.device_get(x))

    def _dev(self, x: np.ndarray) -> jax.Array:
        return jax.device_put(x, self.device)

    def buffers(self, extras: bool) -> dict[str, Any]:
        """Buffer snapshots, slots 1..R-1 (slot 0 is padding garbage)."""
        st = self.fm.state
        out = {"output_tokens": st.output_tokens, "new_seq_lens": st.new_seq_lens}
        if extras:
            out.update(topk_p=st.topk_p, topk_index=st.topk_index)
            if st.hidden_states is not None:
                # fm_jax keeps hidden states as raw bits (uint16 for bf16): view them as the
                # declared dtype, bit for bit, to compare with fm_torch's buffer.
                assert self.fm.spec is not None
                out["hidden_states"] = jax.lax.bitcast_convert_type(
                    st.hidden_states, self.fm.spec.hidden_dtype
                )
        return {k: self.snap(v)[1:] for k, v in out.items()}

    def check(self) -> None:
        """Raise the first pending debug violation (a host sync; the driver calls it once per
        step, and the violation names the op where it happened)."""
        self.fm.check()

    # -------------------------------------------------------------------------------- ops
    def resolve_seq_lens_cpu(self, slots: np.ndarray) -> np.ndarray:
        return self.fm.resolve_seq_lens_cpu(slots)

    def resolve(self, hb: HostBatch) -> ResolvedOut:
        batch = fm_jax.Batch(
            np.int32(hb.mode),
            hb.slots,
            hb.input_ids,
            hb.seq_lens,
            hb.slots if hb.spec_decode else None,
        )
        r = self.fm.resolve(batch)
        return ResolvedOut(r.input_ids, r.seq_lens, r.draft, batch)

    def forward(self, res: ResolvedOut, hb: HostBatch, offset: int) -> ForwardOut:
        slots, last = self._dev(hb.slots), self._dev(hb.last_index)
        return run_forward(model, fm_jax.DraftPayload, res, hb, slots, last, self.spec, offset)

    def publish(self, slots: np.ndarray, lens: Any) -> None:
        self.fm.publish(slots, lens)

    def stash(self, slots: np.ndarray, payload: Any) -> None:
        self.fm.stash(slots, payload)

    def draft_payload(self, bonus: np.ndarray, draft: Any) -> Any:
        """A host draft (toy_model.Draft of numpy rows) as the map's DraftPayload."""
        return fm_jax.DraftPayload(bonus, draft.topk_p, draft.topk_index, draft.hidden)

    def invalidate(self, hb: HostBatch, res: ResolvedOut | None) -> tuple[Any, Any]:
        if res is not None:
            batch = fm_jax.Batch(res.batch.forward_mode, hb.slots, res.input_ids, res.seq_lens)
        else:
            batch = fm_jax.Batch(np.int32(hb.mode), hb.slots, hb.input_ids, hb.seq_lens)
        out = self.fm.invalidate(batch, hb.slots)
        return out.input_ids, out.seq_lens
