"""The JAX side of a parity run: one fm_jax.FutureMap, on one device or a DP x TP mesh.

One device is the one-rank layout; on a mesh the map holds one pool per DP rank and this
process drives the ranks whose devices it holds (`fm.local_ranks`). Every op feeds the map
a mapping DP rank -> host rows, padded by the map to the sizes the ranks agreed on; the
map's buckets are the scenario's, so a lone rank is padded no further. Each rank's
outputs are its own block of the map's global arrays (a one-device array on one of the
rank's devices), on which the JAX toy model runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax
from fm_parity import exchange, payloads, transfers
from fm_parity import toy_model as tm
from fm_parity import toy_model_jax as model
from fm_parity.host_batch import HostBatch
from fm_parity.mesh import MeshHealth, make_mesh
from fm_parity.scenario import Scenario
from fm_parity.twin import ForwardOut, ResolvedOut, Sizes, check_protocol, run_forward


def jax_device(device: str) -> jax.Device:
    """The JAX device for 'cpu' or 'cuda'; RuntimeError naming what is missing."""
    if device == "cpu":
        return jax.devices("cpu")[0]
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as e:
        raise RuntimeError(f"--device cuda: JAX sees no GPU ({e})") from e


class JaxTwin:
    """fm_jax.FutureMap behind the driver's twin interface (see fm_parity.twin.Twin).

    Args:
      scenario: the scenario every rank runs a seed of (pool size, spec, buckets).
      dtype: 'int32' or 'int64' (needs JAX's x64 mode).
      debug: the map's debug mode.
      device: 'cpu' or 'cuda'.
      dp, tp: the mesh; 1 x 1 is one device. The mesh takes the first dp*tp devices of
        the platform, every process's (`fm_parity.mesh.make_mesh`).
      protocol: the map's relay protocol, 'sentinel' or 'gather' (fm_parity.twin.PROTOCOLS).
      spec_kernel: how a spec map moves its fields, `SpecConfig.kernel` ('xla' or 'pallas').

    The 'sync' check (gather protocol): every resolve, publish and stash call on the map
    runs inside fm_parity.transfers.no_device_to_host, which records a device-to-host
    transfer rather than stopping the run (`transfers()` hands them to the driver). Only
    the map's call is watched: the twin's own reads of outputs for the trace are not. A
    publish with confidence rows may start its ring's host copy (`copy_to_host_async`, by
    contract); any other transfer in it is recorded.
    """

    name = "jax"
    errors: tuple[type[Exception], ...] = (
        fm_jax.InvariantViolation,
        fm_jax.FutureMapError,
        transfers.DeviceToHostTransfer,
    )

    def __init__(
        self,
        scenario: Scenario,
        dtype: str,
        debug: bool,
        device: str,
        *,
        dp: int = 1,
        tp: int = 1,
        protocol: str = "sentinel",
        spec_kernel: str = "xla",
    ) -> None:
        if dtype == "int64" and not jax.config.read("jax_enable_x64"):
            raise RuntimeError("the int64 pass needs JAX_ENABLE_X64=1 (run it in its own process)")
        self.dtype = np.dtype(dtype)
        self.protocol = check_protocol(protocol)
        self.on_host = device == "cpu"
        sp = scenario.spec
        self.spec = None if sp is None else payloads.layout(sp)
        self.verified = sp is not None and sp.verified_id
        cfg = (
            None
            if sp is None or self.spec is None
            else _spec_config(self.spec, sp.verified_id, spec_kernel, sp.confidence)
        )
        on_mesh = dp * tp > 1
        first = jax_device(device)
        mesh = make_mesh(dp, tp, jax.devices(first.platform)) if on_mesh else None
        self.fm = fm_jax.FutureMap(
            scenario.pool_size,
            mesh=mesh,
            tp_axis="tp" if on_mesh else None,
            dtype=self.dtype,
            spec=cfg,
            debug=debug,
            batch_buckets=scenario.batch_buckets,
            token_buckets=sorted(set(scenario.token_buckets) | set(scenario.batch_buckets)),
            device=None if on_mesh else first,
            protocol=self.protocol,
        )
        layout = self.fm.layout
        self.ranks: tuple[int, ...] = self.fm.local_ranks
        self._device: dict[int, jax.Device] = {}
        for d in layout.mesh.local_devices:
            self._device.setdefault(layout.rank_of(d), d)
        self.health = MeshHealth() if on_mesh else None
        self._transfers: list[str] = []

    # ---------------------------------------------------------------------------- helpers
    def error_kind(self, exc: BaseException) -> str:
        """'debug' for an invariant violation, 'sync' for a transfer the detector could
        not let through (see fm_parity.transfers), 'checks' for rejected input."""
        if isinstance(exc, transfers.DeviceToHostTransfer):
            return "sync"
        return "debug" if isinstance(exc, fm_jax.InvariantViolation) else "checks"

    def transfers(self) -> list[str]:
        """The device-to-host transfers seen inside map ops since the last call, one line
        per op call that made any ('resolve: device-to-host transfer (...)'); the 'sync'
        check fails on any."""
        out, self._transfers = self._transfers, []
        return out

    def _watched(
        self, op: str, fn: Callable[..., Any], allowed: tuple[str, ...] = ()
    ) -> Callable[..., Any]:
        """Gather protocol: `fn` (a map op) run inside the device-to-host detector, its
        transfers recorded but those through an entry point in `allowed` (a publish with
        confidence rows starts the ring's asynchronous copy by contract: 'The confidence
        relay'); sentinel protocol: `fn`."""
        if self.protocol != "gather":
            return fn

        def record(text: str) -> None:
            if not any(f"({a})" in text for a in allowed):
                seen.append(text)

        seen: list[str] = []

        def run(*args: Any, **kw: Any) -> Any:
            seen.clear()
            try:
                with transfers.no_device_to_host(record):
                    return fn(*args, **kw)
            finally:
                if seen:
                    more = f" (+{len(seen) - 1} more)" if len(seen) > 1 else ""
                    self._transfers.append(f"{op}: {seen[0]}{more}")

        return run

    def snap(self, x: Any, n: int | None = None) -> Any:
        """A copy of `x` (first `n` rows) that outlives the next donated op."""
        if self.on_host:
            a = np.array(x)
            return a if n is None else a[:n]
        return exchange.to_torch(jnp.array(x if n is None else x[:n], copy=True))

    def host(self, x: Any) -> np.ndarray:
        """`x` on the host."""
        return np.asarray(jax.device_get(x))

    def _block(self, x: Any, rank: int) -> Any:
        """Rank `rank`'s block of a global array: a one-device array on one of its devices."""
        if x is None:
            return None
        dev = self._device[rank]
        return next(sh.data for sh in x.addressable_shards if sh.device == dev)

    def _rows(self, x: Any, rank: int, n: int) -> Any:
        """The first `n` rows of rank `rank`'s block of `x` (no slice when they are all)."""
        b = self._block(x, rank)
        return b if b.shape[0] == n else b[:n]

    def _call(self, key: Hashable | None, sizes: Sizes, fn: Any, *args: Any, **kw: Any) -> Any:
        """`fn(*args, **kw)`, watched by the mesh health check on a mesh."""
        if self.health is None:
            return fn(*args, **kw)
        with self.health.call(self.fm, key, *self._sizes(sizes)):
            return fn(*args, **kw)

    def _sizes(self, sizes: Sizes) -> tuple[int, int]:
        """The per-rank (rows, tokens) to pad to: the agreed sizes, or the smallest buckets
        when no rank has any."""
        return sizes.rows or self.fm.batch_buckets[0], sizes.tokens or self.fm.token_buckets[0]

    def buffers(self, extras: Mapping[int, Collection[str]]) -> dict[int, dict[str, Any]]:
        """Each rank's buffer snapshots, slots 1..R-1 (slot 0 is padding garbage): the
        spec buffers of the fields in `extras[rank]` only."""
        st = self.fm.state
        out: dict[int, dict[str, Any]] = {}
        for rank, spec in extras.items():
            bufs = {"output_tokens": st.output_tokens, "new_seq_lens": st.new_seq_lens}
            # fm_jax keeps a real-float field as its raw bits (uint16 for bf16): each is viewed
            # as its declared dtype, bit for bit, to compare with fm_torch's.
            views: dict[str, Any] = {}
            if spec and self.fm.spec is not None:
                for f in self.fm.spec.fields():
                    if f.name not in spec:
                        continue  # output_tokens holds bonus tokens; the rest once stashed
                    bufs[f.name] = (
                        getattr(st, f.name)
                        if f.name in payloads.STANDARD
                        else (st.extras or {})[f.name]
                    )
                    if f.dtype is not None and bufs[f.name].dtype != f.dtype:
                        views[f.name] = f.dtype
            blocks = {k: self._block(v, rank) for k, v in bufs.items()}
            for k, dtype in views.items():
                blocks[k] = jax.lax.bitcast_convert_type(blocks[k], dtype)
            out[rank] = {k: self.snap(v)[1:] for k, v in blocks.items()}
        return out

    def check(self) -> None:
        """Raise the pending debug violations (a host sync; the driver calls it once per
        step, and each violation names its op and, on a mesh, its rank)."""
        self.fm.check()

    def mesh_report(self) -> dict[str, Any] | None:
        """On a mesh, what its calls showed (fm_parity.mesh.MeshHealth.report); else None."""
        return None if self.health is None else self.health.report(self.fm)

    # -------------------------------------------------------------------------------- ops
    def resolve_seq_lens_cpu(
        self, slots: Mapping[int, np.ndarray], sizes: Sizes
    ) -> dict[int, np.ndarray]:
        rows, _ = self._sizes(sizes)
        key = ("resolve_seq_lens_cpu", rows)
        got = self._call(key, sizes, self.fm.resolve_seq_lens_cpu, dict(slots), rows=rows)
        assert isinstance(got, dict)
        return got

    def resolve(self, batches: Mapping[int, HostBatch], sizes: Sizes) -> dict[int, ResolvedOut]:
        rows, tokens = self._sizes(sizes)
        spec_decode = any(hb.spec_decode for hb in batches.values())
        bs = {
            r: fm_jax.Batch(
                int(hb.mode),
                hb.slots,
                None if self._gathers_ids(hb) else hb.input_ids,
                hb.seq_lens,
                # A rank without a draft input reads its padding slot 0 (garbage by contract).
                (hb.slots if hb.spec_decode else np.zeros_like(hb.slots)) if spec_decode else None,
                self._token_slots(hb),
            )
            for r, hb in batches.items()
        }
        # The executable the map picks: DECODE fixed, another kind fixed, or the kinds traced
        # when busy ranks differ (idle ranks do not count); with or without token slots.
        kinds = frozenset(
            hb.mode == fm_jax.ForwardMode.DECODE
            for hb in batches.values()
            if hb.mode != fm_jax.ForwardMode.IDLE
        )
        mixed = any(b.token_slots is not None for b in bs.values())
        key = ("resolve", rows, tokens, kinds, spec_decode, mixed)
        resolve = self._watched("resolve", self.fm.resolve)
        out = self._call(key, sizes, resolve, bs, rows=rows, tokens=tokens)
        tails = self._mixed_tails(batches, bs)
        res = {}
        for r, hb in batches.items():
            n, t = len(hb.slots), len(hb.input_ids)
            draft = None
            if out.draft is not None and hb.spec_decode:
                draft = payloads.convert(out.draft, functools.partial(self._rows, rank=r, n=n))
            ids, lens = self._rows(out.input_ids, r, t), self._rows(out.seq_lens, r, n)
            res[r] = ResolvedOut(ids, lens, draft, None, tails.get(r))
        return res

    def _mixed_tails(
        self, batches: Mapping[int, HostBatch], bs: Mapping[int, fm_jax.Batch]
    ) -> dict[int, Any]:
        """Spec MIXED ranks (gather protocol): their host fields with the running rows
        rebound (`FutureMap.resolve_mixed_tails_cpu`, a host read like
        resolve_seq_lens_cpu: not watched by the 'sync' check)."""
        mixed = [r for r, hb in batches.items() if hb.mode == fm_jax.ForwardMode.MIXED]
        if self.spec is None or self.protocol != "gather" or not mixed:
            return {}
        got = self.fm.resolve_mixed_tails_cpu(
            {r: bs[r] for r in mixed}, prefix_lens={r: batches[r].prefix_lens for r in mixed}
        )
        assert isinstance(got, dict)
        return {r: (t.seq_lens_cpu, t.seq_lens_sum, t.prefix_lens) for r, t in got.items()}

    def _gathers_ids(self, hb: HostBatch) -> bool:
        """Gather protocol: a non-spec DECODE batch brings no ids (resolve gathers them at
        its req_pool_indices; the map takes None)."""
        return (
            self.protocol == "gather" and self.spec is None and hb.mode == fm_jax.ForwardMode.DECODE
        )

    def _token_slots(self, hb: HostBatch) -> np.ndarray | None:
        """Gather protocol, MIXED: the running rows' slots at their token positions, 0 at
        prefill and padding positions (`HostBatch.mixed_token_slots`); else None (a rank
        the map fills with zeros when another rank brings some: it gathers nothing)."""
        if self.protocol == "gather" and hb.mode == fm_jax.ForwardMode.MIXED:
            return hb.mixed_token_slots
        return None

    def forward(self, rank: int, res: ResolvedOut, hb: HostBatch, offset: int) -> ForwardOut:
        dev = self._device[rank]
        slots, last = jax.device_put(hb.slots, dev), jax.device_put(hb.last_index, dev)
        return run_forward(
            model, fm_jax.DraftPayload, res, hb, slots, last, self.spec, offset, self.verified
        )

    def publish(
        self,
        slots: Mapping[int, np.ndarray],
        lens: Mapping[int, Any],
        sizes: Sizes,
        confidence: Mapping[int, np.ndarray] | None = None,
        generation: Mapping[int, np.ndarray] | None = None,
    ) -> None:
        rows, _ = self._sizes(sizes)
        host = {r: self.host(v) for r, v in lens.items()}
        publish = self._watched("publish", self.fm.publish)
        if confidence:  # one call for the ranks with confidence rows, one for the others
            ring_copy = ("jax.Array.copy_to_host_async",)
            watched = self._watched("publish", self.fm.publish, ring_copy)
            with_conf = {r: slots[r] for r in confidence}
            self._call(
                ("publish_confidence", rows),
                sizes,
                watched,
                with_conf,
                {r: host[r] for r in confidence},
                rows=rows,
                confidence=dict(confidence),
                generation=dict(generation or {}),
            )
            slots = {r: s for r, s in slots.items() if r not in confidence}
            if not slots:
                return
        key = ("publish", rows) if any(len(s) for s in slots.values()) else None
        self._call(key, sizes, publish, dict(slots), {r: host[r] for r in slots}, rows=rows)

    def resolve_confidence_cpu(
        self, slots: Mapping[int, np.ndarray]
    ) -> dict[int, tuple[np.ndarray, np.ndarray] | None]:
        got = self.fm.resolve_confidence_cpu(dict(slots), wait=True)
        assert isinstance(got, dict)
        return {r: None if g is None else (g.confidence, g.generation) for r, g in got.items()}

    def stash(
        self, slots: Mapping[int, np.ndarray], payload: Mapping[int, Any], sizes: Sizes
    ) -> None:
        rows, _ = self._sizes(sizes)
        host: dict[int, Any] = {}
        for r, p in payload.items():
            if isinstance(p, fm_jax.DraftPayload):
                host[r] = payloads.convert(p, self.host)
            else:
                host[r] = self.host(p)
        # One stash writes the same fields on every rank it feeds: ranks whose drafts carry
        # different fields (partial stashes) take one call each set, idle ranks none.
        groups: dict[Any, list[int]] = {}
        for r, p in host.items():
            if len(slots[r]) or all(not len(s) for s in slots.values()):
                carried = tuple(payloads.fields(p)) if isinstance(p, fm_jax.DraftPayload) else ()
                groups.setdefault(carried, []).append(r)
        for carried, ranks in groups.items():
            busy = any(len(slots[r]) for r in ranks)
            key = ("stash", rows, carried) if busy else None
            self._call(
                key,
                sizes,
                self._watched("stash", self.fm.stash),
                {r: slots[r] for r in ranks},
                {r: host[r] for r in ranks},
                rows=rows,
            )

    def draft_payload(self, bonus: np.ndarray, draft: tm.Draft) -> Any:
        """A host draft (toy_model.Draft of numpy rows) as the map's DraftPayload."""
        assert self.spec is not None
        return payloads.to_payload(fm_jax.DraftPayload, draft._replace(bonus=bonus), self.spec)

    def invalidate(
        self,
        batches: Mapping[int, HostBatch],
        res: Mapping[int, ResolvedOut],
        sizes: Sizes,
    ) -> dict[int, tuple[Any, Any]]:
        rows, _ = self._sizes(sizes)
        # invalidate reads only the indices; the batch's other fields pass through.
        none = np.zeros(0, self.dtype)
        batch = fm_jax.Batch(None, none, none, none)
        slots = {r: hb.slots for r, hb in batches.items()}
        out = self._call(("invalidate", rows), sizes, self.fm.invalidate, batch, slots, rows=rows)
        return {r: (self._block(out.input_ids, r), self._block(out.seq_lens, r)) for r in batches}


def _spec_config(
    spec: tm.Layout, verified_id: bool, kernel: str, confidence: int = 0
) -> fm_jax.SpecConfig:
    """fm_jax's declaration of a scenario's draft fields (fm_parity.payloads): the standard
    ones as the layout relays them, then the engine's own (float32, or the map's ints),
    moved by `kernel`; and the width of its confidence rows (0: none)."""
    extra = tuple(
        fm_jax.RelayField(
            e.name, (e.width,) if e.width else (), np.dtype(np.float32) if e.kind == "f32" else None
        )
        for e in spec.extras
    )
    return fm_jax.SpecConfig(
        spec.topk if spec.relays_standard else 0,
        spec.hidden,
        jnp.bfloat16,
        verified_id=verified_id,
        extra=extra,
        bonus_tokens=spec.relays_standard,
        kernel=kernel,
        confidence=confidence,
    )
