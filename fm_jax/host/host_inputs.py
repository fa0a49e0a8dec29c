"""What a FutureMap's caller passes, turned into what its executables take.

Three forms, judged by the same rules on one device and on a mesh (one device is the
one-rank layout):
- a host array (numpy, a list): global rows, each DP rank's rows end to end, the same
  number per rank (one device: any number). Checked by value here, each rank's part padded
  with zero rows (slot 0, token 0) to a bucket, and handed to the executable as a host
  array: the jit transfers it while dispatching.
- a jax array: global rows as the executable takes them, each rank's part already a
  bucket size; not read here (no sync), taken as it is.
- a mapping DP rank -> host array (rank-local slots): the ranks of this process; a local
  rank left out is idle (all padding). Every rank is padded to one size.

Host value checks (slot range, duplicate live slots, int fit, sentinel range, no negative
token or length relayed, one input id per row of a non-spec DECODE batch) raise
`FutureMapError` naming the field before anything reaches the device. A jax array is not
read: in debug mode the op checks it on the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from fm_jax.host.buckets import bucket_for
from fm_jax.host.validate import INTS, HostChecks, row_kind
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import Protocol
from fm_jax.ops.relay_fields import storable
from fm_jax.ops.sharding import MeshLayout


class Rows(NamedTuple):
    """One placed input, and the row layout that inputs matched to it must follow.

    Attributes:
      array: what the executable takes (a host array, or the caller's jax array).
      size: rows per DP rank after padding (a bucket size).
      counts: real rows per DP rank, all ranks in order; None for a jax array (not read).
      by_rank: given as a mapping DP rank -> rows.
    """

    array: Any
    size: int
    counts: tuple[int, ...] | None
    by_rank: bool

    @property
    def empty(self) -> bool:
        """No real row on any rank (an idle call)."""
        return self.counts is not None and not any(self.counts)

    def has_rows(self, rank: int) -> bool:
        """Whether DP rank `rank` has real rows (a jax array's are not read: taken as yes)."""
        return self.counts is None or bool(self.counts[rank])


class HostInputs:
    """Input preparation for one map: its layout, pool size, int dtype and buckets."""

    def __init__(
        self,
        layout: MeshLayout,
        pool_size: int,
        dtype: np.dtype,
        batch_buckets: tuple[int, ...],
        token_buckets: tuple[int, ...],
        protocol: Protocol,
    ) -> None:
        self.layout = layout
        self.protocol = protocol
        self.dp = layout.dp
        self.local_ranks = frozenset(layout.local_ranks())
        self.single_process = layout.single_process
        self.pool_size = pool_size
        self.dtype = dtype
        self.batch_buckets = batch_buckets
        self.token_buckets = token_buckets
        self.checks = HostChecks(pool_size, dtype, protocol)
        self._safe = self.checks.safe
        self._zeros = np.zeros(0, dtype)

    # ----------------------------------------------------------------- value checks
    def host_rows(
        self, name: str, a: np.ndarray, size: int, kind: str, into: np.dtype | None = None
    ) -> np.ndarray:
        """Global host rows (each DP rank's rows end to end, as many per rank) checked as
        `kind` (`HostChecks.check`, rows of dtype `into`) and padded per rank to `size`
        rows: what a recorded plan does."""
        if self.dp == 1:
            a = self.checks.check(kind, name, a, into)
            if a.shape[0] == size:
                return a
            out = np.zeros((size, *a.shape[1:]), a.dtype)
            out[: a.shape[0]] = a
            return out
        parts = {
            d: self.checks.check(kind, f"{name}[rank {d}]", p, into)
            for d, p in self._split(name, a).items()
        }
        first = parts[0]
        return self._pad(parts, size, first[:0])

    # ----------------------------------------------------------------- forms
    def _rank_parts(self, name: str, x: Mapping[Any, Any]) -> dict[int, np.ndarray]:
        """A per-rank mapping's host arrays by rank, keys checked."""
        out = {}
        for rank, a in x.items():
            if isinstance(rank, bool) or not isinstance(rank, int | np.integer):
                raise FutureMapError(f"{name} is keyed by DP rank (an int), got {rank!r}")
            if int(rank) not in self.local_ranks:
                raise FutureMapError(
                    f"{name} has rows for DP rank {rank}, which is not one of this process's "
                    f"ranks {sorted(self.local_ranks)}"
                )
            out[int(rank)] = _host(name, a)
        return out

    def _jax(self, name: str, x: jax.Array, buckets: tuple[int, ...], size: int | None) -> Rows:
        """A jax array of global rows, taken as it is: its shape and dtype are checked."""
        shape = x.shape
        if len(shape) != 1 or x.dtype not in INTS:
            raise FutureMapError(f"{name} must be a 1-D integer array, got {shape} {x.dtype}")
        if x.dtype not in self._safe:
            raise FutureMapError(
                f"{name} has dtype {x.dtype}, which the map's {self.dtype} buffers cannot hold "
                "without a value check: cast it on the device or pass a host array"
            )
        per = shape[0] // self.dp
        if per * self.dp != shape[0] or per not in buckets or (size is not None and per != size):
            want = "any bucket" if size is None else f"{size}"
            raise FutureMapError(
                f"{name} has {shape[0]} entries, not a bucket size {buckets} ({want} for each "
                f"of {self.dp} DP rank(s)): pad it (fm_jax.pad_to_bucket) or pass a host array"
            )
        return Rows(x, per, None, False)

    def _pad(self, parts: dict[int, np.ndarray], size: int, like: np.ndarray) -> Any:
        if self.dp == 1:
            a = parts.get(0, like[:0])
            if a.shape[0] == size:
                return a
            out = np.zeros((size, *like.shape[1:]), like.dtype)
            out[: a.shape[0]] = a
            return out
        return self.layout.global_array(parts, size, like)

    def _size(self, n: int, buckets: tuple[int, ...], given: int | None, what: str) -> int:
        """The per-rank padded size: `given` (a bucket), or the bucket of the largest rank."""
        if given is None and n in buckets and self.single_process:
            return n
        if given is None:
            if not self.single_process:
                raise FutureMapError(
                    f"a multi-process FutureMap needs an explicit {what}= (the per-rank size "
                    "all processes agreed on), or processes would compile different shapes"
                )
            return bucket_for(max(n, 1), buckets, what)
        if given not in buckets:
            raise FutureMapError(f"{what}={given} is not one of the buckets {buckets}")
        if given < n:
            raise FutureMapError(f"{what}={given} is smaller than a rank's {n} entries")
        return given

    def _split(self, name: str, a: np.ndarray) -> dict[int, np.ndarray]:
        """Global host rows as DP equal per-rank parts."""
        if self.dp == 1:
            return {0: a}
        if a.ndim == 0:
            raise FutureMapError(f"{name} must hold rows, got a scalar {a!r}")
        per = a.shape[0] // self.dp
        if per * self.dp != a.shape[0]:
            raise FutureMapError(
                f"{name} has {a.shape[0]} rows, which do not split into {self.dp} equal "
                "per-rank parts (or pass a mapping DP rank -> rows)"
            )
        return {d: a[d * per : (d + 1) * per] for d in range(self.dp)}

    def _flat(
        self,
        name: str,
        x: Any,
        buckets: tuple[int, ...],
        size: int | None,
        *,
        slots: bool,
    ) -> Rows:
        """A 1-D int input (slots or token ids) placed for the executable."""
        if isinstance(x, jax.Array) and x.size:
            return self._jax(name, x, buckets, size)
        by_rank = isinstance(x, Mapping)
        parts = self._rank_parts(name, x) if by_rank else self._split(name, _host(name, x))
        for rank, a in parts.items():
            where = f"{name}[rank {rank}]" if self.dp > 1 else name
            if a.ndim != 1:
                raise FutureMapError(f"{where} must be 1-D, got shape {a.shape}")
            parts[rank] = self.checks.check("slots" if slots else "ids", where, a)
        counts = tuple(parts[d].shape[0] if d in parts else 0 for d in range(self.dp))
        rows = self._size(max(counts), buckets, size, "rows" if slots else "tokens")
        return Rows(self._pad(parts, rows, self._zeros), rows, counts, by_rank)

    # ----------------------------------------------------------------- public
    def slots(self, name: str, x: Any, size: int | None = None) -> Rows:
        """Slot indices (rank-local), checked: in [0, R), no live slot twice per rank."""
        return self._flat(name, x, self.batch_buckets, size, slots=True)

    def token_ids(self, name: str, x: Any, size: int | None = None) -> Rows:
        """Flat token ids (sentinels for decode rows), checked: sentinels name a slot
        (the gather protocol: no id is negative)."""
        return self._flat(name, x, self.token_buckets, size, slots=False)

    def token_slots(self, name: str, x: Any, ids: Rows) -> Rows:
        """Per-token slots placed like the token ids `ids` (the same entries per rank),
        checked as slots: in [0, R), no live slot twice per rank."""
        if ids.counts is not None and not isinstance(x, jax.Array):
            parts = (
                self._rank_parts(name, x)
                if isinstance(x, Mapping)
                else self._split(name, _host(name, x))
            )
            counts = tuple(
                (parts[d].shape[0] if parts[d].ndim else -1) if d in parts else 0
                for d in range(self.dp)
            )
            if counts != ids.counts:
                raise FutureMapError(
                    f"{name} has {counts} entries per rank, input_ids {ids.counts}: one slot "
                    "per token position (0 where the id is the host's)"
                )
        return self._flat(name, x, self.token_buckets, ids.size, slots=True)

    def matched(
        self,
        name: str,
        x: Any,
        like: Rows,
        dtype: np.dtype | None = None,
        *,
        relayed: bool = False,
        per: str = "row",
    ) -> Any:
        """A per-row input ([rows, ...]) laid out like `like`: the same rows per rank.

        Args:
          name: the field, named in errors.
          x: the rows, in the same form as `like` (a mapping if `like` was one).
          like: the slots these rows belong to, or (`per='token'`) the token ids.
          dtype: the field's declared dtype; None: the map's int dtype. Int rows are cast
            to an int dtype where their values fit; a field of another dtype takes only its
            own (`HostChecks.check`).
          relayed: tokens or lengths a forward relays: host values must be >= 0.
          per: 'row' or 'token': what one row of `x` stands for, named in errors.
        """
        ints = dtype is None or np.dtype(dtype).kind in "iu"
        into = None if dtype is None else np.dtype(dtype)
        kind = row_kind(into, relayed)

        def count(where: str, got: Any, n: int) -> FutureMapError:
            if per == "token":
                return FutureMapError(
                    f"{where} has {got} rows, input_ids have ({n},) tokens: it takes one row "
                    "per token"
                )
            return FutureMapError(f"{where} has {got} rows, indices have ({n},)")

        if isinstance(x, jax.Array) and x.size:
            want = self.dp * like.size
            if not x.shape or x.shape[0] != want:
                raise count(name, x.shape[:1], want)
            if not ints:
                return x  # its dtype is judged when traced (the pure ops' check)
            if x.dtype.kind not in "iu":
                raise FutureMapError(f"{name} must have an integer dtype, got {x.dtype}")
            if not (x.dtype in self._safe if into is None else np.can_cast(x.dtype, into, "safe")):
                raise FutureMapError(
                    f"{name} has dtype {x.dtype}, which the map's {into or self.dtype} buffers "
                    "cannot hold without a value check: cast it on the device or pass a host "
                    "array"
                )
            return x
        if like.counts is None:  # rows of jax-array slots: already padded, not read
            a = _host(name, x)
            if a.ndim < 1 or a.shape[0] != self.dp * like.size:
                raise count(name, a.shape[:1], self.dp * like.size)
            return self.checks.check(kind, name, a, into)
        if isinstance(x, Mapping) != like.by_rank:
            form = "a mapping DP rank -> rows" if like.by_rank else "global rows"
            raise FutureMapError(f"{name} must be given like the indices: {form}")
        parts = self._rank_parts(name, x) if like.by_rank else self._split(name, _host(name, x))
        tail = None
        for d, n in enumerate(like.counts):
            where = f"{name}[rank {d}]" if self.dp > 1 else name
            if d not in parts:
                if n:
                    have = f"input_ids have {n} tokens" if per == "token" else f"indices have {n}"
                    raise FutureMapError(f"{name} has no rows for DP rank {d}, {have}")
                continue
            a = parts[d]
            if a.ndim < 1 or a.shape[0] != n:
                raise count(where, a.shape[:1], n)
            a = parts[d] = self.checks.check(kind, where, a, into)
            if tail is not None and (a.shape[1:], a.dtype) != tail:
                raise FutureMapError(f"{name}: ranks disagree on row shape or dtype")
            tail = (a.shape[1:], a.dtype)
        first = next(iter(parts.values()), None)
        if first is None:  # no rank given (all idle): int rows are all padding
            if not ints:
                raise FutureMapError(f"{name} is given for no rank")
            first = self._zeros if into is None else np.zeros(0, into)
        return self._pad(parts, like.size, first[:0])

    def declared(self, name: str, x: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An engine's declared host input with its trailing shape checked, cast to its
        dtype where no value can change (numpy's 'safe' casting); `matched` then judges its
        dtype (ints of another int dtype cast where their values fit)."""
        a = _host(name, x)
        if a.ndim < 1:
            raise FutureMapError(
                f"{name} is a scalar (shape []): it takes an array of rows, each of shape "
                f"{list(shape)}"
            )
        if a.shape[1:] != shape:
            raise FutureMapError(
                f"{name} has rows of shape {list(a.shape[1:])}, declared rows of shape "
                f"{list(shape)}"
            )
        if a.dtype != dtype and np.can_cast(a.dtype, dtype, "safe"):
            a = a.astype(dtype)
        return a

    def unpad(self, host: np.ndarray, like: Rows) -> Any:
        """Host rows laid out like `like`, padding removed, in the form `like` was given:
        arrays of the caller's own (fresh and writable whatever `host` is, so an update in
        place changes nothing the map keeps and works on every path)."""
        if like.counts is None:
            return np.array(host)
        size = like.size
        blocks = {
            d: np.array(host[d * size : d * size + n])
            for d, n in enumerate(like.counts)
            if d in self.local_ranks
        }
        if like.by_rank:
            return blocks
        if self.dp == 1:
            return blocks[0]
        return np.concatenate([blocks[d] for d in range(self.dp)])


def on_device(x: Any) -> bool:
    """Whether `x` (an input as the caller gave it: rows, a DraftPayload, a mapping or a
    tuple of them) holds a jax array: not read on the host, so a debug map checks it on the
    device."""
    if type(x) is np.ndarray:  # the per-step case, kept short
        return False
    if isinstance(x, jax.Array):
        return True
    if isinstance(x, Mapping):
        x = list(x.values())
    return isinstance(x, tuple | list) and any(on_device(v) for v in x)


def _host(name: str, x: Any) -> np.ndarray:
    """`x` as a host array of numbers (a dtype a buffer stores: `relay_fields.storable`);
    a refused object names the field."""
    if isinstance(x, np.ndarray):
        a = x
    else:
        try:
            a = np.asarray(x)
        except (TypeError, ValueError) as bad:
            raise FutureMapError(f"{name} is not an array: {bad}") from None
    if not storable(a.dtype):
        raise FutureMapError(f"{name} is not a numeric array ({a.dtype} dtype)")
    return a
