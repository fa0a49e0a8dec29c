"""`FutureMap`: pure ops behind jitted, donated entry points, for engines calling ops one by one."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fm_jax._src import buckets as bk
from fm_jax._src import checks
from fm_jax._src.compile_options import compiler_options
from fm_jax._src.entry_points import jit_entry_points
from fm_jax._src.errors import FutureMapError
from fm_jax._src.held_state import HeldState
from fm_jax._src.host_checks import check_host_slots
from fm_jax._src.ops import future_map
from fm_jax._src.packed_errors import ErrorPacker
from fm_jax._src.types import Batch, DraftPayload, ForwardMode, FutureMapState, Resolved, SpecConfig

_INT_DTYPES = frozenset(
    np.dtype(t)
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
)
_IS_DECODE = {int(m): m == ForwardMode.DECODE for m in ForwardMode}
_MAX_KNOWN_SHARDINGS = 256


def _with_sentinels(batch: Batch, sentinel: jax.Array) -> Batch:
    """`batch` with ids and lengths replaced by `sentinel` (cheaper than NamedTuple._replace)."""
    return Batch(
        batch.forward_mode, batch.req_pool_indices, sentinel, sentinel, batch.draft_indices
    )


class FutureMap(HeldState):
    """A FutureMap that holds its state and updates it in place through donated jitted ops.

    Inputs may be numpy arrays (checked by value on the host, padded to a bucket, then put
    on the device) or jax arrays (checked for rank, shape and dtype; their leading size
    must already be a bucket size, so that no new shape reaches the compiler). Outputs are
    padded to the bucket; padding rows carry slot 0 and token 0.

    Debug mode checks every slot array once (host arrays on the host; device arrays on the
    device, where `finish`, `publish` and `stash` skip the very array that the last
    `resolve` checked). It adds no host sync per step: each op's checkify error stays on
    device and is raised by `check()`, by `resolve_seq_lens_cpu` (which syncs anyway), or
    after MAX_PENDING_ERRORS ops.

    Args:
      pool_size: R, rows of the request pool (max running requests + 1); slot 0 is padding.
      dtype: int32 (default) or int64 (needs JAX's x64 mode).
      spec: static shapes of the spec extras, or None.
      debug: consume tracking and invariant checks.
      batch_buckets: allowed batch sizes (rows); default powers of two up to 1024.
      token_buckets: allowed flat token counts; default powers of two up to 8192.
      device: where the buffers live; default JAX's default device.
    """

    def __init__(
        self,
        pool_size: int,
        *,
        dtype: Any = jnp.int32,
        spec: SpecConfig | None = None,
        debug: bool = False,
        batch_buckets: Sequence[int] | None = None,
        token_buckets: Sequence[int] | None = None,
        device: jax.Device | None = None,
    ) -> None:
        self.ops = future_map(pool_size, dtype=dtype, spec=spec, debug=debug)
        self.pool_size = pool_size
        self.dtype = self.ops.dtype
        self.spec = self.ops.spec
        self.debug = debug
        self.batch_buckets = bk.normalize_buckets(batch_buckets or bk.power_of_two_buckets(1024))
        self.token_buckets = bk.normalize_buckets(token_buckets or bk.power_of_two_buckets(8192))
        self.device = device or jax.devices()[0]
        self._sharding = jax.sharding.SingleDeviceSharding(self.device)
        self._same_sharding: dict[int, jax.sharding.Sharding] = {}
        self._state: FutureMapState = jax.device_put(jax.jit(self.ops.init)(), self.device)
        self.step = 0
        self._pending: list[tuple[int, str, Any]] = []  # errors packed by self._errors
        self._errors = ErrorPacker()

        ops = self.ops

        (self._publish, self._stash, self._resolve, self._resolve_by_mode, self._finish) = (
            jit_entry_points(ops, debug=debug, platform=self.device.platform, errors=self._errors)
        )
        # Debug: the tail ops' only checks are slot checks. Slots already checked (on the
        # host, or by the last resolve) take these unchecked executables instead.
        self._unchecked = (
            jit_entry_points(
                future_map(pool_size, dtype=dtype, spec=spec),
                debug=False,
                platform=self.device.platform,
            )
            if debug
            else None
        )
        # The last resolve's req_pool_indices, weakly: holding it would keep it alive.
        self._checked_slots: weakref.ref[jax.Array] | None = None
        # Only the indices reach the compiler: the batch's other fields (maybe unpadded
        # host arrays) would otherwise key a compile per shape.
        options = compiler_options(self.device.platform)
        self._sentinels = jax.jit(lambda idx: -idx.astype(ops.dtype), compiler_options=options)
        self._take_lens = jax.jit(
            lambda state, idx: state.new_seq_lens[idx], compiler_options=options
        )

    # ------------------------------------------------------------------------------ state
    @property
    def state(self) -> FutureMapState:
        """The current buffers. Donated on the next op: do not keep references across ops."""
        return self._state

    def buffers(self) -> dict[str, jax.Array]:
        """The present buffers by name (e.g. for DLPack export with `torch.from_dlpack`).

        Release exported views before the next op: a live external reference blocks donation.
        """
        return {k: v for k, v in self._state._asdict().items() if v is not None}

    # ------------------------------------------------------------------------- input prep
    def _host_ints(self, name: str, a: np.ndarray) -> np.ndarray:
        """Cast a host int array to the map's dtype, refusing values that do not fit."""
        if not np.issubdtype(a.dtype, np.integer):
            raise FutureMapError(f"{name} must have an integer dtype, got {a.dtype}")
        info = np.iinfo(self.dtype)
        if a.size and (a.min() < info.min or a.max() > info.max):
            raise FutureMapError(f"{name} holds values that do not fit the {self.dtype} buffer")
        return a.astype(self.dtype)

    def _flat(self, name: str, x: Any, buckets: tuple[int, ...]) -> tuple[jax.Array, int]:
        """A 1-D int input as a device array of bucket size, and its unpadded length."""
        if isinstance(x, jax.Array):
            shape = x.shape
            # The per-step case first: a bucket-sized int array (kept cheap: every op pays it).
            if len(shape) == 1 and shape[0] in buckets and x.dtype in _INT_DTYPES:
                return self._on_device(x), shape[0]
            if x.size != 0:
                if len(shape) != 1 or x.dtype not in _INT_DTYPES:
                    raise FutureMapError(
                        f"{name} must be a 1-D integer array, got {shape} {x.dtype}"
                    )
                raise FutureMapError(
                    f"{name} has {shape[0]} entries, not a bucket size {buckets}: pad it "
                    "(fm_jax.pad_to_bucket) or pass a numpy array"
                )
            x = np.zeros(shape, x.dtype)  # empty: padded on the host like numpy input
        a = np.asarray(x)
        if a.ndim != 1:
            raise FutureMapError(f"{name} must be 1-D, got shape {a.shape}")
        a = self._host_ints(name, a)
        n = a.shape[0]
        # An empty input (IDLE) still takes the smallest bucket: no shape outside the buckets.
        rows = bk.bucket_for(max(n, 1), buckets, name)
        return jax.device_put(bk.pad_rows(a, rows), self.device), n

    def _slots(self, name: str, x: Any) -> tuple[jax.Array, int]:
        """Slot indices; host arrays are checked by value (range, duplicate live slots)."""
        if not isinstance(x, jax.Array):
            a = np.asarray(x)
            if a.ndim == 1 and np.issubdtype(a.dtype, np.integer) and a.size:
                check_host_slots(name, a, self.pool_size)
        return self._flat(name, x, self.batch_buckets)

    def _tail_op(self, op: str, indices: Any, idx: jax.Array) -> tuple[Any, bool]:
        """The executable of tail op `op` for slots `indices` (`idx` on the device), and
        whether it returns a debug error.

        A debug map checks every slot array once: a host array on the host (always), a
        device array on the device, unless it is the very array the last resolve
        checked (jax arrays are immutable: a second check would find the same). Slots
        already checked take the executable without checks.
        """
        if self._unchecked is None:
            return getattr(self, f"_{op}"), False
        checked_by_resolve = self._checked_slots is not None and idx is self._checked_slots()
        if not isinstance(indices, jax.Array) or checked_by_resolve:
            return getattr(self._unchecked, op), False
        return getattr(self, f"_{op}"), True

    def _run_tail(self, op: str, indices: Any, idx: jax.Array, *args: Any) -> Any:
        """Run tail op `op` (publish, stash or finish) on the state; returns its extra output."""
        fn, with_error = self._tail_op(op, indices, idx)
        if with_error:
            err, out = fn(self._state, idx, *args)
            self._record(op, err)
        else:
            out = fn(self._state, idx, *args)
        if op == "finish":
            self._state, sentinel = out
            return sentinel
        self._state = out
        return None

    def _on_device(self, x: jax.Array) -> jax.Array:
        """`x` committed to the map's device. Jit keys its cache on commitment, so an
        uncommitted array (e.g. from `jnp.asarray`) would compile again. No copy when `x`
        already lives there; no device_put call either (it costs more than the op itself)."""
        if x.committed:
            sh = x.sharding
            # Shardings already found equal, by identity (an == costs ~1 us per input). The
            # dict holds the objects, so an id cannot be reused while it is in there.
            if self._same_sharding.get(id(sh)) is sh:
                return x
            if sh == self._sharding:
                if len(self._same_sharding) >= _MAX_KNOWN_SHARDINGS:
                    self._same_sharding.clear()
                self._same_sharding[id(sh)] = sh
                return x
        return jax.device_put(x, self.device)

    def _rows(self, name: str, x: Any, rows: int, n: int, *, ints: bool) -> jax.Array:
        """A per-row payload matched to `n` real rows and padded to `rows` (the bucket)."""
        if isinstance(x, jax.Array):
            shape = x.shape
            if shape and shape[0] == rows:  # rows >= 1: a bucket
                return self._on_device(x)
            if x.size != 0:
                raise FutureMapError(f"{name} has {shape[:1]} rows, indices have {rows}")
            x = np.zeros(shape, x.dtype)  # empty: padded on the host like numpy input
        a = np.asarray(x)
        if a.ndim < 1 or a.shape[0] != n:
            raise FutureMapError(f"{name} has {a.shape[:1]} rows, indices have {n}")
        if ints:
            a = self._host_ints(name, a)
        elif jax.dtypes.canonicalize_dtype(a.dtype) != a.dtype:
            # device_put would cast (e.g. float64 -> float32 without x64): refuse instead.
            raise FutureMapError(f"{name} has dtype {a.dtype}, not a dtype the map stores")
        return jax.device_put(bk.pad_rows(a, rows), self.device)

    # -------------------------------------------------------------------------------- ops
    def publish(self, indices: Any, new_seq_lens: Any) -> None:
        """`new_seq_lens[indices] := new_seq_lens`, in place. Empty indices is a no-op."""
        idx, n = self._slots("indices", indices)
        if n == 0:
            return  # DP idle: nothing ran, nothing to relay
        lens = self._rows("new_seq_lens", new_seq_lens, idx.shape[0], n, ints=True)
        self._run_tail("publish", indices, idx, lens)

    def stash(self, indices: Any, payload: Any) -> None:
        """Write tokens (non-spec) or a DraftPayload (spec) at `indices`, in place."""
        idx, n = self._slots("indices", indices)
        if n == 0:
            return  # DP idle: nothing ran, nothing to relay
        self._run_tail("stash", indices, idx, self._payload(payload, idx.shape[0], n))

    def finish(self, batch: Batch, indices: Any, new_seq_lens: Any, payload: Any) -> Batch:
        """The tail of a step in one donated call: publish, stash, then invalidate.

        Equivalent to `publish(indices, new_seq_lens)`, `stash(indices, payload)` and
        `invalidate(batch, indices)`, for engines that hold lengths and tokens (or the whole
        draft) together; one dispatch instead of three. Returns the invalidated batch.
        """
        idx, n = self._slots("indices", indices)
        if n == 0:
            return self.invalidate(batch, indices)  # DP idle: nothing to relay
        rows = idx.shape[0]
        lens = self._rows("new_seq_lens", new_seq_lens, rows, n, ints=True)
        sentinel = self._run_tail("finish", indices, idx, lens, self._payload(payload, rows, n))
        return _with_sentinels(batch, sentinel)

    def _payload(self, payload: Any, rows: int, n: int) -> Any:
        """Stash's payload (tokens or a DraftPayload) on the device, padded to `rows`."""
        if not isinstance(payload, DraftPayload):
            return self._rows("tokens", payload, rows, n, ints=True)
        hidden = payload.hidden_states
        return DraftPayload(
            bonus_tokens=self._rows("draft.bonus_tokens", payload.bonus_tokens, rows, n, ints=True),
            topk_p=self._rows("draft.topk_p", payload.topk_p, rows, n, ints=False),
            topk_index=self._rows("draft.topk_index", payload.topk_index, rows, n, ints=True),
            hidden_states=None
            if hidden is None
            else self._rows("draft.hidden_states", hidden, rows, n, ints=False),
        )

    def resolve(self, batch: Batch) -> Resolved:
        """Fill the batch's placeholders from the buffers (see `future_map`'s resolve).

        Starts a new step. Returns the resolved ids, lengths and draft, padded to buckets.
        """
        idx, n = self._slots("req_pool_indices", batch.req_pool_indices)
        if not isinstance(batch.input_ids, jax.Array):
            a = np.asarray(batch.input_ids)
            if (
                a.ndim == 1
                and np.issubdtype(a.dtype, np.integer)
                and a.size
                and a.min() <= -self.pool_size
            ):
                raise FutureMapError(
                    f"input_ids holds sentinels {a[a <= -self.pool_size].tolist()} naming slots "
                    f"outside [0, {self.pool_size})"
                )
        ids, _ = self._flat("input_ids", batch.input_ids, self.token_buckets)
        lens = self._rows("seq_lens", batch.seq_lens, idx.shape[0], n, ints=True)
        mode = batch.forward_mode
        resolve = self._resolve
        if isinstance(mode, jax.Array):
            mode = self._on_device(mode)
        else:
            # Known on the host: an executable with the mode fixed (no branch inside).
            try:
                decode = _IS_DECODE[int(mode)]
            except (TypeError, ValueError, KeyError) as bad:
                raise FutureMapError(f"forward_mode must be a ForwardMode, got {mode!r}") from bad
            resolve, mode = self._resolve_by_mode[decode], None
        draft_idx = None
        if batch.draft_indices is not None and self.spec is None:
            raise FutureMapError("batch.draft_indices given but the map was built without spec")
        if batch.draft_indices is not None:
            draft_idx, _ = self._slots("draft_indices", batch.draft_indices)
        b = Batch(mode, idx, ids, lens, draft_idx)
        self.step += 1
        if self.debug:
            self._checked_slots = weakref.ref(idx)
            err, (self._state, out) = resolve(self._state, b)
            self._record("resolve", err)
            return out
        return resolve(self._state, b)  # type: ignore[no-any-return]

    def invalidate(self, batch: Batch, indices: Any) -> Batch:
        """Sentinels for the next step: ids and lengths := -indices (padding rows: 0).

        Returns `batch` with `input_ids` and `seq_lens` replaced by the sentinels, padded
        to the batch bucket; its other fields are returned as given.
        """
        idx, _ = self._slots("indices", indices)
        sentinel = self._sentinels(idx)
        return _with_sentinels(batch, sentinel)

    def warm_up(self) -> None:
        """Compile every entry point for every bucket, so that serving compiles nothing.

        Runs each op on all-padding batches (slot 0 only: its content is garbage by
        contract, so no live slot changes): publish, stash, invalidate, finish and
        resolve_seq_lens_cpu per batch bucket, resolve per (batch, token) bucket pair, for a
        mode fixed on the host (DECODE or not) and a traced one, and on a spec map also with
        draft_indices of the batch's bucket. A host sync.
        """
        step = self.step
        traced = jax.device_put(np.int32(ForwardMode.EXTEND), self.device)
        modes: tuple[Any, ...] = (ForwardMode.EXTEND, ForwardMode.DECODE, traced)
        for b in self.batch_buckets:
            # Host arrays stand in for jax arrays: the class takes either.
            zeros: Any = np.zeros(b, np.int32)
            self.publish(zeros, zeros)
            if self.spec is None:
                self.stash(zeros, zeros)
            else:
                self.stash(zeros, self._zero_draft(b))
            pad = Batch(zeros[0], zeros, zeros, zeros)
            self.invalidate(pad, zeros)
            self.finish(pad, zeros, zeros, zeros if self.spec is None else self._zero_draft(b))
            if self.debug:  # device slots take the checked tail executables
                dz = jax.device_put(zeros, self.device)
                self.publish(dz, zeros)
                self.stash(dz, zeros if self.spec is None else self._zero_draft(b))
                self.finish(pad, dz, zeros, zeros if self.spec is None else self._zero_draft(b))
            self.resolve_seq_lens_cpu(zeros)
            drafts = [None] if self.spec is None else [None, zeros]
            for t in self.token_buckets:
                for d in drafts:
                    tokens: Any = np.zeros(t, np.int32)
                    for mode in modes:  # fixed EXTEND, fixed DECODE, and traced
                        self.resolve(Batch(mode, zeros, tokens, zeros, d))
        jax.block_until_ready(self._state)
        self.check()
        self.step = step  # warm-up resolves are not serving steps

    def _zero_draft(self, rows: int) -> DraftPayload:
        assert self.spec is not None
        k, h = self.spec.topk, self.spec.hidden
        return DraftPayload._make(  # host arrays, padded and put by stash
            [
                np.zeros(rows, np.int32),
                np.zeros((rows, k), np.float32),
                np.zeros((rows, k), np.int32),
                np.zeros((rows, h), self.spec.hidden_dtype) if h else None,
            ]
        )

    def resolve_seq_lens_cpu(self, indices: Any) -> np.ndarray:
        """Host copy of `new_seq_lens[indices]` (a sync point: pending debug errors raise here)."""
        idx, n = self._slots("indices", indices)
        out = np.asarray(jax.device_get(self._take_lens(self._state, idx)))[:n]
        self.check()
        return out

    def check(self) -> None:
        """Raise InvariantViolation for the first failed debug check since the last call.

        A host sync. Naming the step (resolves so far) and op where the check failed.
        """
        pending, self._pending = self._pending, []
        if not pending:
            return
        host = jax.device_get([packed for _, _, packed in pending])  # one transfer
        for (step, op, _), packed in zip(pending, host, strict=True):
            checks.raise_if_violated(self._errors.unpack(packed), step=step, op=op)
