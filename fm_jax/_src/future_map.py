"""`FutureMap`: the pure ops behind jitted, donated entry points, on one device or a mesh.

One device is the one-rank layout: a one-device mesh with one DP rank. A mesh gives each
DP rank its own pool of `pool_size` slots, replicated over the other axes (see
`fm_jax.sharded_future_map`). Methods, argument rules and return types are the same in
both; `host_inputs` says what a caller may pass.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fm_jax._src import buckets as bk
from fm_jax._src import refusals
from fm_jax._src import relay_fields as rf
from fm_jax._src.compile_options import compiler_options
from fm_jax._src.debug_channel import DebugChannel
from fm_jax._src.engine_step import EngineStep, Forward, StepInput
from fm_jax._src.entry_points import jit_entry_points, packed_entry_point, takes_state
from fm_jax._src.errors import FutureMapError
from fm_jax._src.host_inputs import HostInputs, Rows, on_device
from fm_jax._src.host_lengths import HostLengths
from fm_jax._src.ops import future_map
from fm_jax._src.packing import PackSpec, pack_host
from fm_jax._src.sharding import MeshLayout, lift, mesh_layout, per_rank, single_device_layout
from fm_jax._src.types import (
    Batch,
    DraftPayload,
    ForwardMode,
    FutureMapState,
    Resolved,
    RowsInput,
    SpecConfig,
    draft_payload,
    host_mode,
    relay_protocol,
)
from fm_jax._src.warm_up import (
    Guarded,
    Key,
    Planned,
    WarmUpReport,
    compile_plan,
    counting_compiles,
    describe,
    plan,
    report,
)

_log = logging.getLogger("fm_jax")
_M = TypeVar("_M", bound=Callable[..., Any])
_FIXED = ("resolve_fixed_extend", "resolve_fixed_decode")
"""The resolve executables with the mode fixed when traced: not DECODE, DECODE."""
Payload = RowsInput | DraftPayload | Mapping[int, DraftPayload]
"""What `stash` writes: tokens [B] (non-spec) or a DraftPayload of [B, ...] rows (spec), or
per-rank mappings of either."""


_host_mode = host_mode  # the one rule for a mode given on the host (types.py)


class _Placed(NamedTuple):
    """A batch placed for a resolve: the executable's key, the placed Batch (host arrays
    padded to buckets, or the caller's jax arrays), its slots and its ids (None: a gather
    DECODE, whose ids are gathered: T = B)."""

    key: Key
    batch: Batch
    idx: Rows
    ids: Rows | None


def _serialized(method: _M) -> _M:
    """`method` run under the map's lock: calls from several threads take turns (each op
    donates the state the next one reads). Uncontended, the lock and the extra frame cost
    about 1 us a call or less (`python -m fm_bench.lock_cost`)."""

    @functools.wraps(method)
    def locked(self: FutureMap, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


def _all_zero(slots: Any) -> bool:
    """Host token slots that gather nothing (a jax array is not read: False)."""
    if isinstance(slots, jax.Array):
        return False
    try:
        return not np.any(np.asarray(slots))
    except (TypeError, ValueError):
        return False  # not an array: placing it names the field


def _rows_per_rank(x: Any, dp: int) -> int | None:
    """Rows per DP rank of a host input before it is placed (a mapping: its largest
    rank's); None when `x` has no length (placing it then names what is wrong)."""
    try:
        if isinstance(x, Mapping):
            return max((len(v) for v in x.values()), default=0)
        return len(x) // dp
    except TypeError:
        return None


class FutureMap:
    """A FutureMap that holds its state and updates it in place through donated jitted ops.

    Inputs (see `fm_jax._src.host_inputs`): host arrays are checked by value, padded to a
    bucket per DP rank and handed to the op's executable (one dispatch per call, no
    Python-side transfer); jax arrays are taken as they are (each rank's rows already a
    bucket size); a mapping DP rank -> host rows feeds a mesh's ranks one by one (ranks
    left out are idle). Outputs are global jax arrays, padded per rank to the bucket;
    padding rows carry slot 0 and token 0 (`fm_jax.per_rank` splits them by rank).

    Debug mode adds no host sync per step: each op's checkify error stays on device and is
    reported by `check()`, or by `resolve_seq_lens_cpu` (which syncs anyway).

    Threads: a map's ops (and its engine steps) take turns on one lock per map, so several
    threads may call one map; each op sees the state the previous one left. Uncontended
    the lock costs a caller about 1 us a call or less (`python -m fm_bench.lock_cost`).

    Args:
      pool_size: R, slots per DP rank (max running requests + 1); slot 0 is padding.
      mesh: a `jax.sharding.Mesh` for one pool per DP rank; None: one device.
      dp_axis: the mesh's data-parallel axis, or None (one pool replicated everywhere).
      tp_axis: the mesh's tensor-parallel axis (buffers replicated on it), or None.
      dtype: int32 (default) or int64 (needs JAX's x64 mode).
      spec: static shapes of the spec extras, or None.
      debug: consume tracking and invariant checks.
      batch_buckets: allowed per-rank batch sizes (rows); default powers of two up to 1024.
      token_buckets: allowed per-rank flat token counts; default powers of two up to 8192.
      device: without a mesh, where the buffers live; default JAX's default device.
      protocol: 'sentinel' (default: `invalidate` leaves -slot placeholders that resolve
        fills) or 'gather' (resolve gathers decode ids, MIXED running rows' ids and spec
        lengths at forward entry; no invalidate). docs/CONTRACT.md, 'Two protocols'.
      pack_inputs: a call whose arrays are all on the host sends them to the device as
        one packed buffer (`packing`) instead of one transfer per array. Default: on
        where a transfer costs more than packing (GPU, TPU: about 55 us of host time per
        numpy argument), off on CPU (about 2.5 us, less than the packing itself). One
        process only: across processes each array is sharded as given.
      needs_cpu_seq_lens: the engine reads lengths on the host (`resolve_seq_lens_cpu`):
        each publish starts copying its lengths to the host, so a read of the slots last
        published waits for the publishing step only (`host_lengths`). False (SGLang's
        `needs_cpu_seq_lens` off): no copy at all; `resolve_seq_lens_cpu` then gathers
        from the buffer, a sync behind everything queued.
    """

    def __init__(
        self,
        pool_size: int,
        *,
        mesh: Mesh | None = None,
        dp_axis: str | None = "dp",
        tp_axis: str | None = None,
        dtype: Any = jnp.int32,
        spec: SpecConfig | None = None,
        debug: bool = False,
        batch_buckets: Sequence[int] | None = None,
        token_buckets: Sequence[int] | None = None,
        device: jax.Device | None = None,
        protocol: str = "sentinel",
        pack_inputs: bool | None = None,
        needs_cpu_seq_lens: bool = True,
    ) -> None:
        # One op at a time (`_serialized`); reentrant: an op may call another (check).
        self._lock = threading.RLock()
        if mesh is not None and device is not None:
            raise FutureMapError("pass a mesh or a device, not both")
        if device is not None and not isinstance(device, jax.Device):
            raise FutureMapError(f"device must be a jax.Device, got {device!r}")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise FutureMapError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
        self.layout: MeshLayout = (
            single_device_layout(device or jax.devices()[0])
            if mesh is None
            else mesh_layout(mesh, dp_axis, tp_axis)
        )
        local = future_map(pool_size, dtype=dtype, spec=spec, debug=debug, protocol=protocol)
        platform = self.layout.mesh.devices.flat[0].platform
        one_kernel = local.spec is not None and local.spec.kernel == "pallas"
        if one_kernel and platform not in ("cpu", "gpu"):
            raise FutureMapError(
                f"spec.kernel='pallas' is a Triton kernel (GPU; on CPU interpreted): no "
                f"lowering for {platform}; use kernel='xla'"
            )
        self.ops = lift(local, self.layout)
        self.pool_size = pool_size
        self.dtype: np.dtype = local.dtype
        self.spec: SpecConfig | None = local.spec
        self._fields = self.spec.fields() if self.spec is not None else ()
        self.debug = debug
        self.protocol: str = local.protocol
        self._relay = relay_protocol(self.protocol)
        self.batch_buckets = bk.normalize_buckets(
            bk.power_of_two_buckets(1024) if batch_buckets is None else batch_buckets
        )
        self.token_buckets = bk.normalize_buckets(
            bk.power_of_two_buckets(8192) if token_buckets is None else token_buckets
        )
        self.local_ranks: tuple[int, ...] = self.layout.local_ranks()
        self.step = 0
        self._inputs = HostInputs(
            self.layout,
            pool_size,
            self.dtype,
            self.batch_buckets,
            self.token_buckets,
            sentinels=self._relay.invalidates,
        )
        self._debug = DebugChannel(self.layout) if debug else None
        self._ep = jit_entry_points(self.ops, self._debug)
        # Debug: the tail ops' only checks are slot checks. Slots already checked (on the
        # host, or on the device by the last resolve) take these executables without them:
        # a checked executable costs ~35 us more per call on XLA:CPU (it no longer runs
        # inline on the calling thread).
        self._unchecked = (
            jit_entry_points(
                lift(future_map(pool_size, dtype=dtype, spec=spec, protocol=protocol), self.layout),
                None,
            )
            if debug
            else self._ep
        )
        # The jax array of slots the last debug resolve checked on the device, weakly
        # (holding it would keep it alive). jax arrays are immutable: a second check of the
        # same array would find the same.
        self._checked: weakref.ref[jax.Array] | None = None
        init = jax.jit(self.ops.init, out_shardings=self.layout.sharding)
        try:
            self._state: FutureMapState = init()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise FutureMapError(
                f"pool_size {pool_size}: the buffers do not fit the device's memory ({e})"
            ) from None
        self._fns = self.executables()
        if pack_inputs is not None and not isinstance(pack_inputs, bool):
            raise FutureMapError(f"pack_inputs must be a bool or None, got {pack_inputs!r}")
        self.pack_inputs: bool = self._inputs.single_process and (
            platform != "cpu" if pack_inputs is None else pack_inputs
        )
        self._options = compiler_options(platform)
        if not isinstance(needs_cpu_seq_lens, bool):
            raise FutureMapError(f"needs_cpu_seq_lens must be a bool, got {needs_cpu_seq_lens!r}")
        # The last publish's lengths on their way to the host (one process only).
        self._host_lengths = (
            HostLengths() if needs_cpu_seq_lens and self._inputs.single_process else None
        )
        self._packed: dict[tuple[str, PackSpec], Any] = {}
        # After warm_up(guard=True): the only executables serving may run, by key (and by
        # packing layout for those fed one packed buffer).
        self._serving: dict[Key, Guarded] | None = None
        self._serving_packed: dict[tuple[Key, PackSpec], Guarded] = {}

    # ------------------------------------------------------------------------------ state
    @property
    def state(self) -> FutureMapState:
        """The current global buffers. Donated on the next op: keep no references across ops."""
        return self._state

    def buffers(self) -> dict[str, jax.Array]:
        """The present buffers by name, global [DP*R, ...] (DLPack-exportable on one device).

        Release exported views before the next op: a live external reference blocks donation.
        """
        return {k: v for k, v in self._state._asdict().items() if v is not None}

    def executables(self) -> dict[str, Any]:  # jax's jitted-function type is private
        """The jitted entry points by name (for compile counting and HLO inspection).

        `resolve` takes a traced mode, `resolve_fixed_{extend,decode}` a mode known on the
        host; a debug map's `unchecked_*` are its tail ops for slots already checked.
        """
        out: dict[str, Any] = {}
        sets = [("", self._ep)] + ([("unchecked_", self._unchecked)] if self.debug else [])
        for prefix, ep in sets:
            for name, fn in ep._asdict().items():
                if name == "resolve_by_mode":
                    out[f"{prefix}resolve_fixed_extend"], out[f"{prefix}resolve_fixed_decode"] = fn
                else:
                    out[prefix + name] = fn
        return out

    def _exe(self, key: Key) -> Any:
        """The executable for `key` (entry point name, per-rank sizes): the jitted entry
        point (compiling on a new shape), or under the serving guard a warmed one only."""
        if self._serving is None:
            return self._fns[key.name]
        exe = self._serving.get(key)
        if exe is None:
            raise FutureMapError(
                f"serving guard: {describe(key)} was not compiled by warm_up() (batch buckets "
                f"{self.batch_buckets}, token buckets {self.token_buckets}); a call would "
                "compile it: add its bucket, or pass inputs padded to a warmed one"
            )
        return exe

    def _run(self, key: Key, *args: Any) -> Any:
        """Executable `key` on (state, *args) (an op without state: on args); its outputs.

        With `pack_inputs`, a call whose arrays are all on the host sends them as one
        packed buffer; a call that brings any jax array passes its arrays as they are.
        """
        name = key.name
        host = pack_host(args) if self.pack_inputs else None
        if host is not None:
            exe = self._packed_exe(key, host[0])
            if exe is not None:
                return exe(self._state, host[1]) if takes_state(name) else exe(host[1])
        exe = self._exe(key)
        return exe(self._state, *args) if takes_state(name) else exe(*args)

    def _packed_exe(self, key: Key, spec: PackSpec) -> Any:
        """The executable for `key` fed one packed buffer laid out by `spec`; under the
        serving guard a warmed one, or None (the unpacked executable then serves or
        refuses the call)."""
        if self._serving is not None:
            return self._serving_packed.get((key, spec))
        fn = self._packed.get((key.name, spec))
        if fn is None:
            fn = self._packed[(key.name, spec)] = self._packed_entry_point(key.name, spec)
        return fn

    def _packed_entry_point(self, name: str, spec: PackSpec) -> Any:
        return packed_entry_point(
            self._fns[name],
            name,
            spec,
            debug=self.debug,
            options=self._options,
            sharding=self.layout.replicated,
        )

    def _apply(self, op: str, key: Key, *args: Any) -> Any:
        """Executable `key` on (state, *args), its debug error (if any) recorded as `op`'s;
        returns its outputs."""
        out = self._run(key, *args)
        if self._debug is None:
            return out
        err, out = out
        self._debug.record(self.step, op, err)
        return out

    def _tail(self, op: str, idx: Rows, *args: Any, given: Any = ()) -> Any:
        """Run tail op `op` (publish, stash or finish) at slots `idx`; returns its outputs.

        A debug map checks every slot array once: host slots on the host (always), a jax
        array on the device unless it is the very array the last resolve checked. Values
        `given` as jax arrays (a forward's tokens and lengths) are checked on the device.
        """
        if self._debug is not None:
            last = self._checked() if self._checked is not None else None
            if (idx.counts is None and idx.array is not last) or on_device(given):
                return self._apply(op, Key(op, idx.size), idx.array, *args)
            op = "unchecked_" + op
        return self._run(Key(op, idx.size), idx.array, *args)

    # -------------------------------------------------------------------------------- ops
    @_serialized
    def publish(
        self, indices: RowsInput, new_seq_lens: RowsInput, *, rows: int | None = None
    ) -> None:
        """`new_seq_lens[indices] := new_seq_lens`, in place. No real row: a no-op.

        Args:
          indices: slots [B] (rank-local), or a mapping DP rank -> slots.
          new_seq_lens: lengths after this forward, one per slot, in the same form.
          rows: per-rank padded size (a batch bucket); required across processes.
        """
        idx = self._inputs.slots("indices", indices, rows)
        if idx.empty:
            return  # DP idle: nothing ran, nothing to relay
        lens = self._inputs.matched("new_seq_lens", new_seq_lens, idx, ints=True, relayed=True)
        self._state = self._tail("publish", idx, lens, given=new_seq_lens)
        self._published(idx, lens)

    @_serialized
    def stash(self, indices: RowsInput, payload: Payload, *, rows: int | None = None) -> None:
        """Write tokens (non-spec) or a DraftPayload (spec) at `indices`, in place.

        Args:
          indices: slots [B] (rank-local), or a mapping DP rank -> slots.
          payload: tokens [B], or a DraftPayload of [B, ...] rows; per-rank mappings
            (of tokens, or DraftPayloads) when `indices` is one.
          rows: per-rank padded size (a batch bucket); required across processes.
        """
        idx = self._inputs.slots("indices", indices, rows)
        if idx.empty:
            return  # DP idle: nothing ran, nothing to relay
        self._state = self._tail("stash", idx, self._payload(payload, idx), given=payload)

    @_serialized
    def finish(
        self,
        batch: Batch,
        indices: RowsInput,
        new_seq_lens: RowsInput,
        payload: Payload,
        *,
        rows: int | None = None,
    ) -> Batch:
        """The tail of a step in one donated call: publish, stash, then invalidate.

        Equivalent to `publish(indices, new_seq_lens)`, `stash(indices, payload)` and
        `invalidate(batch, indices)`, for engines that hold lengths and tokens (or the whole
        draft) together; one dispatch instead of three. Returns the invalidated batch; in
        the gather protocol (no sentinels) `batch` as given.
        """
        idx = self._inputs.slots("indices", indices, rows)
        gather = not self._relay.invalidates
        if idx.empty:  # DP idle: nothing to relay
            return batch if gather else self._invalidated(batch, idx)
        lens = self._inputs.matched("new_seq_lens", new_seq_lens, idx, ints=True, relayed=True)
        self._state, sentinel = self._tail(
            "finish", idx, lens, self._payload(payload, idx), given=(new_seq_lens, payload)
        )
        self._published(idx, lens)
        if gather:
            return batch
        return batch._replace(input_ids=sentinel, seq_lens=sentinel)

    def _published(self, idx: Rows, lens: Any) -> None:
        """A publish wrote `lens` at `idx` (as placed): start their copy to the host."""
        if self._host_lengths is not None:
            self._host_lengths.published(idx, lens)

    def _payload(self, payload: Payload, idx: Rows) -> Any:
        """Stash's payload (tokens or a DraftPayload) laid out like `idx`."""
        inputs = self._inputs
        drafts = list(payload.values()) if isinstance(payload, Mapping) else [payload]
        is_draft = [isinstance(p, DraftPayload) for p in drafts]
        if self.spec is None:
            if any(is_draft):
                raise refusals.draft_on_plain_map()
            return inputs.matched("tokens", payload, idx, ints=True, relayed=True)
        if not drafts or not all(is_draft):
            raise refusals.tokens_on_spec_map(per_rank=True)

        for p in drafts:
            rf.check_declared(self._fields, p)

        def field(f: rf.RelayField) -> Any:
            """The field's rows placed like `idx` (None where no rank gives it)."""
            name, ints = f"draft.{f.name}", f.dtype is None
            if isinstance(payload, Mapping):
                got = {r: rf.get(p, f.name) for r, p in payload.items()}
                if any(v is None for v in got.values()):
                    if all(v is None for v in got.values()):
                        return None
                    raise FutureMapError(f"{name} given on some ranks only")
                return inputs.matched(name, got, idx, ints=ints, relayed=f.consumed)
            value = rf.get(payload, f.name)
            if value is None:
                return None
            return inputs.matched(name, value, idx, ints=ints, relayed=f.consumed)

        return draft_payload({f.name: field(f) for f in self._fields})

    @_serialized
    def resolve(
        self,
        batch: Batch | Mapping[int, Batch],
        *,
        rows: int | None = None,
        tokens: int | None = None,
    ) -> Resolved:
        """Fill the batch's placeholders from the buffers (see `future_map`'s resolve).

        Starts a new step.

        Args:
          batch: a Batch; its `forward_mode` a ForwardMode known on the host (an
            executable with that mode fixed), or a jax int32 array (traced: a scalar for
            every rank, or one per DP rank). Or a mapping DP rank -> Batch of host rows
            with host modes; local ranks left out are idle.
          rows, tokens: per-rank padded sizes (buckets); required across processes.
            In the gather protocol a non-spec DECODE batch known on the host brings no ids
            (None: they are gathered; ids given are refused), and a MIXED batch's
            `token_slots` are placed like its `input_ids`.

        Returns:
          Resolved ids, lengths and draft: global arrays padded per rank to the buckets.
        """
        return self._run_resolve(self._place(batch, rows, tokens))

    def _place(
        self, batch: Batch | Mapping[int, Batch], rows: int | None, tokens: int | None
    ) -> _Placed:
        """The one way a batch (or a mapping DP rank -> Batch) becomes placed inputs and the
        resolve executable's key: checked by value, padded to buckets. Nothing runs."""
        inputs = self._inputs
        if isinstance(batch, Mapping):
            return self._place_by_rank(batch, rows, tokens)
        if not isinstance(batch, Batch):
            raise FutureMapError(
                f"resolve takes a Batch or a mapping DP rank -> Batch, got {batch!r}"
            )
        if self._gather_decode(batch.forward_mode) and (
            batch.input_ids is None or self.spec is None
        ):
            # No ids to place (T = B): a non-spec DECODE's are all gathered on the device, a
            # spec DECODE's are unused by the relay (None: zeros, made on the device).
            if batch.input_ids is not None:
                raise refusals.ids_for_gathered_decode()
            if batch.token_slots is not None:
                self._check_token_slots([ForwardMode.DECODE], batch.token_slots)
            idx = inputs.slots("req_pool_indices", batch.req_pool_indices, rows)
            lens = inputs.matched("seq_lens", batch.seq_lens, idx, ints=True)
            return self._placed(batch.forward_mode, idx, None, lens, batch.draft_indices)
        given = self._ids_of(batch.input_ids, batch.req_pool_indices, batch.forward_mode)
        rows, tokens = self._resolve_sizes(batch.req_pool_indices, given, rows, tokens)
        idx = inputs.slots("req_pool_indices", batch.req_pool_indices, rows)
        ids = inputs.token_ids("input_ids", given, tokens)
        lens = inputs.matched("seq_lens", batch.seq_lens, idx, ints=True)
        slots = self._token_slots(batch.token_slots, ids)
        return self._placed(batch.forward_mode, idx, ids, lens, batch.draft_indices, slots)

    def _gather_decode(self, mode: Any) -> bool:
        """A DECODE batch known on the host, in the gather protocol: it places no ids when
        it brings none (non-spec: it must bring none, they are all gathered)."""
        if not self._relay.gathers_decode_ids:
            return False
        if type(mode) is ForwardMode:
            return mode is ForwardMode.DECODE
        return (
            isinstance(mode, int | np.integer)
            and not isinstance(mode, bool | np.bool_)
            and int(mode) == ForwardMode.DECODE
        )

    def _ids_of(self, ids: Any, slots: Any, mode: Any, where: str = "") -> Any:
        """A batch's input ids. In the gather protocol only a DECODE batch known on the
        host comes without ids (a DECODE rank's in a mapping: zeros, one per row, never
        read); any other batch without ids is refused, a traced mode's included (its
        kind is known only on the device)."""
        if ids is not None or not self._relay.gathers_decode_ids:
            return ids
        if isinstance(mode, jax.Array):
            raise FutureMapError(
                f"{where}input_ids is None with a traced forward_mode: a batch whose kind is "
                "known only on the device brings its ids (any id >= 0 at DECODE rows: they are "
                "gathered)"
            )
        if isinstance(mode, np.ndarray) and mode.ndim == 1:  # one per rank: idle ones too
            kinds = {_host_mode(m, f"{where}forward_mode") for m in mode.tolist()}
            kinds -= {ForwardMode.IDLE}
        else:
            kinds = {_host_mode(mode, f"{where}forward_mode")}
        if kinds - {ForwardMode.DECODE}:
            names = "/".join(sorted(k.name for k in kinds))
            raise FutureMapError(
                f"{where}input_ids is None with forward_mode {names}: only a DECODE batch "
                "comes without ids in the gather protocol"
            )
        try:
            return np.zeros(len(slots), self.dtype)
        except TypeError:
            return ids  # not an array: placing the slots names it

    def _token_slots(self, x: Any, ids: Rows) -> Any:
        """A MIXED batch's token slots (gather protocol) placed like its input ids."""
        if x is None:
            return None
        if not self._relay.takes_token_slots:
            raise refusals.token_slots_in_sentinel_protocol()
        return self._inputs.token_slots("token_slots", x, ids).array

    def _resolve_sizes(
        self, slots: Any, ids: Any, rows: int | None, tokens: int | None
    ) -> tuple[int | None, int | None]:
        """A resolve's per-rank padded sizes: for host inputs the (rows, tokens) pair its
        token bucket fixes (`buckets.resolve_sizes`: one executable per token bucket);
        jax arrays keep the sizes they have."""
        if (
            type(slots) is np.ndarray
            and type(ids) is np.ndarray
            and slots.ndim == ids.ndim == 1
            and rows is tokens is None
        ):
            dp = self.layout.dp  # the per-step case, kept short
            n, t = slots.shape[0] // dp, ids.shape[0] // dp
            return bk.resolve_sizes(n, t, self.batch_buckets, self.token_buckets)
        if isinstance(slots, jax.Array) or isinstance(ids, jax.Array):
            return rows, tokens
        for given, buckets, what in (
            (rows, self.batch_buckets, "rows"),
            (tokens, self.token_buckets, "tokens"),
        ):
            if given is not None and given not in buckets:
                raise FutureMapError(f"{what}={given} is not one of the buckets {buckets}")
        n = rows if rows is not None else _rows_per_rank(slots, self.layout.dp)
        t = tokens if tokens is not None else _rows_per_rank(ids, self.layout.dp)
        if n is None or t is None:
            return rows, tokens  # not an array: placing it names the field
        return bk.resolve_sizes(n, t, self.batch_buckets, self.token_buckets)

    def _place_by_rank(
        self, batches: Mapping[int, Batch], rows: int | None, tokens: int | None
    ) -> _Placed:
        inputs = self._inputs
        for r, b in batches.items():
            if not isinstance(b, Batch):
                raise FutureMapError(f"batch[rank {r}] must be a Batch, got {type(b).__name__}")
        field = lambda f: {r: getattr(b, f) for r, b in batches.items()}  # noqa: E731
        given = {
            r: self._ids_of(b.input_ids, b.req_pool_indices, b.forward_mode, f"batch[rank {r}].")
            for r, b in batches.items()
        }
        rows, tokens = self._resolve_sizes(field("req_pool_indices"), given, rows, tokens)
        idx = inputs.slots("req_pool_indices", field("req_pool_indices"), rows)
        ids = inputs.token_ids("input_ids", given, tokens)
        lens = inputs.matched("seq_lens", field("seq_lens"), idx, ints=True)
        modes = np.full(self.layout.dp, int(ForwardMode.IDLE), np.int32)
        for r, b in batches.items():
            modes[int(r)] = _host_mode(b.forward_mode, f"batch[rank {r}].forward_mode")
            if b.input_ids is not None and self.spec is None and self._gather_decode(modes[r]):
                raise refusals.ids_for_gathered_decode(f"batch[rank {r}].")
        drafts = {r: d for r, d in field("draft_indices").items() if d is not None}
        if drafts and self.spec is None:
            raise refusals.draft_indices_on_plain_map()
        for r in batches:
            if drafts and r not in drafts and modes[int(r)] == ForwardMode.DECODE:
                raise FutureMapError(
                    f"batch[rank {r}].draft_indices missing: beside ranks with a draft input "
                    "a spec DECODE rank brings its own (its lengths are gathered at them)"
                )
        if drafts:  # a rank without a draft input reads padding slot 0 (garbage, unused)
            drafts = {
                r: drafts.get(r, np.zeros(len(b.req_pool_indices), self.dtype))
                for r, b in batches.items()
            }
        given_slots = {r: s for r, s in field("token_slots").items() if s is not None}
        for r in batches:  # each rank by the one-batch rule, before the slots are placed
            where = f"batch[rank {r}]."
            if r in given_slots and not self._relay.takes_token_slots:
                raise refusals.token_slots_in_sentinel_protocol(where)
            self._check_token_slots([ForwardMode(modes[int(r)])], given_slots.get(r), where)
        slots = None
        if given_slots and ForwardMode.MIXED in modes:
            # Ranks without token slots (not MIXED) gather nothing: all 0, 'keep the id'.
            # Without a MIXED rank every slot given is 0: there is nothing to gather.
            full = {r: given_slots.get(r, np.zeros(len(given[r]), self.dtype)) for r in batches}
            slots = self._token_slots(full, ids)
        return self._placed(modes, idx, ids, lens, drafts or None, slots)

    def _placed(
        self, mode: Any, idx: Rows, ids: Rows | None, lens: Any, draft: Any, slots: Any = None
    ) -> _Placed:
        """Placed inputs and their resolve key; `mode` is host (a ForwardMode or one per
        rank) or traced. No `ids`: a gather-protocol DECODE, whose ids are gathered (T = B)."""
        if isinstance(mode, jax.Array):
            if mode.dtype != np.int32 or mode.shape not in ((), (self.layout.dp,)):
                raise FutureMapError(
                    f"a traced forward_mode must be int32 of shape () or ({self.layout.dp},), "
                    f"got {mode.dtype}{list(mode.shape)}"
                )
            resolve, decoding = "resolve", []  # traced: rows not checked against the mode
        elif type(mode) is ForwardMode:  # the per-step case: one mode known on the host
            decoding = [mode is ForwardMode.DECODE]
            self._check_token_slots([mode], slots)
            self._check_spec_mixed([mode], idx.array, slots)
            resolve, mode = _FIXED[decoding[0]], None
        else:
            if isinstance(mode, np.ndarray) and mode.ndim == 1:
                modes = [_host_mode(m, "forward_mode") for m in mode.tolist()]
            else:
                modes = [_host_mode(mode, "forward_mode")]
            decoding = [m == ForwardMode.DECODE for m in modes]
            self._check_token_slots(modes, slots)
            self._check_spec_mixed(modes, idx.array, slots)
            decode = {m == ForwardMode.DECODE for m in modes if m != ForwardMode.IDLE}
            if len(decode) > 1:
                # Ranks differ in kind: one executable with the per-rank modes traced.
                resolve, mode = "resolve", np.asarray(modes, np.int32)
            else:
                # Known on the host: an executable with the mode fixed (no branch inside).
                resolve, mode = _FIXED[decode == {True}], None
        if self.spec is None and decoding and ids is not None and self._relay.invalidates:
            self._inputs.one_id_per_row(ids, idx, decoding)
        draft_idx = None
        if draft is not None:
            if self.spec is None:
                raise refusals.draft_indices_on_plain_map()
            placed = self._inputs.slots("draft_indices", draft, idx.size)
            if None not in (placed.counts, idx.counts) and placed.counts != idx.counts:
                raise FutureMapError(
                    f"draft_indices has {placed.counts} rows per rank, req_pool_indices "
                    f"{idx.counts}: one draft slot per row"
                )
            draft_idx = placed.array
        b = Batch(mode, idx.array, None if ids is None else ids.array, lens, draft_idx, slots)
        t = idx.size if ids is None else ids.size
        key = Key(resolve, idx.size, t, draft is not None, slots is not None)
        return _Placed(key, b, idx, ids)

    def _run_resolve(self, p: _Placed) -> Resolved:
        """Resolve placed inputs: a new step."""
        self.step += 1
        try:
            out = self._apply("resolve", p.key, p.batch)
        except FutureMapError:
            self.step -= 1  # refused before it ran (when traced): no step was taken
            raise
        if self._debug is not None:
            self._state, out = out  # debug: the consume poison was written
            self._resolved(p.idx)
        return out  # type: ignore[no-any-return]

    def _resolved(self, idx: Rows) -> None:
        """Debug, after a resolve ran: its slots were checked on the device (only now)."""
        self._checked = weakref.ref(idx.array) if idx.counts is None else None

    def _check_token_slots(self, modes: list[ForwardMode], slots: Any, where: str = "") -> None:
        """Gather protocol, modes known on the host (one per rank): a MIXED batch brings
        token slots, a DECODE batch none (it gathers at its req_pool_indices), and slots
        given without a MIXED rank are all 0. `where` names the rank of a mapping's batch."""
        if not self._relay.takes_token_slots:
            return
        if slots is None and ForwardMode.MIXED in modes:
            raise refusals.mixed_without_token_slots(where)
        if slots is not None and modes == [ForwardMode.DECODE]:
            raise refusals.token_slots_for_decode(where)
        if slots is not None and ForwardMode.MIXED not in modes and not _all_zero(slots):
            kinds = "/".join(sorted({ForwardMode(m).name for m in modes}))
            raise FutureMapError(
                f"{where}token_slots of a batch of kind {kinds} name slots (or are a jax "
                "array, not read here): only a MIXED batch has running rows to gather"
            )

    def _check_spec_mixed(self, modes: list[ForwardMode], idx: Any, slots: Any) -> None:
        """Spec MIXED, modes known on the host (one per rank): a gather-protocol feature,
        and (host arrays) each MIXED rank's running rows are its last live rows in
        token-slot order, as resolve binds their lengths there."""
        if self.spec is None or ForwardMode.MIXED not in modes:
            return
        if not self._relay.serves_spec_mixed:
            raise refusals.spec_mixed_in_sentinel_protocol()
        if isinstance(idx, jax.Array) or isinstance(slots, jax.Array) or slots is None:
            return  # device arrays: debug checks the order ('batch fields')
        rows = np.asarray(idx).reshape(len(modes), -1)
        toks = np.asarray(slots).reshape(len(modes), -1)
        for r, m in enumerate(modes):
            if m != ForwardMode.MIXED:
                continue
            running = toks[r][toks[r] > 0]
            live = rows[r][rows[r] > 0]
            tail = live[len(live) - len(running) :]
            if len(running) > len(live) or not np.array_equal(tail, running):
                where = f"batch[rank {r}]." if len(modes) > 1 else "batch."
                raise FutureMapError(
                    f"{where}token_slots name running slots {running.tolist()}, but the "
                    f"batch's last live rows hold {tail.tolist()}: a spec MIXED batch lists "
                    "its running rows last, one per nonzero token slot, in that order"
                )

    @_serialized
    def invalidate(self, batch: Batch, indices: RowsInput, *, rows: int | None = None) -> Batch:
        """Sentinels for the next step: ids and lengths := -indices (padding rows: 0).

        Returns `batch` with `input_ids` and `seq_lens` replaced by the sentinels, global
        and padded per rank to the batch bucket; its other fields as given. Refused in the
        gather protocol, which leaves no sentinels.
        """
        if not self._relay.invalidates:
            raise FutureMapError(
                "invalidate: the gather protocol leaves no sentinels (resolve gathers the "
                "decode ids at forward entry)"
            )
        return self._invalidated(batch, self._inputs.slots("indices", indices, rows))

    def _invalidated(self, batch: Batch, idx: Rows) -> Batch:
        """The sentinels of slots `idx`; a debug map checks device slots on the device
        (unless the last resolve checked that very array), host slots were checked here."""
        if self._debug is not None:
            last = self._checked() if self._checked is not None else None
            if idx.counts is None and idx.array is not last:
                sentinel = self._apply("invalidate", Key("sentinels", idx.size), idx.array)
            else:
                sentinel = self._run(Key("unchecked_sentinels", idx.size), idx.array)
        else:
            sentinel = self._run(Key("sentinels", idx.size), idx.array)
        return batch._replace(input_ids=sentinel, seq_lens=sentinel)

    @_serialized
    def resolve_seq_lens_cpu(
        self, indices: RowsInput, *, rows: int | None = None
    ) -> np.ndarray | dict[int, np.ndarray]:
        """Host copy of `new_seq_lens[indices]` (pending debug errors raise here).

        At exactly the slots of the last publish (or `finish`, or engine step) it takes the
        copy that publish started: it waits for the publishing step only, not for work
        queued after it (`needs_cpu_seq_lens`). Other slots are gathered from the buffer:
        a sync behind everything queued.

        Returns the lengths in the form `indices` was given: [B] host rows (global, padding
        removed for host input), or a mapping DP rank -> lengths.
        """
        idx = self._inputs.slots("indices", indices, rows)
        copied = None if self._host_lengths is None else self._host_lengths.read(idx)
        if copied is not None:  # the slots last published: their copy, no gather
            self.check()
            return self._inputs.unpad(copied, idx)
        out = self._apply("resolve_seq_lens_cpu", Key("seq_lens_at", idx.size), idx.array)
        if self._inputs.single_process:
            host = np.asarray(jax.device_get(out))
        else:
            blocks = per_rank(out, self.layout)
            host = np.concatenate(
                [blocks.get(d, np.zeros(idx.size, self.dtype)) for d in range(self.layout.dp)]
            )
        self.check()
        return self._inputs.unpad(host, idx)

    @_serialized
    def check(self) -> None:
        """Raise InvariantViolation listing every failed debug check since the last call.

        A host sync. Names each violation's invariant, step (resolves so far), op and, on
        a map with several DP ranks, the rank. Without debug: nothing to check.
        """
        if self._debug is not None:
            self._debug.check()

    # ------------------------------------------------------------------------ engine step
    def engine_step(
        self,
        forward: Forward,
        *,
        inputs: Sequence[StepInput] = (),
        donate_argnums: Sequence[int] = (),
        compiler_options: Mapping[str, Any] | None = None,
    ) -> EngineStep:
        """The engine's jitted step with this map's relay inside: the recommended way in.

        One dispatch per step: resolve at the head, `forward` on the resolved ids and
        lengths, publish, stash and (sentinel protocol) the sentinels at the tail; the map's
        state and the arguments named by `donate_argnums` donated. The class's rules hold
        unchanged: the batch's host arrays are checked by value and padded to the buckets,
        every host array of a call (the batch's and the declared `inputs`) goes to the
        device in one packed transfer, `EngineStep.warm_up` (with `guard=True`) covers the
        step's executables, and debug errors go to `check()`.

        Args:
          forward: `(resolved, batch, inputs, *args) -> StepOutput`, traced inside the
            step: `resolved` the filled ids, lengths (and draft); `batch` the placed batch
            (its `req_pool_indices` are the rows' slots; `forward_mode` a fixed ForwardMode
            when known on the host, else traced); `inputs` the declared inputs by name;
            `args` the step's own arguments. It returns the new lengths and the payload
            to relay (tokens, or a DraftPayload on a spec map) and its `out`.
          inputs: the engine's own per-row or per-token host arrays (`StepInput`).
          donate_argnums: indices into the step's `args` to donate (the KV cache).
          compiler_options: XLA options of the step; default `fm_jax.compiler_options()`
            for the map's platform (on CPU that keeps the step's elementwise ops on the
            calling thread: pass `{}` for a model that wants XLA's thread pool).

        Returns:
          EngineStep: `step(batch, *args, inputs=...) -> StepResult(out, next batch)`.
        """
        return EngineStep(
            self,
            forward,
            inputs=inputs,
            donate_argnums=donate_argnums,
            options=compiler_options,
        )

    # ---------------------------------------------------------------------------- warm-up
    def _packed_plan(self, p: Planned) -> Planned | None:
        """Planned executable `p` fed one packed buffer, as serving's host calls feed it;
        None when no argument of `p` is on the host."""
        host = pack_host(p.args[1:] if takes_state(p.key.name) else p.args)
        if host is None:
            return None
        spec, packed = host
        fn = self._packed.get((p.key.name, spec)) or self._packed_entry_point(p.key.name, spec)
        self._packed[(p.key.name, spec)] = fn
        head = (self._state,) if takes_state(p.key.name) else ()
        return Planned(p.key, fn, (*head, packed), packed=spec)

    @_serialized
    def warm_up(
        self, *, guard: bool = False, traced_modes: bool = True, threads: int | None = None
    ) -> WarmUpReport:
        """Compile every executable serving calls, for every bucket, ahead of time.

        The executables (`warm_up.plan`): publish, stash, finish and the sentinels per
        batch bucket (a debug map's tail ops also unchecked; a spec map's `seq_lens_at`
        too); resolve per token bucket (which fixes its rows), with the mode fixed (not
        DECODE; DECODE, on a non-spec map only up to the largest batch's tokens) and
        traced, each with and without a draft on a spec map. Traced and lowered with
        arguments placed as serving places its host inputs, compiled on `threads`
        threads; nothing runs and no buffer changes. Logs the report at INFO on the
        "fm_jax" logger.

        Args:
          guard: afterwards, serve only the warmed executables: a call that would compile
            (a shape, dtype or sharding not warmed) raises FutureMapError naming the op,
            its sizes and the buckets, before anything runs.
          traced_modes: also warm resolve with a traced forward mode (a jax array, and a
            mesh's ranks in different kinds); False for an engine that gives every batch
            a host ForwardMode on one device.
          threads: compile threads; default min(8, CPU count).

        Returns:
          What was compiled, what came from JAX's persistent cache, and the time.
        """
        t0 = time.perf_counter()
        planned = plan(
            self._fns,
            self._inputs,
            self._state,
            self.spec,
            debug=self.debug,
            traced_modes=traced_modes,
            protocol=self.protocol,
        )
        if self.pack_inputs:
            planned += [p for p in map(self._packed_plan, planned) if p is not None]
        with counting_compiles() as counter:
            compiled = compile_plan(planned, threads)
        summary = report(planned, counter, time.perf_counter() - t0)
        self._serving, self._serving_packed = None, {}
        if guard:
            self._serving = {}
            for p, c in zip(planned, compiled, strict=True):
                if p.packed is not None:
                    self._serving_packed[(p.key, p.packed)] = Guarded(c, p.key)
                else:
                    self._serving[p.key] = Guarded(c, p.key)
        _log.info("%s", summary)
        return summary
