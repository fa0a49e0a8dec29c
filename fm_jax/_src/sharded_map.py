"""`ShardedFutureMap`: the FutureMap on a mesh, fed per-rank host batches, updated in place.

The class form of `sharded_future_map` for engines that call ops one by one. Each process
passes the rows of the DP ranks it owns (`local_ranks`), as its schedulers hold them: a
mapping rank -> host array with rank-local slots. A local rank left out is idle: its part
of the global batch is all padding (slot 0, token 0) and its mode IDLE. Every rank's rows
are padded to one per-rank bucket, so a rank going idle changes no shape and compiles
nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from fm_jax._src import buckets as bk
from fm_jax._src.compile_options import compiler_options
from fm_jax._src.entry_points import jit_entry_points
from fm_jax._src.errors import FutureMapError, InvariantViolation
from fm_jax._src.held_state import HeldState
from fm_jax._src.host_checks import check_host_slots
from fm_jax._src.sharding import MeshLayout, per_rank, sharded_future_map
from fm_jax._src.types import Batch, DraftPayload, ForwardMode, FutureMapState, Resolved, SpecConfig

RankArrays = Mapping[int, Any]
"""Host arrays by DP rank (rank-local slots); a local rank left out is idle."""

_MAPPED = re.compile(r"^at mapped index (\d+): (.*)$", re.S)


class ShardedFutureMap(HeldState):
    """A FutureMap with one pool of `pool_size` slots per DP rank of `mesh`, donated in place.

    Layout: see `fm_jax.sharded_future_map` (global [DP*R] buffers sharded over `dp_axis`,
    replicated over `tp_axis`). Host inputs are per-rank mappings; outputs are global,
    DP-sharded arrays padded per rank (use `per_rank` to split them on the host).

    In a multi-process run every process must pad to the same per-rank sizes: pass
    `rows=` / `tokens=` (e.g. from the engine's DP batch-size sync). Without them, a
    multi-process map refuses to guess.

    Args:
      pool_size: R, slots per DP rank; slot 0 of each rank is its padding row.
      mesh: the device mesh.
      dp_axis: the data-parallel axis name, or None (one pool replicated everywhere).
      tp_axis: the tensor-parallel axis name, or None.
      dtype: int32 (default) or int64 (needs JAX's x64 mode).
      spec: the spec extras' static shapes, or None.
      debug: consume tracking and invariant checks; errors stay on device until `check()`.
      batch_buckets: allowed per-rank batch sizes; default powers of two up to 1024.
      token_buckets: allowed per-rank token counts; default powers of two up to 8192.
    """

    def __init__(
        self,
        pool_size: int,
        mesh: jax.sharding.Mesh,
        *,
        dp_axis: str | None = "dp",
        tp_axis: str | None = None,
        dtype: Any = jnp.int32,
        spec: SpecConfig | None = None,
        debug: bool = False,
        batch_buckets: Sequence[int] | None = None,
        token_buckets: Sequence[int] | None = None,
    ) -> None:
        self.ops = sharded_future_map(
            pool_size, mesh, dp_axis=dp_axis, tp_axis=tp_axis, dtype=dtype, spec=spec, debug=debug
        )
        self.layout: MeshLayout = self.ops.layout
        self.pool_size = pool_size
        self.dtype = self.ops.local.dtype
        self.spec = self.ops.local.spec
        self.debug = debug
        self.batch_buckets = bk.normalize_buckets(batch_buckets or bk.power_of_two_buckets(1024))
        self.token_buckets = bk.normalize_buckets(token_buckets or bk.power_of_two_buckets(8192))
        self.local_ranks = self.layout.local_ranks()
        self.step = 0
        self._pending: list[tuple[int, str, checkify.Error]] = []
        sharding = self.layout.sharding
        ops = self.ops

        platform = mesh.devices.flat[0].platform
        options = compiler_options(platform)
        self._init = jax.jit(ops.init, out_shardings=sharding, compiler_options=options)
        self._publish, self._stash, self._resolve, _, self._finish = jit_entry_points(
            ops, debug=debug, platform=platform
        )
        self._invalidate = jax.jit(ops.invalidate, compiler_options=options)
        self._state: FutureMapState = self._init()

    # ------------------------------------------------------------------------------ state
    @property
    def state(self) -> FutureMapState:
        """The global buffers. Donated on the next op: do not keep references across ops."""
        return self._state

    def buffers(self) -> dict[str, dict[int, np.ndarray]]:
        """Host copies of each local rank's pool, by buffer name then DP rank (a sync)."""
        return {
            name: per_rank(buf, self.layout)
            for name, buf in self._state._asdict().items()
            if buf is not None
        }

    def compiled_ops(self) -> dict[str, Any]:
        """The jitted entry points by op name (for compile counting and HLO inspection)."""
        return {
            "publish": self._publish,
            "stash": self._stash,
            "resolve": self._resolve,
            "invalidate": self._invalidate,
        }

    # ------------------------------------------------------------------------- input prep
    def _by_rank(self, name: str, x: RankArrays) -> dict[int, np.ndarray]:
        if not isinstance(x, Mapping):
            raise FutureMapError(
                f"{name} must map DP rank -> host array for this process's ranks "
                f"{self.local_ranks}, got {type(x).__name__}"
            )
        out = {}
        for rank, a in x.items():
            if rank not in self.local_ranks:
                raise FutureMapError(
                    f"{name} has rows for DP rank {rank}, which is not one of this process's "
                    f"ranks {self.local_ranks}"
                )
            out[int(rank)] = np.asarray(a)
        return out

    def _ints(self, name: str, a: np.ndarray, rank: int) -> np.ndarray:
        if a.ndim < 1 or not np.issubdtype(a.dtype, np.integer):
            raise FutureMapError(f"{name}[rank {rank}] must be an integer array, got {a.dtype}")
        info = np.iinfo(self.dtype)
        if a.size and (a.min() < info.min or a.max() > info.max):
            raise FutureMapError(f"{name}[rank {rank}] holds values that do not fit {self.dtype}")
        return a.astype(self.dtype)

    def _check_slots(self, name: str, slots: dict[int, np.ndarray]) -> None:
        for rank, a in slots.items():
            if a.ndim != 1:
                raise FutureMapError(f"{name}[rank {rank}] must be 1-D, got shape {a.shape}")
            check_host_slots(f"{name}[rank {rank}]", a, self.pool_size, where="the rank's")

    def _size(self, given: int | None, n: int, buckets: tuple[int, ...], what: str) -> int:
        """The per-rank padded size: `given`, or the bucket of the largest local rank."""
        if given is not None:
            if given < n:
                raise FutureMapError(f"{what}={given} is smaller than a rank's {n} entries")
            return given
        if jax.process_count() > 1:
            raise FutureMapError(
                f"a multi-process ShardedFutureMap needs an explicit {what}= (the per-rank "
                "size all processes agreed on), or processes would compile different shapes"
            )
        return bk.bucket_for(max(n, 1), buckets, what)

    def to_global(
        self, parts: Mapping[int, Any], size: int, tail: tuple[int, ...] = (), dtype: Any = None
    ) -> jax.Array:
        """A global [DP*size, *tail] array, sharded like the state, from local ranks' rows.

        Args:
          parts: rank -> host rows (at most `size`) for ranks of this process; local ranks
            left out get zeros (padding: slot 0, token 0).
          size: per-rank padded row count; tail: trailing shape; dtype: default the map's.

        Returns:
          The global array; each process supplies only its own ranks' blocks.
        """
        dt = np.dtype(dtype if dtype is not None else self.dtype)
        sharding = self.layout.sharding
        shape = (self.layout.dp * size, *tail)
        blocks = {}
        for rank in self.local_ranks:
            a = parts.get(rank)
            block = np.zeros((size, *tail), dtype=dt)
            if a is not None and np.shape(a)[0]:
                block[: np.shape(a)[0]] = a
            blocks[rank] = block
        arrays = [
            jax.device_put(blocks[self.layout.rank_of(d)], d) for d in sharding.addressable_devices
        ]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    def _payload(
        self, name: str, x: RankArrays, slots: dict[int, np.ndarray], rows: int, *, ints: bool
    ) -> jax.Array:
        parts = self._by_rank(name, x)
        if set(parts) != set(slots):
            raise FutureMapError(f"{name} covers ranks {sorted(parts)}, indices {sorted(slots)}")
        tail: tuple[int, ...] | None = None
        dt: Any = None
        for rank, a in parts.items():
            if a.ndim < 1 or a.shape[0] != slots[rank].shape[0]:
                raise FutureMapError(
                    f"{name}[rank {rank}] has {a.shape[:1]} rows, indices have "
                    f"{slots[rank].shape[0]}"
                )
            if ints:
                parts[rank] = a = self._ints(name, a, rank)
            if tail is not None and (a.shape[1:] != tail or a.dtype != dt):
                raise FutureMapError(f"{name}: ranks disagree on row shape or dtype")
            tail, dt = a.shape[1:], a.dtype
        if tail is None:
            raise FutureMapError(f"{name} is empty on every rank")
        return self.to_global(parts, rows, tail, dt)

    def _slot_input(
        self, name: str, x: RankArrays, rows: int | None
    ) -> tuple[dict[int, np.ndarray], int, jax.Array]:
        slots = {r: self._ints(name, a, r) for r, a in self._by_rank(name, x).items()}
        self._check_slots(name, slots)
        n = max((a.shape[0] for a in slots.values()), default=0)
        size = self._size(rows, n, self.batch_buckets, "rows")
        return slots, size, self.to_global(slots, size, (), self.dtype)

    # -------------------------------------------------------------------------------- ops
    def publish(
        self, indices: RankArrays, new_seq_lens: RankArrays, *, rows: int | None = None
    ) -> None:
        """`new_seq_lens[indices] := new_seq_lens` on each listed rank's pool, in place.

        Args:
          indices: rank -> rank-local slots; ranks left out (or empty) write nothing.
          new_seq_lens: rank -> lengths, one per slot.
          rows: per-rank padded batch size (required in multi-process runs).
        """
        slots, size, idx = self._slot_input("indices", indices, rows)
        lens = (
            self._payload("new_seq_lens", new_seq_lens, slots, size, ints=True) if slots else None
        )
        if lens is None:
            lens = self.to_global({}, size, (), self.dtype)
        self._apply("publish", self._publish, idx, lens)

    def stash(self, indices: RankArrays, payload: RankArrays, *, rows: int | None = None) -> None:
        """Write tokens (non-spec) or `DraftPayload`s (spec) at each rank's slots, in place.

        Args:
          indices: rank -> rank-local slots; ranks left out write nothing.
          payload: rank -> tokens [n] or DraftPayload of host arrays with n rows.
          rows: per-rank padded batch size (required in multi-process runs).
        """
        slots, size, idx = self._slot_input("indices", indices, rows)
        parts = self._by_rank("payload", payload) if self.spec is None else dict(payload)
        if self.spec is None:
            if any(isinstance(p, DraftPayload) for p in payload.values()):
                raise FutureMapError("stash got a DraftPayload but the map was built without spec")
            out: Any = self._payload("tokens", parts, slots, size, ints=True) if slots else None
            if out is None:
                out = self.to_global({}, size, (), self.dtype)
        else:
            if not all(isinstance(p, DraftPayload) for p in parts.values()):
                raise FutureMapError("stash on a spec map takes a DraftPayload per rank")
            if set(parts) != set(slots):
                raise FutureMapError(
                    f"payload covers ranks {sorted(parts)}, indices {sorted(slots)}"
                )
            spec = self.spec
            k, h = spec.topk, spec.hidden

            def field(attr: str, tail: tuple[int, ...], dt: Any, ints: bool) -> jax.Array:
                got = {r: getattr(p, attr) for r, p in parts.items()}
                if got:
                    return self._payload(f"draft.{attr}", got, slots, size, ints=ints)
                return self.to_global({}, size, tail, dt)

            out = DraftPayload(
                bonus_tokens=field("bonus_tokens", (), self.dtype, True),
                topk_p=field("topk_p", (k,), np.float32, False),
                topk_index=field("topk_index", (k,), self.dtype, True),
                hidden_states=field("hidden_states", (h,), spec.hidden_dtype, False)
                if h > 0
                else None,
            )
        self._apply("stash", self._stash, idx, out)

    def resolve(
        self,
        batches: Mapping[int, Batch],
        *,
        rows: int | None = None,
        tokens: int | None = None,
    ) -> Resolved:
        """Fill each rank's placeholders from its own pool; starts a new step.

        Args:
          batches: rank -> Batch of host arrays (rank-local slots and sentinels, a Python
            or numpy forward mode); local ranks left out are idle.
          rows: per-rank padded batch size; tokens: per-rank padded token count (both
            required in multi-process runs).

        Returns:
          Resolved of global [DP*rows] / [DP*tokens] arrays, sharded like the state.
        """
        self.step += 1
        if not isinstance(batches, Mapping):
            raise FutureMapError("batches must map DP rank -> Batch")
        for r in batches:
            if r not in self.local_ranks:
                raise FutureMapError(
                    f"batches has DP rank {r}, not one of this process's ranks {self.local_ranks}"
                )
        slots, size, idx = self._slot_input(
            "req_pool_indices", {r: b.req_pool_indices for r, b in batches.items()}, rows
        )
        ids = {r: self._ints("input_ids", np.asarray(b.input_ids), r) for r, b in batches.items()}
        for r, a in ids.items():
            if a.ndim != 1:
                raise FutureMapError(f"input_ids[rank {r}] must be 1-D, got shape {a.shape}")
            if a.size and a.min() <= -self.pool_size:
                raise FutureMapError(
                    f"input_ids[rank {r}] holds sentinels {a[a <= -self.pool_size].tolist()} "
                    f"naming slots outside [0, {self.pool_size})"
                )
        t = max((a.shape[0] for a in ids.values()), default=0)
        tsize = self._size(tokens, t, self.token_buckets, "tokens")
        g_ids = self.to_global(ids, tsize, (), self.dtype)
        g_lens = (
            self._payload(
                "seq_lens", {r: b.seq_lens for r, b in batches.items()}, slots, size, ints=True
            )
            if batches
            else self.to_global({}, size, (), self.dtype)
        )
        modes = {r: np.array([int(b.forward_mode)], np.int32) for r, b in batches.items()}
        for r in self.local_ranks:
            modes.setdefault(r, np.array([int(ForwardMode.IDLE)], np.int32))
        g_mode = self.to_global(modes, 1, (), np.int32)
        g_draft = None
        if any(b.draft_indices is not None for b in batches.values()):
            d = {r: b.draft_indices for r, b in batches.items() if b.draft_indices is not None}
            dslots, _, g_draft = self._slot_input("draft_indices", d, size)
        batch = Batch(g_mode, idx, g_ids, g_lens, g_draft)
        if self.debug:
            err, (self._state, out) = self._resolve(self._state, batch)
            self._record("resolve", err)
            return out  # type: ignore[no-any-return]
        return self._resolve(self._state, batch)  # type: ignore[no-any-return]

    def invalidate(self, batch: Batch, indices: jax.Array) -> Batch:
        """Sentinels for the next step on global arrays: ids and lengths := -indices."""
        return self._invalidate(batch, indices)  # type: ignore[no-any-return]

    def resolve_seq_lens_cpu(self, indices: RankArrays) -> dict[int, np.ndarray]:
        """Host copies of `new_seq_lens[indices]` per listed rank (a sync; raises pending errors).

        Args:
          indices: rank -> rank-local slots.

        Returns:
          rank -> lengths, one per slot.
        """
        slots = {
            r: self._ints("indices", a, r) for r, a in self._by_rank("indices", indices).items()
        }
        self._check_slots("indices", slots)
        lens = per_rank(self._state.new_seq_lens, self.layout)
        self.check()
        return {r: lens[r][a] for r, a in slots.items()}

    # ------------------------------------------------------------------------------ debug
    def check(self) -> None:
        """Raise InvariantViolation for the first failed debug check since the last call.

        A host sync. The message names the DP rank, the step (resolves so far) and the op.
        """
        pending, self._pending = self._pending, []
        for step, op, err in pending:
            msg = err.get()
            if msg is None:
                continue
            m = _MAPPED.match(msg.splitlines()[0])
            rank = None
            if m:
                device = self.layout.mesh.devices.flat[int(m.group(1))]
                rank, msg = self.layout.rank_of(device), m.group(2)
            inv = re.match(r"^\[([^\]]+)\]", msg)
            where = f"DP rank {rank}, " if rank is not None else ""
            raise InvariantViolation(
                f"FutureMap invariant violated at {where}step {step}, {op}: {msg}",
                invariant=inv.group(1) if inv else "",
                step=step,
                op=op,
            )
