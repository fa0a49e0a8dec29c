"""In-place check from the compiled HLO: does an op copy or convert a whole buffer?

For each fm_jax op (jitted with the state donated, as the class does) and for the fused
engine step, count the instructions of the optimised module that produce an array with the
pool's leading dimension R other than the in-place writes themselves (copies, converts,
bitcast-converts). Zero means the op moves batch-sized data only. Each op is compiled with
`fm_jax.compiler_options()`, as the class compiles it; the last column counts instructions
that XLA:CPU would still split over threads (0: the op runs on the calling thread), and
`kernels` the instructions of the entry computation that run work (fusions, scatters,
gathers, copies, custom calls, conditionals; not parameters, tuples, bitcasts or
constants): on a GPU, about the kernels the op launches. Each op runs under the
configuration's relay protocol (the gather protocol has no invalidate; its batch carries the
host's ids and lengths instead of sentinels). A spec map is checked with either spec kernel
(`SpecConfig.kernel`): 'xla', a scatter or gather per buffer; 'pallas', one kernel for all
its fields (a Triton custom call on a GPU; on CPU Pallas's interpreter, a loop whose count
says nothing of a GPU's).

    python -m fm_bench.inplace [--out DIR] [--tag TAG] [--hlo DIR]   # both protocols
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import jax
from jax.experimental import checkify

import fm_jax as fj
from fm_bench.impls.fm_jax_fused import _model
from fm_bench.impls.jax_common import device_data, int_dtype
from fm_bench.report import write_result
from fm_bench.workload import Config, host_data

_WHOLE = re.compile(r"=\s*\w+\[(\d+)(?:,\d+)*\]\{[^}]*\}\s+(copy|convert|bitcast-convert|fusion)\(")
_KIND = re.compile(r"calls=%(\w+)")
_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.-]+\s*=\s*.*?\s([a-z][\w-]*)\(")
_FREE = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all"})
THREAD_SPLIT = "outer_dimension_partitions"
"""Marks an instruction XLA:CPU hands to its thread pool, in compiled HLO text."""


def whole_buffer_ops(hlo: str, pool: int) -> list[str]:
    """Names of instructions in `hlo` (entry computation) that rewrite a whole [R, ...] buffer
    other than by an in-place scatter."""
    entry = hlo[hlo.index("ENTRY") :]
    out = []
    for line in entry.splitlines():
        m = _WHOLE.search(line)
        if not m or int(m.group(1)) != pool:
            continue
        if m.group(2) == "fusion":
            k = _KIND.search(line)
            if k is None or "scatter" in k.group(1):
                continue  # an in-place scatter: touches the batch's rows only
        out.append(line.strip().split(" ")[0])
    return out


def kernels(hlo: str) -> int:
    """Instructions of `hlo`'s entry computation that run work (see the module docstring)."""
    entry = hlo[hlo.index("ENTRY") :].split("\n}", 1)[0]
    ops = (m.group(1) for line in entry.splitlines()[1:] if (m := _OPCODE.match(line)))
    return sum(op not in _FREE for op in ops)


def check(cfg: Config, debug: bool, dump: Path | None = None) -> dict[str, Any]:
    """{op: {"whole_buffer_ops": n, "aliased": bool, ...}} for the ops of `cfg`; with `dump`,
    each op's optimised HLO is written there too."""
    dd = device_data(cfg, host_data(cfg))
    spec = (
        fj.SpecConfig(cfg.topk, cfg.hidden, dd.hidden.dtype, kernel=cfg.spec_kernel)
        if cfg.spec
        else None
    )
    ops = fj.future_map(
        cfg.pool, dtype=int_dtype(cfg), spec=spec, debug=debug, protocol=cfg.protocol
    )
    state = ops.init()
    idx = dd.idx
    draft = fj.DraftPayload(dd.tokens, dd.topk_p, dd.topk_index, dd.hidden)
    payload = draft if cfg.spec else dd.tokens
    draft_idx = idx if cfg.spec else None
    if cfg.gather:  # the host's ids and lengths; resolve gathers what it relays
        batch = fj.Batch(dd.decode_mode, idx, dd.tokens, dd.lens, draft_idx)
    else:
        batch = fj.Batch(dd.decode_mode, idx, -idx, -idx, draft_idx)

    fixed = batch._replace(forward_mode=None)  # the mode is the executable's

    def engine(state: fj.FutureMapState, batch: fj.Batch) -> Any:
        state, res = ops.resolve(state, batch)
        out, lens = _model(res)
        state = ops.publish(state, batch.req_pool_indices, lens)
        state = ops.stash(state, batch.req_pool_indices, out)
        return state, (batch if cfg.gather else ops.invalidate(batch, idx))

    def finish(state: fj.FutureMapState, idx: jax.Array, lens: jax.Array, out: Any) -> Any:
        # The class's tail phase: publish, stash and (sentinel protocol) invalidate.
        state = ops.stash(ops.publish(state, idx, lens), idx, out)
        return state if cfg.gather else (state, ops.invalidate(fixed, idx).input_ids)

    def wrap(f: Any) -> Any:
        return checkify.checkify(f, errors=checkify.user_checks) if debug else f

    def resolve(state: fj.FutureMapState, batch: fj.Batch) -> Any:
        # As the class runs a resolve of a batch whose kind the host knows: the mode fixed
        # in the executable; debug returns the state (consume poison), else no state (a
        # returned, undonated state would have to be copied).
        state, res = ops.resolve(state, batch._replace(forward_mode=fj.ForwardMode.DECODE))
        return (state, res) if debug else res

    table = {
        "publish": (ops.publish, (state, idx, dd.lens), True),
        "stash_spec" if cfg.spec else "stash": (ops.stash, (state, idx, payload), True),
        "resolve_spec" if cfg.spec else "resolve_decode": (resolve, (state, fixed), debug),
        "finish": (finish, (state, idx, dd.lens, payload), True),
        "fused step": (engine, (state, batch), True),
    }
    options = fj.compiler_options(jax.devices()[0].platform)  # as the class compiles them
    out: dict[str, Any] = {}
    for name, (fn, args, donate) in table.items():
        jitted = jax.jit(wrap(fn), donate_argnums=(0,) if donate else (), compiler_options=options)
        hlo = jitted.lower(*args).compile().as_text() or ""
        if dump is not None:
            tag = re.sub(r"\W+", "_", f"{cfg.label()} {name} {'debug' if debug else 'off'}")
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"{tag}.hlo.txt").write_text(hlo)
        out[name] = {
            "whole_buffer_ops": len(whole_buffer_ops(hlo, cfg.pool)),
            "aliased": (not donate) or "input_output_alias" in hlo,
            "thread_splits": hlo.count(THREAD_SPLIT),
            "kernels": kernels(hlo),
        }
    return out


def table(cfgs: list[Config], checked: list[tuple[dict, dict]] | None = None) -> str:
    """Markdown: whole-buffer rewrites per op, debug off and on, for each configuration.

    `checked` holds (`check(cfg, False)`, `check(cfg, True)`) per configuration when the
    caller has them already; else each configuration is compiled here.
    """
    if checked is None:
        checked = [(check(cfg, False), check(cfg, True)) for cfg in cfgs]
    lines = [
        "| config | op | whole-buffer rewrites (debug off) | (debug on) | donated state aliased "
        "| split over threads (off / on) | kernels (off / on) |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for cfg, (off, on) in zip(cfgs, checked, strict=True):
        for op in off:
            lines.append(
                f"| {cfg.label()} | {op} | {off[op]['whole_buffer_ops']} | "
                f"{on[op]['whole_buffer_ops']} | {'yes' if off[op]['aliased'] else 'NO'} | "
                f"{off[op]['thread_splits']} / {on[op]['thread_splits']} | "
                f"{off[op]['kernels']} / {on[op]['kernels']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print (and with --out write) the table for both protocols, a plain and a spec map."""
    p = argparse.ArgumentParser(prog="python -m fm_bench.inplace", description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pool", type=int, default=1 << 20, help="R of the plain map")
    p.add_argument("--spec-pool", type=int, default=16384, help="R of the spec map")
    p.add_argument("--hidden", type=int, default=4096, help="H of the spec map")
    p.add_argument(
        "--spec-kernel",
        choices=("xla", "pallas", "both"),
        default="both",
        help="the spec map's SpecConfig.kernel (default: both, side by side)",
    )
    p.add_argument("--out", type=Path, default=None, help="write inplace_<tag>.{md,json}")
    p.add_argument("--tag", default=None, help="file tag (default: the device platform)")
    p.add_argument("--hlo", type=Path, default=None, help="write each op's optimised HLO here")
    a = p.parse_args(argv)
    kernels = ("xla", "pallas") if a.spec_kernel == "both" else (a.spec_kernel,)
    cfgs = [
        Config(a.batch, pool, spec=spec, hidden=a.hidden, protocol=protocol, spec_kernel=kernel)
        for protocol in ("sentinel", "gather")
        for pool, spec in ((a.pool, False), (a.spec_pool, True))
        for kernel in (kernels if spec else ("xla",))
    ]
    checked = [(check(cfg, False, a.hlo), check(cfg, True, a.hlo)) for cfg in cfgs]
    device = jax.devices()[0]
    md = (
        f"# Compiled HLO per op: whole-buffer rewrites and kernels\n\n"
        f"Device: jax {jax.__version__} {device.platform}:{device.device_kind}.\n\n"
        + table(cfgs, checked)
        + "\n"
    )
    print(md)
    if a.out is not None:
        rows = [
            {"config": cfg.label(), "debug_off": off, "debug_on": on}
            for cfg, (off, on) in zip(cfgs, checked, strict=True)
        ]
        write_result(a.out, "inplace", md, rows, a.tag)


if __name__ == "__main__":
    main()
