"""What a FutureMap's caller passes (a host array, a jax array, a mapping DP rank -> host
rows: docs/guide.md's table), decided once per layout from its form, shape and dtype: its
`Rows`, sizes and the placer that checks (`validate`) and pads each value of the layout."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from fm_jax.host.buckets import bucket_for, decode_ids, pad_rows
from fm_jax.host.decisions import Placer, Rows
from fm_jax.host.validate import INTS, HostChecks, StepInput, row_kind
from fm_jax.ops import errors
from fm_jax.ops import relay_fields as rf
from fm_jax.ops.errors import FutureMapError
from fm_jax.ops.protocol import Protocol
from fm_jax.ops.relay_fields import payload_rows, storable
from fm_jax.ops.sharding import MeshLayout
from fm_jax.ops.types import RelayField, SpecConfig


class HostInputs:
    """Input decisions for one map: its layout, pool size, int dtype and buckets."""

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

    def placer(
        self, name: str, kind: str, size: int, into: np.dtype | None, x: Any, cast: Any = None
    ) -> Callable[[Any], Any]:
        """The placer of host values shaped like `x`: each rank's rows cast to `cast` where
        no value can change, checked as `kind` (`HostChecks.check`) and padded to `size`."""
        check = self.checks.check
        ranked = (lambda d: f"{name}[rank {d}]") if self.dp > 1 else (lambda d: name)

        empty = self._zeros if into is None else np.zeros(0, into)

        def by_rank(parts: dict[int, np.ndarray]) -> Any:
            done = {d: check(kind, ranked(d), p, into) for d, p in parts.items()}
            return self._pad(done, size, next(iter(done.values()), empty)[:0])

        if isinstance(x, Mapping):  # not memoized: the parts decided are this call's
            parts = self._rank_parts(name, x, cast)
            return lambda _: by_rank(parts)
        if self.dp > 1:
            return lambda v: by_rank(self._split(name, _host(name, v, cast)))
        a = _host(name, x, cast)
        checker = self.checks.checker(kind, name, a.dtype, into)
        n, tail = a.shape[0], a.shape[1:]

        def pad(v: np.ndarray) -> np.ndarray:  # inline: a steady call visits no other module
            out = np.zeros((size, *tail), v.dtype)
            out[:n] = v
            return out

        if type(x) is not np.ndarray or (cast is not None and a.dtype != x.dtype):
            checker = checker or (lambda v: v)
            inner = checker if n == size else lambda v: pad(checker(v))
            return lambda v: inner(_host(name, v, cast))
        if checker is not None and n != size:
            return lambda v: pad(checker(v))
        return checker if n == size else pad  # type: ignore[return-value]

    def _rank_parts(self, name: str, x: Mapping[Any, Any], cast: Any = None) -> dict[int, Any]:
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
            out[int(rank)] = _host(name, a, cast)
        return out

    def _jax(self, name: str, x: jax.Array, buckets: tuple[int, ...], size: int | None) -> Rows:
        """A jax array of global rows, taken as it is: its shape and dtype are checked."""
        shape = x.shape
        if len(shape) != 1 or x.dtype not in INTS:
            raise FutureMapError(f"{name} must be a 1-D integer array, got {shape} {x.dtype}")
        self._held(name, x.dtype, None)
        per = shape[0] // self.dp
        if per * self.dp != shape[0] or per not in buckets or (size is not None and per != size):
            want = "any bucket" if size is None else f"{size}"
            raise FutureMapError(
                f"{name} has {shape[0]} entries, not a bucket size {buckets} ({want} for each "
                f"of {self.dp} DP rank(s)): pad it (fm_jax.pad_to_bucket) or pass a host array"
            )
        return Rows(None, per, None, False)

    def _held(self, name: str, dtype: np.dtype, into: np.dtype | None) -> None:
        """Refuses a device array's int `dtype` unless every value fits the buffer's dtype
        `into` (default the map's): a device array's values are not read on the host."""
        if not (dtype in self._safe if into is None else np.can_cast(dtype, into, "safe")):
            raise FutureMapError(
                f"{name} has dtype {dtype}, which the map's {into or self.dtype} buffers cannot "
                "hold without a value check: cast it on the device or pass a host array"
            )

    def _pad(self, parts: dict[int, np.ndarray], size: int, like: np.ndarray) -> Any:
        if self.dp == 1:
            return pad_rows(parts.get(0, like[:0]), size)
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

    def _parts(self, name: str, x: Any) -> tuple[dict[int, np.ndarray], bool]:
        """A host input's per-rank parts, and whether it came as a mapping of ranks."""
        if isinstance(x, Mapping):
            return self._rank_parts(name, x), True
        return self._split(name, _host(name, x)), False

    def flat(
        self, name: str, x: Any, size: int | None, *, slots: bool, per_token: bool = False
    ) -> Rows:
        """A 1-D int input: slot indices or token ids (checked as `validate` says), padded
        to a batch bucket, or (ids, `per_token` slots) a token bucket."""
        buckets = self.batch_buckets if slots and not per_token else self.token_buckets
        if isinstance(x, jax.Array) and x.size:
            return self._jax(name, x, buckets, size)
        parts, by_rank = self._parts(name, x)
        for rank, a in parts.items():
            if a.ndim != 1:
                where = f"{name}[rank {rank}]" if self.dp > 1 else name
                raise FutureMapError(f"{where} must be 1-D, got shape {a.shape}")
        counts = tuple(parts[d].shape[0] if d in parts else 0 for d in range(self.dp))
        rows = self._size(max(counts), buckets, size, "rows" if slots else "tokens")
        place = self.placer(name, "slots" if slots else "ids", rows, None, x)
        return Rows(None, rows, counts, by_rank, place)

    def token_slots(self, name: str, x: Any, ids: Rows) -> Rows:
        """Per-token slots, checked as slots, placed like the token ids `ids`."""
        if ids.counts is not None and not isinstance(x, jax.Array):
            parts, _ = self._parts(name, x)
            counts = tuple(
                (parts[d].shape[0] if parts[d].ndim else -1) if d in parts else 0
                for d in range(self.dp)
            )
            if counts != ids.counts:
                raise FutureMapError(
                    f"{name} has {counts} entries per rank, input_ids {ids.counts}: one slot "
                    "per token position (0 where the id is the host's)"
                )
        return self.flat(name, x, ids.size, slots=True, per_token=True)

    def matched(
        self,
        name: str,
        x: Any,
        like: Rows,
        dtype: np.dtype | None = None,
        *,
        relayed: bool = False,
        per: str = "row",
        cast: Any = None,
    ) -> Placer:
        """The placer of a per-row (`per='token'`: per-token) input laid out like `like`,
        in the same form; `dtype` the field's declared one (None: the map's int dtype),
        `relayed` values >= 0, host rows first cast to `cast` where no value can change."""
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
                return None  # its dtype is judged when traced (the pure ops' check)
            if x.dtype.kind not in "iu":
                raise FutureMapError(f"{name} must have an integer dtype, got {x.dtype}")
            self._held(name, x.dtype, into)
            return None
        if like.counts is None:  # rows of jax-array slots: already padded, not read
            a = _host(name, x, cast)
            if a.ndim < 1 or a.shape[0] != self.dp * like.size:
                raise count(name, a.shape[:1], self.dp * like.size)
            check = self.checks.check
            return lambda v: check(kind, name, _host(name, v, cast), into)
        if isinstance(x, Mapping) != like.by_rank:
            form = "a mapping DP rank -> rows" if like.by_rank else "global rows"
            raise FutureMapError(f"{name} must be given like the indices: {form}")
        parts = (
            self._rank_parts(name, x, cast) if like.by_rank else self._split(name, _host(name, x))
        )
        tail = None
        for d, n in enumerate(like.counts):
            where = f"{name}[rank {d}]" if self.dp > 1 else name
            if d not in parts:
                if n:
                    have = f"input_ids have {n} tokens" if per == "token" else f"indices have {n}"
                    raise FutureMapError(f"{name} has no rows for DP rank {d}, {have}")
                continue
            a = _host(where, parts[d], cast) if not like.by_rank else parts[d]
            if a.ndim < 1 or a.shape[0] != n:
                raise count(where, a.shape[:1], n)
            if ints and a.dtype.kind not in "iu":
                raise FutureMapError(f"{where} must have an integer dtype, got {a.dtype}")
            if tail is not None and (a.shape[1:], a.dtype) != tail:
                raise FutureMapError(f"{name}: ranks disagree on row shape or dtype")
            tail = (a.shape[1:], a.dtype)
        if not parts and not ints:  # no rank given (all idle)
            raise FutureMapError(f"{name} is given for no rank")
        return self.placer(name, kind, like.size, into, x, cast)

    def step_input(self, d: StepInput, x: Any, like: Rows) -> Placer:
        """The placer of an engine's declared input `x` laid out like `like` (a jax array
        taken as it is, host rows cast to its dtype where no value can change)."""
        name = f"inputs[{d.name!r}]"
        if isinstance(x, jax.Array):
            if x.dtype != d.dtype or x.shape[1:] != d.shape:
                raise FutureMapError(
                    f"{name} is {x.dtype}{list(x.shape)}, declared {d.dtype} rows of "
                    f"shape {list(d.shape)}"
                )
        elif not isinstance(x, Mapping):
            _rows_of(name, x, d.shape)
        else:
            for r, v in x.items():
                _rows_of(f"{name}[rank {r}]", v, d.shape)
        return self.matched(name, x, like, d.dtype, per=d.per, cast=d.dtype)

    def payload(
        self, payload: Any, idx: Rows, spec: SpecConfig | None, fields: tuple[RelayField, ...]
    ) -> tuple[tuple[Any, ...], list[Placer]]:
        """Stash's payload laid out like `idx`: its leaves (tokens, or each declared field's
        rows, None where no rank gives it) and their placers."""
        drafts = list(payload.values()) if isinstance(payload, Mapping) else [payload]
        if not drafts and spec is not None:
            raise errors.tokens_on_spec_map(per_rank=True)
        for p in drafts:  # each rank's payload: its kind and declared fields, as the ops judge
            payload_rows(spec, p)
        if spec is None:
            return (payload,), [self.matched("tokens", payload, idx, relayed=True)]
        for p in drafts:  # the fields each rank's draft writes
            rf.carried(fields, p)
        leaves, placers = [], []
        for f in fields:
            name = f"draft.{f.name}"
            if isinstance(payload, Mapping):
                value: Any = {r: rf.get(p, f.name) for r, p in payload.items()}
                if any(v is None for v in value.values()):
                    if not all(v is None for v in value.values()):
                        raise FutureMapError(f"{name} given on some ranks only")
                    value = None
            else:
                value = rf.get(payload, f.name)
            leaves.append(value)
            placers.append(
                None
                if value is None
                else self.matched(name, value, idx, f.dtype, relayed=f.consumed)
            )
        return tuple(leaves), placers

    def sentinels(self, indices: Any, idx: Rows) -> Any:
        """The sentinels of host slots given as a mapping DP rank -> slots, made on the
        host: global arrays padded per rank, the ids to the token bucket of the rows."""
        parts = {int(r): -np.asarray(v, self.dtype) for r, v in indices.items()}

        def padded(size: int) -> Any:
            out = self.layout.global_array(parts, size, self._zeros)
            return jax.device_put(out, self.layout.sharding) if type(out) is np.ndarray else out

        lens, ids = padded(idx.size), decode_ids(idx.size, self.token_buckets)
        return lens if ids == idx.size else (padded(ids), lens)

    def unpad(self, host: np.ndarray, like: Rows) -> Any:
        """Host rows laid out like `like`, padding removed, in the form `like` was given
        (fresh arrays of the caller's own)."""
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


def _host(name: str, x: Any, cast: Any = None) -> np.ndarray:
    """`x` as a host array of a dtype a buffer stores, cast to `cast` where no value can
    change."""
    if isinstance(x, np.ndarray):
        a = x
    else:
        try:
            a = np.asarray(x)
        except (TypeError, ValueError) as bad:
            raise FutureMapError(f"{name} is not an array: {bad}") from None
    if not storable(a.dtype):
        raise FutureMapError(f"{name} is not a numeric array ({a.dtype} dtype)")
    if cast is not None and a.dtype != cast and np.can_cast(a.dtype, cast, "safe"):
        a = a.astype(cast)
    return a


def _rows_of(name: str, x: Any, shape: tuple[int, ...]) -> None:
    """Refuses host input `x` unless it holds rows of trailing shape `shape`."""
    a = _host(name, x)
    if a.ndim < 1:
        raise FutureMapError(
            f"{name} is a scalar (shape []): it takes an array of rows, each of shape {list(shape)}"
        )
    if a.shape[1:] != shape:
        raise FutureMapError(
            f"{name} has rows of shape {list(a.shape[1:])}, declared rows of shape {list(shape)}"
        )
