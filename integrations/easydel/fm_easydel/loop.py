"""eSurge's scheduler loop, reordered: step N+1 is scheduled on placeholders and dispatched
before step N's tokens are brought to the host.

One step is in flight at a time. Each turn: schedule (the async scheduler leaves a
placeholder for every token still in flight), dispatch (the runner's ids for those
placeholders are gathered on the device by the relay), then drain the step before: its
tokens to the host, written into the runner's rows, and the scheduler updated with them.
A request that stopped at step N was already scheduled in step N+1: the scheduler drops
N+1's token for it (the request is gone by then), and its pages, freed when step N is
drained, are only handed out to a step dispatched after N+1, which the device runs after
N+1's writes.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

from .patches import relay_of
from .relay import RelayError


def _apply(engine: Any, handle: Any, output: Any) -> None:
    """Write a drained step's tokens into the runner's rows (what eSurge's
    `_modify_prev_results` does at the next step's head, here a step later)."""
    runner = engine.runner
    relay = relay_of(runner)
    pre = None
    for i, cand in enumerate(relay.deferred):
        if cand.windows is handle._windows:
            pre = relay.deferred.pop(i)
            break
    last = runner._pre_async_results
    if pre is None and last is not None and last.windows is handle._windows:
        pre = last
        runner._pre_async_results = None
    if pre is None:
        return  # a step with no sampled rows
    buf = runner.sequence_buffer
    for out_idx, _, req_state, seq_len in pre.request_seq_lens:
        ids = output.sampled_token_ids[out_idx]
        if not ids:
            continue
        rid = req_state.req_id
        if runner.requests.get(rid) is not req_state:
            continue  # finished and removed since
        row = buf.req_id_to_index.get(rid)
        if row is None:
            continue
        tok = int(ids[-1])
        buf.token_ids[row, seq_len] = tok
        req_state.output_token_ids[seq_len - req_state.num_prompt_tokens] = tok
        if relay.pending.get(rid) == seq_len:
            del relay.pending[rid]


def _drain(engine: Any, step: int, handle: Any, sched: Any) -> None:
    relay = relay_of(engine.runner)
    output = engine.runner.wait_for_execution(handle)
    relay.timeline.drained[step] = time.monotonic()
    bad = [
        (rid, ids)
        for rid, ids in zip(output.req_ids, output.sampled_token_ids, strict=False)
        if any(int(t) < 0 for t in ids)
    ]
    if bad:
        # the sampler marked rows invalid that the host counted as sampled: the step ran on
        # inputs other than the ones the host built. Fail the engine rather than hand -1 on
        # (eSurge's detokenizer worker dies on it and generate() then waits forever).
        raise RelayError(
            f"step {step}: the device sampled no token for rows the host expected: {bad}"
        )
    _apply(engine, handle, output)
    with engine._scheduler_lock:
        outs = engine.scheduler.update_from_output(sched, output)
    if outs:
        engine._process_engine_outputs(outs)


def run_loop(engine: Any) -> None:
    relay = relay_of(engine.runner)
    pending: tuple[int, Any, Any] | None = None
    try:
        while engine._scheduler_running:
            with engine._scheduler_lock:
                sched = engine.scheduler.schedule()
            engine._update_scheduler_heartbeat()
            if sched.total_num_scheduled_tokens == 0:
                out = engine.runner.execute_model(sched)
                with engine._scheduler_lock:
                    outs = engine.scheduler.update_from_output(sched, out)
                if outs:
                    engine._process_engine_outputs(outs)
                if pending is not None:
                    _drain(engine, *pending)
                    pending = None
                else:
                    time.sleep(0.0005)
                continue
            step = relay.step
            t0 = time.monotonic()
            handle = engine.runner.execute_model_async(sched)
            t1 = time.monotonic()
            relay.timeline.dispatched[step] = t1
            relay.timeline.host_s[step] = t1 - t0
            relay.step += 1
            if pending is not None:
                _drain(engine, *pending)
            pending = (step, handle, sched)
            engine._update_scheduler_heartbeat()
        if pending is not None:
            _drain(engine, *pending)
    except (
        Exception
    ) as exc:  # the runner's rows and the relay are not consistent after a failed step
        traceback.print_exc()
        engine._abort_scheduler_due_to_error(exc)


def initiate(engine: Any) -> None:
    """eSurge.initiate for an engine with a relay: the same start-up, the reordered loop."""
    with engine._scheduler_lock:
        if engine._scheduler_running:
            return
        if getattr(engine, "_distributed_controller", None) is not None:
            raise RelayError("distributed eSurge (remote workers) is not supported on the relay")
        if engine.runner.executor_manager.kv_pages is None:
            engine.runner.initialize_kv_cache()
            engine._kv_cache_valid = True
        engine._scheduler_exception = None
        engine._scheduler_exception_tb = None
        engine._scheduler_heartbeat = None
        engine._scheduler_running = True
        engine._scheduler_thread = threading.Thread(target=run_loop, args=(engine,), daemon=True)
        engine._scheduler_thread.start()
        engine._touch_activity()
        engine._start_idle_monitor()
        engine._paused = False
