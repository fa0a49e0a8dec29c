"""One launch per spec op: fm_jax's Pallas kernel beside a row of words per slot.

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
- `pallas` (GPU only): fm_jax's spec stash and resolve with `SpecConfig(kernel='pallas')`:
  a buffer per field, all moved by one Pallas (Triton) kernel per op, as SGLang's Triton
  kernels move its spec extras. Elsewhere Pallas runs in its interpreter: its bytes are
  checked, its time is not taken.

For each: the kernels of the compiled HLO (`fm_bench.inplace.kernels`), host µs (one step in
flight) and waited µs, medians over rounds. Every way must resolve the same bytes, and the
Pallas stash leave the same buffers (checked before timing). The packed layouts are not
fm_jax's API: they show what one row per slot would give beside fm_jax's two kernels.

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

    batch_in = fj.Batch(None, idx, idx, jnp.zeros(batch, jnp.int32), idx)
    gpu = jax.devices()[0].platform == "gpu"

    def field_ops(kernel: str) -> tuple[Any, Any, fj.FutureMapOps]:
        """fm_jax's spec stash and resolve (gather protocol) with `kernel`."""
        spec = fj.SpecConfig(topk, hidden, jnp.bfloat16, kernel=kernel)
        ops = fj.future_map(pool, spec=spec, protocol="gather")

        def f_stash(state: fj.FutureMapState, idx: jax.Array, d: fj.DraftPayload) -> Any:
            return ops.stash(state, idx, d)

        def f_resolve(state: fj.FutureMapState, b: fj.Batch) -> Any:
            return ops.resolve(state, b._replace(forward_mode=D))[1].draft

        return f_stash, f_resolve, ops

    packed = Packed(pool, topk, hidden)

    def p_resolve(buf: jax.Array, idx: jax.Array) -> fj.DraftPayload:
        return packed.split(buf[idx], draft)

    jit = lambda f, donate: jax.jit(  # noqa: E731
        f, donate_argnums=(0,) if donate else (), compiler_options=options
    )
    x_stash, x_resolve, ops = field_ops("xla")
    p_stash, p_resolve_fields, _ = field_ops("pallas")
    fns: dict[str, tuple[Any, bool]] = {
        "fields stash": (jit(x_stash, True), True),
        "fields resolve": (jit(x_resolve, False), False),
        "pallas stash": (jit(p_stash, True), True),
        "pallas resolve": (jit(p_resolve_fields, False), False),
        "packed stash": (jit(packed.stash, True), True),
        "packed resolve": (jit(p_resolve, False), False),
        "packed_rows stash": (jit(lambda buf, i, r: buf.at[i].set(r, mode="drop"), True), True),
        "packed_rows resolve": (jit(lambda buf, i: buf[i], False), False),
    }
    box: dict[str, Any] = {"fields": ops.stash(ops.init(), idx, draft)}
    pallas = "measured" if gpu else "interpreted here (no GPU): bytes checked, not timed"
    if gpu:
        try:  # a kernel the GPU cannot compile is reported, the other ways still measured
            fns["pallas stash"][0].lower(box["fields"], idx, draft).compile()
            fns["pallas resolve"][0].lower(box["fields"], batch_in).compile()
        except Exception as e:  # noqa: BLE001
            pallas = f"failed to compile: {type(e).__name__}: {str(e)[:300]}"
            del fns["pallas stash"], fns["pallas resolve"]
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
        "pallas resolve": lambda: (box["fields"], batch_in),
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
    # And the Pallas stash leaves the buffers the per-buffer stash leaves.
    if "pallas stash" in fns:
        fresh = lambda: jax.tree.map(jnp.copy, box["fields"])  # noqa: E731
        a = jax.tree.leaves(fns["fields stash"][0](fresh(), idx, draft))
        b = jax.tree.leaves(fns["pallas stash"][0](fresh(), idx, draft))
        if [np.asarray(x).tobytes() for x in a] != [np.asarray(x).tobytes() for x in b]:
            raise AssertionError("the Pallas stash left other bytes than the per-buffer stash")
    if not gpu:  # interpreted: its kernels and times say nothing of a GPU's
        del fns["pallas stash"], fns["pallas resolve"]

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
