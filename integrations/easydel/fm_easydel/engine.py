"""Attach fm_jax's relay to an eSurge engine."""

from __future__ import annotations

from typing import Any

from .patches import ATTACH_ON_INITIATE, install, relay_of
from .relay import Relay, RelayError


def build(**esurge_kwargs: Any) -> Any:
    """`easydel.eSurge(**esurge_kwargs)` on fm_jax's relay. eSurge starts its scheduler loop
    inside its constructor; the relay is attached there, before the loop's first step, and
    the loop started is the reordered one."""
    install()
    from easydel.inference.esurge.esurge_engine import eSurge

    for key, want in (("overlap_execution", True), ("async_scheduling", True)):
        if esurge_kwargs.setdefault(key, want) is not want:
            raise RelayError(f"the relay needs {key}={want} (got {esurge_kwargs[key]!r})")
    token = ATTACH_ON_INITIATE.set(True)
    try:
        engine = eSurge(**esurge_kwargs)
    finally:
        ATTACH_ON_INITIATE.reset(token)
    if relay_of(engine.runner) is None:
        attach(engine)
        engine.initiate()
    return engine


def attach(engine: Any) -> Relay:
    """Put `engine` (an `easydel.eSurge` whose scheduler loop is not running) on fm_jax's
    relay; its next `initiate()` starts the reordered loop. Refuses, naming the setting,
    what the relay does not support."""
    install()
    if engine._scheduler_running:
        raise RelayError(
            "attach the relay while eSurge's loop is stopped (eSurge.terminate() first), "
            "or build the engine with fm_easydel.build"
        )
    runner = engine.runner
    if relay_of(runner) is not None:
        raise RelayError("this eSurge already runs on a relay")
    dp = int(getattr(runner.metadata, "data_parallel_size", 1) or 1)
    if dp > 1:
        raise RelayError(
            f"data-parallel rows are not supported on the relay (data_parallel_size={dp})"
        )
    if getattr(engine, "_distributed_controller", None) is not None:
        raise RelayError("distributed eSurge (distributed_mode=True) is not supported on the relay")
    if not runner.async_scheduling:
        raise RelayError(
            "the relay needs async_scheduling=True (placeholders for tokens in flight)"
        )
    spec = int(getattr(engine.scheduler, "num_spec_tokens", 0) or 0)
    if spec:
        raise RelayError(
            f"speculative decoding is not supported on the relay (num_spec_tokens={spec})"
        )
    max_seqs = int(engine.max_num_seqs)
    window = int(runner.num_reqs_max_model_len)
    if window < max_seqs:
        raise RelayError(
            "steps spanning several windows are not supported on the relay: "
            f"max_num_seqs={max_seqs} > rows per window {window} (num_reqs_max_model_len)"
        )
    relay = Relay(max_seqs)
    runner._fm_relay = relay
    runner.executor_manager._fm_relay = relay
    runner.executor_manager._fm_runner = runner
    engine._fm_relay = relay
    return relay
