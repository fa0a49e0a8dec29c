"""The class's jitted executables over its layout's ops, state donated: one per key family.

`entry_points(...)` gives the builder of the jitted function that serves every key of one
family (an op, its mode, checked or not), fed placed arrays; jit's own cache then holds one
executable per shape. Every argument but a
traced mode is placed with the layout's sharding by the jit itself: a host (numpy)
argument is transferred in JAX's C++ dispatch path, with no Python `device_put`, and a jax
array already there is taken as it is. One call is one dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from fm_jax.host.buckets import decode_ids
from fm_jax.host.decisions import FIXED_MODES, Key, writes_state
from fm_jax.host.pack import PackSpec
from fm_jax.map.debug_channel import DebugChannel
from fm_jax.ops import checks
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.ops import future_map
from fm_jax.ops.protocol import Protocol
from fm_jax.ops.relay_fields import payload_rows
from fm_jax.ops.rows import gather
from fm_jax.ops.sharding import check_split
from fm_jax.ops.types import Batch, FutureMapOps, FutureMapState


def tail(
    ops: FutureMapOps,
    protocol: Protocol,
    token_buckets: tuple[int, ...],
    what: str = "finish",
    owned: frozenset[str] = frozenset(),
) -> Any:
    """The tail of a step over the layout's global arrays: (state, indices, new_seq_lens,
    payload, confidence=None) -> (state, what the protocol leaves: the sentinels
    `-indices`, their ids padded per rank to the token bucket of the rows
    (`buckets.decode_ids`), or None).

    Publish, stash and the sentinels in one shard_map: checkify cannot merge the errors of
    consecutive shard_maps (jax 0.10: "select cases must have the same shapes"). Its
    arguments are checked when traced as publish's and stash's are (`check_split`; refusals
    begin with `what`).

    `owned` names the relay buffers (`new_seq_lens`, `output_tokens`) that the caller's
    forward wrote itself: for each, the value given (`new_seq_lens`, the tokens or the
    draft's `bonus_tokens`) is the whole buffer, taken as the state's with no scatter (in
    debug mode its rows at `indices` are checked as the relayed rows would be).
    """
    local = ops.local
    assert local is not None  # the class's ops are always lifted (a layout)
    own_lens, own_tokens = "new_seq_lens" in owned, "output_tokens" in owned
    # A spec map whose forward owns output_tokens stashes every other field as a map
    # without bonus tokens would (None: the bonus tokens were its only field).
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
            if confidence is not None:
                # publish scatters the owned rows back unchanged beside the confidence rows
                # (and checks them in debug): one B-row scatter, only with confidence
                state = state._replace(new_seq_lens=new_seq_lens)
                state = local.publish(state, indices, gather(new_seq_lens, indices), confidence)
            else:
                if local.debug:
                    check_owned("new_seq_lens", checks.PUBLISHED_LENGTHS, new_seq_lens, indices)
                state = state._replace(new_seq_lens=new_seq_lens)
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
                # a bonus-only draft has nothing else to stash
                state = rest.stash(state, indices, others)
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
        relayed = payload_rows(local.spec, payload)
        if own_tokens:  # the tokens are the payload's first entry
            _check_owned(what, "output_tokens", relayed.pop(0)[1], state.output_tokens)
        check_split(ops.layout, what, [*rows, *relayed])
        if confidence is None:
            return mapped(state, indices, new_seq_lens, payload)  # type: ignore[no-any-return]
        return mapped(state, indices, new_seq_lens, payload, confidence)  # type: ignore[no-any-return]

    return checked_tail


def _check_owned(what: str, name: str, got: Any, buf: jax.Array) -> None:
    """FutureMapError unless `got`, what a forward owning the `name` buffer returned for
    it, is an array of that buffer's shape and dtype."""
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
    """One rank's sentinels as `protocol` leaves them for the next batch (`finish`,
    `invalidate`, an engine step), their ids at the token bucket of the rows
    (`buckets.decode_ids`), so that the DECODE they make is placed again."""
    return protocol.sentinels(indices.astype(dtype), decode_ids(indices.shape[0], token_buckets))


def _op_body(
    ops: FutureMapOps,
    key: Key,
    protocol: Protocol,
    token_buckets: tuple[int, ...],
    debug: bool,
) -> Any:
    """The function a key's family jits, over global arrays."""
    local = ops.local
    assert local is not None  # the class's ops are always lifted (a layout)
    if key.op == "resolve":
        fixed = FIXED_MODES.get(key.mode)

        def resolve(state: FutureMapState, batch: Batch) -> Any:
            if fixed is not None:
                batch = batch._replace(forward_mode=fixed)
            out = ops.resolve(state, batch)
            # Without debug, resolve only reads: it returns only the Resolved outputs
            # (returning a state that is not donated would make XLA copy it).
            return out if debug else out[1]

        return resolve
    if key.op == "sentinels":

        def local_sentinels(indices: jax.Array) -> Any:
            # Debug: each rank's slots checked like every op's (range, no live slot twice).
            if debug:
                chk = checks.OpChecks()
                checks.valid_slots("indices", indices, local.pool_size, local.dtype, chk)
                chk.run()
            return _sentinels(protocol, indices, local.dtype, token_buckets)

        return ops.map_ranks(local_sentinels)
    if key.op == "finish":
        finish = tail(ops, protocol, token_buckets)
        return with_confidence_copy(finish) if key.confidence else finish
    if key.op == "publish" and key.confidence:
        return with_confidence_copy(ops.publish)
    return {"publish": ops.publish, "stash": ops.stash, "seq_lens_at": ops.seq_lens_at}[key.op]


def with_confidence_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a publish, or a tail whose first output is the state) returning also a copy
    of the confidence buffer it wrote: the state is donated to the next op, the copy is
    what the host ring copies to the host."""

    def both(*args: Any) -> Any:
        out = fn(*args)
        state = out if isinstance(out, FutureMapState) else out[0]
        return out, state.confidence  # XLA gives each output a buffer of its own

    return both


def entry_points(
    ops: FutureMapOps,
    unchecked: FutureMapOps,
    protocol: Protocol,
    token_buckets: tuple[int, ...],
    debug: DebugChannel | None,
    options: dict[str, str],
) -> Callable[[Key, PackSpec | None, int], Any]:
    """The builder of the class's jitted entry points (state, argument 0, donated where
    the op writes it: `decisions.writes_state`), compiled with `options` (the layout
    platform's `compiler_options`: on CPU on the calling thread, so the cost stays
    O(batch) at any pool size).

    A key that is not `checked` (a debug map's tail op on slots already checked) runs the
    ops built without debug and returns no error; every other executable of a debug map
    returns (packed error, outputs) through `debug`.
    """
    layout = ops.layout
    sh = layout.sharding
    # The traced mode (a scalar, or one per rank) is replicated: each rank slices its own.
    batch_sh: Any = Batch(layout.replicated, sh, sh, sh, sh, sh)  # type: ignore[arg-type]

    def build(key: Key, pack: PackSpec | None, nargs: int = 0) -> Any:
        checked = debug is not None and key.checked
        fn = _op_body(ops if checked else unchecked, key, protocol, token_buckets, checked)
        if checked:
            assert debug is not None
            fn = debug.checked(fn)
        assert pack is None, "a class call is fed placed arrays"
        donate = (0,) if writes_state(key.op, checked) else ()
        shardings = (sh, batch_sh) if key.op == "resolve" else sh
        return jax.jit(fn, in_shardings=shardings, donate_argnums=donate, compiler_options=options)

    return build
