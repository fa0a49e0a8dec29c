"""eSurge 0.3.0's methods wrapped at import time (no installed file is edited).

Each wrapper calls eSurge's own method and is a no-op for an engine without a relay
(`attach` sets one): engines built as shipped in the same process run unchanged.

- `eSurgeRunner._execute_model_impl`: slots of departed requests freed before the step;
  after it, the step's in-flight positions recorded (their host id set to the placeholder 0).
- `eSurgeRunner._modify_prev_results`: eSurge blocks here on the previous step's tokens
  before it builds the next step's ids; with a relay it does not block: the results are
  applied when the loop drains that step, after the next one is dispatched.
- `ExecutionManager.execute`: plans the window's token and row slots (one window per step).
- `ExecutionManager.execute_model`: the ids resolved on the device at the step's head.
- `ExecutionManager.sample_tokens`: the sampled tokens stashed at the sampler's tail.
- `ExecutionManager._ensure_sampler_penalty_state`: counts rebuilt from the host's tokens
  corrected for the token in flight.
- `eSurge.initiate`: the reordered loop (`loop.py`).
- `jax.device_put`, only while a relay engine's step is being dispatched (a thread-local
  flag): numpy leaves are copied first. eSurge stages every step's host inputs in numpy
  buffers it reuses (and slices of them); a transfer from host memory may still be pending
  when `device_put` returns (on the CPU backend it waits behind the computation in flight),
  so refilling those buffers for step N+1 while step N is in flight would change step N's
  inputs. As shipped eSurge drains step N before it prepares N+1, so it never meets this.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import threading
from typing import Any

from ._compat import import_easydel
from .relay import Relay, RelayError

PLACEHOLDER = 0  # the host id at a position whose token is in flight
_INSTALLED = False
# set by engine.build while eSurge's constructor runs: its initiate() attaches the relay first
ATTACH_ON_INITIATE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fm_attach", default=False
)


_DISPATCH = threading.local()


def dispatching() -> bool:
    """Whether this thread is inside a relay engine's step dispatch."""
    return bool(getattr(_DISPATCH, "active", False))


def _private_copies(tree: Any) -> Any:
    import jax
    import numpy as np

    return jax.tree_util.tree_map(
        lambda x: np.array(x, copy=True) if isinstance(x, np.ndarray) else x, tree
    )


def _install_device_put_copy() -> None:
    import jax

    original = jax.device_put
    if getattr(original, "__fm_original__", None) is not None:
        return

    def device_put(x: Any, *args: Any, **kwargs: Any) -> Any:
        if dispatching():
            x = _private_copies(x)
        return original(x, *args, **kwargs)

    functools.update_wrapper(device_put, original)
    device_put.__fm_original__ = original  # type: ignore[attr-defined]
    jax.device_put = device_put


def relay_of(obj: Any) -> Relay | None:
    return getattr(obj, "_fm_relay", None)


def _wrap(cls: type, name: str, make: Any) -> None:
    original = getattr(cls, name)
    wrapped = make(original)
    functools.update_wrapper(wrapped, original)
    wrapped.__fm_original__ = original
    setattr(cls, name, wrapped)


def install() -> None:
    """Wrap eSurge's methods once per process."""
    global _INSTALLED
    if _INSTALLED:
        return
    import_easydel()
    from easydel.inference.esurge.esurge_engine import eSurge
    from easydel.inference.esurge.runners.execution_manager import ExecutionManager
    from easydel.inference.esurge.runners.model_runner import eSurgeRunner

    from . import loop

    def execute_model_impl(original):
        def run(self, scheduler_output, *args, **kwargs):
            relay = relay_of(self)
            if relay is None:
                if not getattr(self, "_fm_copy_inputs", False):
                    return original(self, scheduler_output, *args, **kwargs)
                _DISPATCH.active = True  # a shipped engine with the copy only (harness)
                try:
                    return original(self, scheduler_output, *args, **kwargs)
                finally:
                    _DISPATCH.active = False
            relay.release_absent(
                set(self.requests) - set(getattr(scheduler_output, "finished_req_ids", ()) or ())
            )
            relay.windows_this_step = 0
            _DISPATCH.active = True
            try:
                out = original(self, scheduler_output, *args, **kwargs)
            finally:
                _DISPATCH.active = False
            pre = self._pre_async_results
            if pre is not None and scheduler_output.total_num_scheduled_tokens:
                buf = self.sequence_buffer
                for _, _, req_state, seq_len in pre.request_seq_lens:
                    rid = req_state.req_id
                    row = buf.req_id_to_index.get(rid)
                    if row is None or int(buf.num_tokens_no_spec[row]) != seq_len + 1:
                        raise RelayError(
                            f"request {rid!r}: in-flight token at {seq_len}, host length "
                            f"{None if row is None else int(buf.num_tokens_no_spec[row])}"
                        )
                    buf.token_ids[row, seq_len] = PLACEHOLDER
                    relay.pending[rid] = seq_len
            return out

        return run

    def modify_prev_results(original):
        def run(self):
            relay = relay_of(self)
            if relay is None:
                return original(self)
            if self._pre_async_results is not None:
                relay.deferred.append(self._pre_async_results)
            return None

        return run

    def execute(original):
        def run(self, *args, **kwargs):
            relay = relay_of(self)
            if relay is None:
                return original(self, *args, **kwargs)
            if args:
                raise RelayError(
                    "ExecutionManager.execute called positionally; eSurge 0.3.0 passes keywords"
                )
            relay.windows_this_step += 1
            if relay.windows_this_step > 1:
                raise RelayError(
                    "a step spanning several windows (more scheduled rows than "
                    "num_reqs_max_model_len) is not supported on the relay"
                )
            if (
                kwargs.get("prefill_embeds_cpu") is not None
                or kwargs.get("pixel_values") is not None
            ):
                raise RelayError("vision-language inputs are not supported on the relay")
            runner = self._fm_runner
            rows = kwargs["window_row_indices_cpu"]
            scheduled = kwargs["scheduled_full_cpu"]
            active = kwargs["active_mask_full_cpu"]
            req_ids = runner.sequence_buffer.req_ids
            ids = [
                req_ids[int(rows[i])] if bool(active[i]) else None for i in range(len(scheduled))
            ]
            relay.plan(
                ids,
                rows,
                scheduled,
                kwargs["num_computed_tokens_cpu"],
                int(kwargs["num_tokens"]),
                int(kwargs["padded_num_reqs"]),
            )
            try:
                return original(self, **kwargs)
            finally:
                relay.clear()

        return run

    def execute_model(original):
        def run(self, num_tokens, padded_num_reqs, inputs):
            relay = relay_of(self)
            if relay is None:
                return original(self, num_tokens, padded_num_reqs, inputs)
            md = inputs.batch_metadata
            md = dataclasses.replace(md, input_ids_buf=relay.resolve_ids(md.input_ids_buf))
            inputs = dataclasses.replace(inputs, batch_metadata=md)
            return original(self, num_tokens, padded_num_reqs, inputs)

        return run

    def sample_tokens(original):
        def run(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            relay = relay_of(self)
            if relay is not None:
                _, tokens, valid, _ = out
                relay.stash_tokens(tokens, valid)
            return out

        return run

    def ensure_penalties(original):
        def run(self):
            relay = relay_of(self)
            rebuilding = not (
                self._sampler_penalty_state_ready and not self._sampler_penalty_state_dirty
            )
            original(self)
            if relay is not None and rebuilding:
                self._sampler_token_counts = relay.correct_penalty_counts(
                    self._sampler_token_counts, self._fm_runner, PLACEHOLDER
                )

        return run

    def initiate(original):
        def run(self):
            if relay_of(self) is None and ATTACH_ON_INITIATE.get():
                from .engine import attach

                attach(self)
            if relay_of(self) is None:
                return original(self)
            return loop.initiate(self)

        return run

    _wrap(eSurgeRunner, "_execute_model_impl", execute_model_impl)
    _wrap(eSurgeRunner, "_modify_prev_results", modify_prev_results)
    _wrap(ExecutionManager, "execute", execute)
    _wrap(ExecutionManager, "execute_model", execute_model)
    _wrap(ExecutionManager, "sample_tokens", sample_tokens)
    _wrap(ExecutionManager, "_ensure_sampler_penalty_state", ensure_penalties)
    _wrap(eSurge, "initiate", initiate)
    _install_device_put_copy()
    _INSTALLED = True
