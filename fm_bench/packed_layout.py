"""Would one buffer per slot give the spec relay one launch per op? A probe, before a redesign.

fm_jax keeps each relayed field in its own buffer ([R], [R, K], [R, H]); XLA emits one
scatter per buffer for a stash and one gather per buffer for a resolve, and merges none
across buffers (a variadic scatter needs operands of one shape). SGLang's Triton kernels
move every spec extra in one launch. This probe lays one slot's extras out as one row of
32-bit words, `[R, W]` with W = 1 + 2K + H/2 (bonus token, top-k probabilities and indices,
bf16 hidden states two to a word), and compares, side by side on one device:

- `fields`: fm_jax's spec `stash` and `resolve` (gather protocol: the draft gathered at the
  draft slots), each in its own donated jit, as the class compiles them;
- `packed`: the same values through the `[R, W]` buffer: a stash builds each row from the
  payload and scatters it (one scatter); a resolve gathers the rows and splits them back
  into the four fields;
- `packed_rows`: the rows as they are: a stash of rows already built (by the engine's own
  jit, where building them would fuse with the model's last ops) and a resolve returning
  the gathered rows unsplit (the model's first use of each field would be the split);
- `pallas` (GPU only): fm_jax's own buffers, a buffer per field, moved by one Pallas kernel
  per op, as SGLang's Triton kernels move its spec extras: the stash writes every field of
  a row in one program per row (the buffers donated and aliased), the resolve reads them.
  Elsewhere Pallas runs only in its interpreter, a correctness check and no timing.

For each: the kernels of the compiled HLO (`fm_bench.inplace.kernels`), host µs (one step in
flight) and waited µs, medians over rounds. Both layouts must resolve the same bytes (checked
before timing). Nothing here is fm_jax's API: it is the measurement that decides whether the
layout is worth the change (ops, sharding, debug checks and parity would all follow).

    python -m fm_bench.packed_layout [--batch 256] [--pool 16384] [--topk 8] [--hidden 4096]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import fm_jax as fj
from fm_bench.inplace import kernels
from fm_bench.report import write_result
from fm_bench.timing import Series, measure_group, wait_jax

D = fj.ForwardMode.DECODE


def _words(x: jax.Array) -> jax.Array:
    """[B, ...] values of a 4- or 2-byte dtype as [B, n] uint32 (2-byte values in pairs)."""
    b = x.shape[0]
    if x.dtype.itemsize == 2:
        x = x.reshape(b, -1, 2)
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(b, -1)


def _unwords(w: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of `_words` for one field's columns."""
    out = jax.lax.bitcast_convert_type(w, dtype)
    return out.reshape(w.shape[0], -1) if jnp.dtype(dtype).itemsize == 2 else out


class Packed:
    """The spec extras of a slot in one row of words: [bonus | topk_p | topk_index | hidden]."""

    def __init__(self, pool: int, topk: int, hidden: int) -> None:
        if hidden % 2:
            raise ValueError("hidden must be even (bf16 values two to a word)")
        self.cols = np.cumsum([0, 1, topk, topk, hidden // 2]).tolist()
        self.pool, self.width = pool, self.cols[-1]

    def init(self) -> jax.Array:
        return jnp.zeros((self.pool, self.width), jnp.uint32)

    def stash(self, buf: jax.Array, idx: jax.Array, d: Any) -> jax.Array:
        """`buf` with each slot's row built from the DraftPayload `d` (all four fields)."""
        bonus = jax.lax.bitcast_convert_type(d.bonus_tokens, jnp.uint32)[:, None]
        rows = jnp.concatenate(
            [bonus, _words(d.topk_p), _words(d.topk_index), _words(d.hidden_states)], axis=1
        )
        return buf.at[idx].set(rows, mode="drop")

    def split(self, rows: jax.Array, like: Any) -> fj.DraftPayload:
        """Gathered rows as a DraftPayload of `like`'s dtypes."""
        c = self.cols
        return fj.DraftPayload(
            jax.lax.bitcast_convert_type(rows[:, 0], like.bonus_tokens.dtype),
            _unwords(rows[:, c[1] : c[2]], like.topk_p.dtype),
            _unwords(rows[:, c[2] : c[3]], like.topk_index.dtype),
            _unwords(rows[:, c[3] : c[4]], like.hidden_states.dtype),
        )


SPEC_FIELDS = ("output_tokens", "topk_p", "topk_index", "hidden_states")
"""The state buffers a spec stash writes (the bonus tokens live in `output_tokens`)."""


def _bits(d: Any) -> list[jax.Array]:
    """A DraftPayload's four fields as the state stores them (hidden states as raw bits)."""
    hidden = d.hidden_states
    bits = jnp.dtype(f"uint{8 * hidden.dtype.itemsize}")
    return [d.bonus_tokens, d.topk_p, d.topk_index, jax.lax.bitcast_convert_type(hidden, bits)]


def _stash_rows(idx_ref: Any, *refs: Any) -> None:
    """One program per row b: every field's row b goes to its buffer's row idx[b]."""
    n = len(refs) // 3  # the payload, the buffers in (aliased to the outputs), the outputs
    b = pl.program_id(0)
    slot = idx_ref[b]
    for src, dst in zip(refs[:n], refs[2 * n :], strict=True):
        dst[pl.ds(slot, 1)] = src[pl.ds(b, 1)]


def _gather_rows(idx_ref: Any, *refs: Any) -> None:
    """One program per row b: every buffer's row idx[b] goes to its output's row b."""
    n = len(refs) // 2
    b = pl.program_id(0)
    slot = idx_ref[b]
    for src, dst in zip(refs[:n], refs[n:], strict=True):
        dst[pl.ds(b, 1)] = src[pl.ds(slot, 1)]


def pallas_stash(state: Any, idx: jax.Array, d: Any, *, interpret: bool) -> Any:
    """The spec stash of `d` at `idx` in one Pallas kernel (the state's buffers aliased)."""
    bufs = [getattr(state, f) for f in SPEC_FIELDS]
    n = len(bufs)
    out = pl.pallas_call(
        _stash_rows,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in bufs],
        grid=(idx.shape[0],),
        input_output_aliases={1 + n + i: i for i in range(n)},
        interpret=interpret,
    )(idx, *_bits(d), *bufs)
    return state._replace(**dict(zip(SPEC_FIELDS, out, strict=True)))


def pallas_resolve(state: Any, idx: jax.Array, like: Any, *, interpret: bool) -> Any:
    """The spec draft at `idx` in one Pallas kernel, as a DraftPayload of `like`'s dtypes."""
    bufs = [getattr(state, f) for f in SPEC_FIELDS]
    b = idx.shape[0]
    tok, p, i, h = pl.pallas_call(
        _gather_rows,
        out_shape=[jax.ShapeDtypeStruct((b, *x.shape[1:]), x.dtype) for x in bufs],
        grid=(b,),
        interpret=interpret,
    )(idx, *bufs)
    hidden = jax.lax.bitcast_convert_type(h, like.hidden_states.dtype)
    return fj.DraftPayload(tok, p, i, hidden)


def _payload(batch: int, topk: int, hidden: int, seed: int = 0) -> fj.DraftPayload:
    rng = np.random.default_rng(seed)
    return fj.DraftPayload(
        jnp.asarray(rng.integers(0, 32000, batch).astype(np.int32)),
        jnp.asarray(rng.random((batch, topk), np.float32)),
        jnp.asarray(rng.integers(0, 32000, (batch, topk)).astype(np.int32)),
        jnp.asarray(rng.standard_normal((batch, hidden)).astype(np.float32), jnp.bfloat16),
    )


def measure(batch: int, pool: int, topk: int, hidden: int, reps: int) -> dict[str, Any]:
    """Kernels, host and waited µs of stash and resolve in both layouts (module docstring)."""
    rng = np.random.default_rng(1)
    idx = jnp.asarray(rng.permutation(np.arange(1, pool, dtype=np.int32))[:batch])
    draft = _payload(batch, topk, hidden)
    options = fj.compiler_options(jax.devices()[0].platform)

    spec = fj.SpecConfig(topk, hidden, jnp.bfloat16)
    ops = fj.future_map(pool, spec=spec, protocol="gather")
    batch_in = fj.Batch(None, idx, idx, jnp.zeros(batch, jnp.int32), idx)

    def f_stash(state: fj.FutureMapState, idx: jax.Array, d: fj.DraftPayload) -> Any:
        return ops.stash(state, idx, d)

    def f_resolve(state: fj.FutureMapState, b: fj.Batch) -> Any:
        return ops.resolve(state, b._replace(forward_mode=D))[1].draft

    packed = Packed(pool, topk, hidden)

    def p_resolve(buf: jax.Array, idx: jax.Array) -> fj.DraftPayload:
        return packed.split(buf[idx], draft)

    jit = lambda f, donate: jax.jit(  # noqa: E731
        f, donate_argnums=(0,) if donate else (), compiler_options=options
    )
    fns: dict[str, tuple[Any, bool]] = {
        "fields stash": (jit(f_stash, True), True),
        "fields resolve": (jit(f_resolve, False), False),
        "packed stash": (jit(packed.stash, True), True),
        "packed resolve": (jit(p_resolve, False), False),
        "packed_rows stash": (jit(lambda buf, i, r: buf.at[i].set(r, mode="drop"), True), True),
        "packed_rows resolve": (jit(lambda buf, i: buf[i], False), False),
    }
    box: dict[str, Any] = {"fields": ops.stash(ops.init(), idx, draft)}
    pallas = "GPU only: not run here"
    if jax.devices()[0].platform == "gpu":
        p_stash = jit(lambda st, i, d: pallas_stash(st, i, d, interpret=False), True)
        p_read = jit(lambda st, i: pallas_resolve(st, i, draft, interpret=False), False)
        try:  # a kernel the GPU's Pallas cannot lower is reported, the rest still measured
            p_stash.lower(box["fields"], idx, draft).compile()
            p_read.lower(box["fields"], idx).compile()
        except Exception as e:  # noqa: BLE001
            pallas = f"failed to compile: {type(e).__name__}: {str(e)[:300]}"
        else:
            pallas = "measured"
            fns["pallas stash"] = (p_stash, True)
            fns["pallas resolve"] = (p_read, False)
    box["packed"] = packed.stash(packed.init(), idx, draft)
    rows = box["packed"][idx]
    args = {
        "fields stash": lambda: (box["fields"], idx, draft),
        "fields resolve": lambda: (box["fields"], batch_in),
        "packed stash": lambda: (box["packed"], idx, draft),
        "packed resolve": lambda: (box["packed"], idx),
        "packed_rows stash": lambda: (box["packed"], idx, rows),
        "packed_rows resolve": lambda: (box["packed"], idx),
        "pallas stash": lambda: (box["fields"], idx, draft),
        "pallas resolve": lambda: (box["fields"], idx),
    }
    # Every way resolves the same bytes.
    want = jax.tree.leaves(fns["fields resolve"][0](*args["fields resolve"]()))
    for other in [
        n for n in fns if n.endswith(" resolve") and n.split()[0] in ("packed", "pallas")
    ]:
        got = jax.tree.leaves(fns[other][0](*args[other]()))
        if len(want) != len(got):
            raise AssertionError(f"{other} resolved {len(got)} fields, not {len(want)}")
        same = [
            np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(want, got, strict=True)
        ]
        if not all(same):
            raise AssertionError(f"{other} resolved other bytes than a buffer per field: {same}")
    if "pallas stash" in fns:  # and the Pallas stash leaves the buffers the ops' stash leaves
        fresh = lambda: jax.tree.map(jnp.copy, box["fields"])  # noqa: E731
        a = jax.tree.leaves(fns["fields stash"][0](fresh(), idx, draft))
        b = jax.tree.leaves(fns["pallas stash"][0](fresh(), idx, draft))
        if [np.asarray(x).tobytes() for x in a] != [np.asarray(x).tobytes() for x in b]:
            raise AssertionError("the Pallas stash left other bytes than the ops' stash")

    count = {
        name: kernels(fn.lower(*args[name]()).compile().as_text() or "")
        for name, (fn, _) in fns.items()
    }

    def runner(name: str) -> Callable[[], object]:
        fn, donated = fns[name]
        layout = {"packed": "packed", "packed_rows": "packed"}.get(name.split()[0], "fields")

        def run() -> object:
            out = fn(*args[name]())
            if donated:
                box[layout] = out
            return wait_jax(out)

        return run

    stats = measure_group(
        [Series(name, runner(name)) for name in fns], reps=reps, warmup=10, pipe_steps=50
    )
    dev = jax.devices()[0]
    return {
        "device": f"{dev.platform} ({dev.device_kind})",
        "jax": jax.__version__,
        "batch": batch,
        "pool": pool,
        "topk": topk,
        "hidden": hidden,
        "width_words": packed.width,
        "pallas": pallas,
        "rows": [
            {
                "op": name,
                "kernels": count[name],
                "host_us": stats[name].host_us,
                "median_us": stats[name].median_us,
            }
            for name in fns
        ],
    }


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "# Spec extras: one buffer per field vs one row of words per slot",
        "",
        f"Device: {res['device']}, jax {res['jax']}; B = {res['batch']}, R = {res['pool']}, "
        f"K = {res['topk']}, H = {res['hidden']} bf16 (W = {res['width_words']} words). "
        "See fm_bench/packed_layout.py.",
        "",
        f"Pallas: {res['pallas']}.",
        "",
        "| op | kernels | host µs | waited µs |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['op']} | {r['kernels']} | {r['host_us']:.1f} | {r['median_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fm_bench.packed_layout", description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pool", type=int, default=16384)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", type=Path, default=None, help="write packed_layout_<tag>.{md,json}")
    p.add_argument("--tag", default=None, help="file tag (default: the device platform)")
    a = p.parse_args(argv)
    res = measure(a.batch, a.pool, a.topk, a.hidden, a.reps)
    md = markdown(res)
    print(md)
    if a.out is not None:
        write_result(a.out, "packed_layout", md, res, a.tag)


if __name__ == "__main__":
    main()
