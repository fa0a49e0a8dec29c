"""Executables: what the class jits (`entry_points`, one function per key family), a step's
tail (`tail`, the class's finish and every engine step's), and the XLA options."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from fm_jax.host.buckets import decode_ids
from fm_jax.host.decisions import FIXED_MODES, Key, PackSpec
from fm_jax.ops import checks
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.ops import FutureMapOps, future_map
from fm_jax.ops.protocol import Protocol
from fm_jax.ops.rows import gather
from fm_jax.ops.sharding import check_split
from fm_jax.ops.types import Batch, FutureMapState

CPU_PARALLEL_TASK_PASS = "cpu-parallel-task-assigner"
"""The XLA:CPU pass that splits instructions over threads (by bytes, not by work)."""

_FLAG = "xla_disable_hlo_passes"


def compiler_options(platform: str | None = None) -> dict[str, str]:
    """XLA options for jitting a step that runs FutureMap ops on `platform` (default:
    JAX's default backend); engines that inline the pure ops pass these to their own jit.

    On CPU the parallel task assigner is disabled (beside the passes XLA_FLAGS disables):
    it splits an instruction over threads once the bytes it may touch pass 256 KB, for a
    gather or scatter the whole pool, so from R ~ 64K each O(B) op would be a hand-off to a
    pool thread and back (~20-40 us). Elsewhere none.
    """
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return {}
    by_env = re.findall(rf"--{_FLAG}=(\S+)", os.environ.get("XLA_FLAGS", ""))
    passes = [p for v in by_env for p in v.split(",") if p]
    passes = list(dict.fromkeys([*passes, CPU_PARALLEL_TASK_PASS]))
    return {_FLAG: ",".join(passes)}


def use_persistent_cache(path: str | os.PathLike[str], *, min_compile_seconds: float = 0.0) -> None:
    """Turn on JAX's persistent compilation cache in directory `path`, process-wide; call
    it before the first compile. JAX's default writes only compiles of a second or more,
    which no FutureMap executable takes: this writes those of at least
    `min_compile_seconds` (0: all). `path` is trusted: whoever can write it can change what
    this process runs.
    """
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.fspath(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    # JAX decides once per process whether the cache is used: decide again with it on.
    compilation_cache.reset_cache()


def tail(
    ops: FutureMapOps,
    protocol: Protocol,
    token_buckets: tuple[int, ...],
    what: str = "finish",
    owned: frozenset[str] = frozenset(),
) -> Any:
    """A step's tail over global arrays: (state, indices, new_seq_lens, payload,
    confidence=None) -> (state, sentinels). Publish, stash and the sentinels in one
    shard_map: checkify cannot merge the errors of consecutive shard_maps. `owned`: the
    relay buffers the forward wrote itself, each given whole and taken with no scatter.
    """
    local, layout = ops.local, ops.layout
    assert local is not None and layout is not None  # the class's ops are always lifted
    own_lens, own_tokens = "new_seq_lens" in owned, "output_tokens" in owned
    # Owned output_tokens, spec: the other fields stashed as by a map without bonus tokens.
    rest = None
    rest_fields: tuple[rf.RelayField, ...] = ()
    if own_tokens and local.spec is not None:
        spec = local.spec._replace(bonus_tokens=False)
        rest_fields = spec.fields()
        if rest_fields:
            rest = future_map(
                local.pool_size,
                dtype=local.dtype,
                spec=spec,
                debug=local.debug,
                protocol=local.protocol,
            )

    def check_owned(name: str, invariant: str, buf: jax.Array, indices: jax.Array) -> None:
        chk = checks.OpChecks()
        checks.relayed_values(name, invariant, gather(buf, indices), indices, local.dtype, chk)
        chk.run()

    def local_tail(
        state: FutureMapState,
        indices: jax.Array,
        new_seq_lens: jax.Array,
        payload: Any,
        confidence: Any = None,
    ) -> tuple[FutureMapState, Any]:
        if own_lens:
            state = state._replace(new_seq_lens=new_seq_lens)
            if confidence is not None:  # the owned rows scattered back beside confidence
                state = local.publish(state, indices, gather(new_seq_lens, indices), confidence)
            elif local.debug:
                check_owned("new_seq_lens", checks.PUBLISHED_LENGTHS, new_seq_lens, indices)
        else:
            state = local.publish(state, indices, new_seq_lens, confidence)
        if not own_tokens:
            state = local.stash(state, indices, payload)
        else:
            spec = local.spec is not None
            tokens = payload.bonus_tokens if spec else payload
            name = "draft.bonus_tokens" if spec else "tokens"
            if local.debug:
                check_owned(name, checks.STASHED_TOKENS, tokens, indices)
            state = state._replace(output_tokens=tokens)
            others = payload._replace(bonus_tokens=None) if rest is not None else None
            if rest is not None and any(rf.get(others, f.name) is not None for f in rest_fields):
                state = rest.stash(state, indices, others)  # not for a bonus-only draft
        return state, _sentinels(protocol, indices, local.dtype, token_buckets)

    mapped = ops.map_ranks(local_tail)

    def checked_tail(
        state: FutureMapState, indices: Any, new_seq_lens: Any, payload: Any, confidence: Any = None
    ) -> tuple[FutureMapState, Any]:
        rows = [("indices", indices), ("confidence", confidence)]
        if own_lens:
            _check_owned(what, "new_seq_lens", new_seq_lens, state.new_seq_lens)
        else:
            rows.append(("new_seq_lens", new_seq_lens))
        relayed = rf.payload_rows(local.spec, payload)
        if own_tokens:  # the tokens are the payload's first entry
            _check_owned(what, "output_tokens", relayed.pop(0)[1], state.output_tokens)
        check_split(layout, what, [*rows, *relayed])
        conf = () if confidence is None else (confidence,)
        return mapped(state, indices, new_seq_lens, payload, *conf)  # type: ignore[no-any-return]

    return checked_tail


def _check_owned(what: str, name: str, got: Any, buf: jax.Array) -> None:
    """FutureMapError unless `got` has the owned buffer's shape and dtype."""
    if isinstance(got, jax.Array) and (got.shape, got.dtype) == (buf.shape, buf.dtype):
        return
    head = f"{what}: " if what else ""
    shown = f"{got.dtype}{list(got.shape)}" if isinstance(got, jax.Array) else repr(got)
    raise FutureMapError(
        f"{head}the forward owns the {name} buffer (StepInput per='slot'): it returns that "
        f"buffer, {buf.dtype}{list(buf.shape)}, written; got {shown}"
    )


def _sentinels(
    protocol: Protocol, indices: jax.Array, dtype: Any, token_buckets: tuple[int, ...]
) -> Any:
    """One rank's sentinels, their ids padded to the token bucket of the rows."""
    return protocol.sentinels(indices.astype(dtype), decode_ids(indices.shape[0], token_buckets))


def entry_points(
    ops: FutureMapOps,
    protocol: Protocol,
    token_buckets: tuple[int, ...],
    debug: Any,
    options: dict[str, str],
) -> Callable[[Key, PackSpec | None, int], Any]:
    """The builder of the class's jitted entry points over global arrays, the state donated
    where the op writes it; with a debug channel `debug`, each returns (packed error,
    outputs). A publish or finish with confidence rows returns also a copy of the
    confidence buffer it wrote, for the host ring (the state is donated to the next op)."""
    local, layout = ops.local, ops.layout
    assert local is not None and layout is not None  # the class's ops are always lifted
    sh = layout.sharding
    # The traced mode (a scalar, or one per rank) is replicated: each rank slices its own.
    batch_sh: Any = Batch(layout.replicated, sh, sh, sh, sh, sh)  # type: ignore[arg-type]

    def local_sentinels(indices: jax.Array) -> Any:
        if debug is not None:  # each rank's slots checked as every op's are
            chk = checks.OpChecks()
            checks.valid_slots("indices", indices, local.pool_size, local.dtype, chk)
            chk.run()
        return _sentinels(protocol, indices, local.dtype, token_buckets)

    def body(key: Key) -> Callable[..., Any]:
        if key.op == "resolve":
            fixed = FIXED_MODES.get(key.mode)

            def resolve(state: FutureMapState, batch: Batch) -> Any:
                if fixed is not None:
                    batch = batch._replace(forward_mode=fixed)
                out = ops.resolve(state, batch)
                # Without debug resolve only reads: a state returned undonated would be copied.
                return out if debug is not None else out[1]

            return resolve
        if key.op == "sentinels":  # device slots' (host slots' are made on the host)
            mapped = ops.map_ranks(local_sentinels)
            return lambda state, indices: mapped(indices)  # the state only read: not donated
        # publish, stash and seq_lens_at: the lifted ops themselves
        fn = tail(ops, protocol, token_buckets) if key.op == "finish" else getattr(ops, key.op)
        if not key.confidence:
            return fn

        def with_copy(*args: Any) -> Any:
            out = fn(*args)
            state = out[0] if key.op == "finish" else out  # finish: (state, sentinels)
            return out, state.confidence  # XLA gives each output a buffer of its own

        return with_copy

    def build(key: Key, pack: PackSpec | None, nargs: int = 0) -> Any:
        assert pack is None, "a class call is fed placed arrays"
        fn = body(key) if debug is None else debug.checked(body(key))
        # The ops that write the state take it donated (resolve in debug: the poison).
        writes = key.op in ("publish", "stash", "finish") or (debug and key.op == "resolve")
        donate = (0,) if writes else ()
        shardings = (sh, batch_sh) if key.op == "resolve" else sh
        return jax.jit(fn, in_shardings=shardings, donate_argnums=donate, compiler_options=options)

    return build
