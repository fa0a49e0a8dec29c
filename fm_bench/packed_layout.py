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
  the gathered rows unsplit (the model's first use of each field would be the split).

For each: the kernels of the compiled HLO (`fm_bench.inplace.kernels`), host µs (one step in
flight) and waited µs, medians over rounds. Both layouts must resolve the same bytes (checked
before timing). Nothing here is fm_jax's API: it is the measurement that decides whether the
layout is worth the change (ops, sharding, debug checks and parity would all follow).

    python -m fm_bench.packed_layout [--batch 256] [--pool 16384] [--topk 8] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fm_jax as fj
from fm_bench.inplace import kernels
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
    box["packed"] = packed.stash(packed.init(), idx, draft)
    rows = box["packed"][idx]
    args = {
        "fields stash": lambda: (box["fields"], idx, draft),
        "fields resolve": lambda: (box["fields"], batch_in),
        "packed stash": lambda: (box["packed"], idx, draft),
        "packed resolve": lambda: (box["packed"], idx),
        "packed_rows stash": lambda: (box["packed"], idx, rows),
        "packed_rows resolve": lambda: (box["packed"], idx),
    }
    # Both layouts resolve the same bytes.
    want = jax.tree.leaves(fns["fields resolve"][0](*args["fields resolve"]()))
    got = jax.tree.leaves(fns["packed resolve"][0](*args["packed resolve"]()))
    if len(want) != len(got):
        raise AssertionError(f"the packed layout resolved {len(got)} fields, not {len(want)}")
    same = [
        np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(want, got, strict=True)
    ]
    if not all(same):
        raise AssertionError(f"the packed layout resolved other bytes: {same}")

    count = {
        name: kernels(fn.lower(*args[name]()).compile().as_text() or "")
        for name, (fn, _) in fns.items()
    }

    def runner(name: str) -> Callable[[], object]:
        fn, donated = fns[name]
        layout = name.split()[0].split("_")[0]

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
        tag = a.tag or jax.devices()[0].platform
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"packed_layout_{tag}.md").write_text(md)
        (a.out / f"packed_layout_{tag}.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
