"""`fm-parity`: run the parity scenarios (and the mutation check), print a table, exit 0/1.

Exit status: 0 when every run has zero divergences and a passing oracle and every
mutation is caught (with --dp/--tp: and no unexpected compile, resharding or collective);
1 otherwise; 2 for bad arguments or a missing device.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

MESH_STEPS = 6
"""Default --steps with --dp/--tp: a mesh run is mostly compile time, so the whole default
mesh run (all scenarios, int32, debug off) stays within a minute on a 2-core CPU."""


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one function, so that other run modes can add options)."""
    p = argparse.ArgumentParser(
        prog="fm-parity",
        description="Run overlap scenarios through fm_torch and fm_jax and compare them "
        "bit for bit after every FutureMap op; check token streams against a "
        "synchronous reference loop.",
    )
    p.add_argument(
        "--scenario",
        action="append",
        metavar="NAME",
        help="run only this scenario (repeatable; default: all, see --list)",
    )
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="stop each scenario after this many scheduler steps (default: run to the end; "
        f"with --dp/--tp: {MESH_STEPS})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the seeded scenarios (DP rank d runs seed + d)",
    )
    p.add_argument(
        "--dtype",
        choices=("int32", "int64", "all"),
        default=None,
        help="token/length dtype; int64 runs in a JAX x64 subprocess "
        "(default: all; with --dp/--tp: int32)",
    )
    p.add_argument(
        "--debug",
        choices=("on", "off", "both"),
        default=None,
        help="FutureMap debug mode (consume tracking and invariant checks) "
        "(default: both; with --dp/--tp: off)",
    )
    p.add_argument(
        "--protocol",
        choices=("sentinel", "gather", "both"),
        default="both",
        help="the FutureMap relay protocol both twins run (docs/CONTRACT.md, 'Two "
        "protocols'): sentinel (decode rows carry -slot until resolve), gather (resolve "
        "gathers at the slots the host names; no invalidate), or both, every scenario under "
        "each against the same oracle (default: both)",
    )
    p.add_argument(
        "--spec-kernel",
        choices=("xla", "pallas", "both"),
        default="both",
        help="how fm_jax's spec map moves its fields (SpecConfig.kernel): xla (a scatter or "
        "gather per buffer), pallas (one kernel for all: Triton on CUDA, Pallas's "
        "interpreter on CPU), or both, each spec scenario under each (default: both; "
        "non-spec scenarios run once)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both twins run (cuda: the same GPU for both)",
    )
    p.add_argument(
        "--mutations",
        action="store_true",
        help="also run the mutation check over the selected scenarios (int32; each broken "
        "variant under the protocol whose mistake it makes, if selected)",
    )
    p.add_argument(
        "--mutate",
        choices=("jax", "both"),
        default="jax",
        help="which twin the mutation check breaks (both: parity is blind, the "
        "oracle and debug checks must catch it)",
    )
    p.add_argument(
        "--dp",
        type=_positive_int,
        default=1,
        metavar="N",
        help="with --tp: run the scenarios on a DP=N x TP=M mesh of one sharded fm_jax map "
        "(rank d runs the scenario with seed + d; each rank's trace bit for bit against "
        "fm_torch's map for that rank, its streams against the reference loop), and check "
        "the sharded map itself (no recompile, resharding or collective in the compiled "
        "HLO). Runs in a subprocess with N*M devices: on CPU virtual ones "
        "(XLA_FLAGS=--xla_force_host_platform_device_count), with --device cuda N*M GPUs",
    )
    p.add_argument("--tp", type=_positive_int, default=1, metavar="M", help="see --dp")
    p.add_argument(
        "--processes",
        type=_positive_int,
        default=1,
        metavar="P",
        help="run the --dp/--tp mesh over P processes on 127.0.0.1 (jax.distributed, gloo; "
        "CPU only), each holding N*M/P devices and driving its own DP ranks; the ranks' "
        "traces are merged and judged as one run",
    )
    p.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        metavar="N",
        help="run the scenarios in N worker processes side by side, the longest first "
        "(default 1: here, with int64 and mesh runs in one worker each). On one GPU the "
        "workers share it; the mutation check still runs here, one variant at a time",
    )
    p.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _device_description(device: str) -> str:
    """'cpu', or the GPU both twins use; RuntimeError when there is none."""
    if device == "cpu":
        return "cpu"
    import torch

    from fm_parity.twin_jax import jax_device
    from fm_parity.twin_torch import torch_device

    torch_device("cuda")
    jd = jax_device("cuda")
    return f"cuda ({torch.cuda.get_device_name()}; jax {jd.device_kind})"


def _mesh_device_description(device: str, dp: int, tp: int, processes: int) -> str:
    """The devices a dp x tp mesh run uses; RuntimeError when there are too few GPUs."""
    n = dp * tp
    if device == "cpu":
        return f"cpu ({n} host devices)" + (f" over {processes} processes" if processes > 1 else "")
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        raise RuntimeError(f"--device cuda: JAX sees no GPU ({e})") from e
    if len(gpus) < n:
        raise RuntimeError(
            f"--device cuda --dp {dp} --tp {tp} needs {n} GPUs, JAX sees {len(gpus)}"
        )
    return f"cuda ({n} x {gpus[0].device_kind})"


def _mesh_unfit(names: Sequence[str], dp: int, seed: int, processes: int = 1) -> dict[str, str]:
    """Scenarios that cannot run on dp ranks of one sharded map (over `processes`), and
    why."""
    from fm_parity import catalogue

    out = {}
    for name in names:
        scenario = catalogue.build(name, seed=seed)
        pools = {catalogue.build(name, seed=seed + d).pool_size for d in range(dp)}
        if len(pools) > 1:
            seeds = f"seeds {seed}..{seed + dp - 1}"
            out[name] = f"pool size depends on the seed ({sorted(pools)} over {seeds})"
        elif processes > 1 and scenario.spec is not None and scenario.spec.stashes != "full":
            # One stash writes the same fields on every rank it feeds; ranks stashing other
            # fields take calls of their own, which processes would not agree on.
            out[name] = "partial stashes differ by rank (one stash call per field set)"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `fm-parity`."""
    args = build_parser().parse_args(argv)
    from fm_parity.catalogue import CATALOGUE

    mesh = args.dp * args.tp > 1
    if args.processes > 1:
        n = args.dp * args.tp
        if n % args.processes or (n // args.processes) % args.tp or args.device != "cpu":
            print(
                f"fm-parity: --processes {args.processes} needs --dp x --tp devices ({n}) to "
                "split into whole TP groups per process, on --device cpu",
                file=sys.stderr,
            )
            return EXIT_USAGE
    if args.dtype is None:
        args.dtype = "int32" if mesh else "all"
    if args.debug is None:
        args.debug = "off" if mesh else "both"
    if mesh and args.steps is None:
        args.steps = MESH_STEPS

    if args.list:
        for name, builder in CATALOGUE.items():
            print(f"{name:22s} {(builder.__doc__ or '').splitlines()[0]}")
        return EXIT_OK
    names = args.scenario or list(CATALOGUE)
    unknown = [n for n in names if n not in CATALOGUE]
    if unknown:
        print(f"fm-parity: unknown scenario(s) {unknown}; see --list", file=sys.stderr)
        return EXIT_USAGE
    if args.steps is not None and args.steps < 1:
        print("fm-parity: --steps must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    skipped: dict[str, str] = {}
    if mesh:
        if args.mutations:
            print("fm-parity: --mutations runs unsharded; not with --dp/--tp", file=sys.stderr)
            return EXIT_USAGE
        skipped = _mesh_unfit(names, args.dp, args.seed, args.processes)
        if skipped and args.scenario:
            why = "; ".join(f"{n}: {w}" for n, w in skipped.items())
            print(
                f"fm-parity: cannot run on {args.dp} DP ranks of one sharded map (rank d runs "
                f"seed + d): {why}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        names = [n for n in names if n not in skipped]
    if args.device == "cuda":  # before JAX starts: the x64 worker shares the GPU
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    from tqdm import tqdm

    from fm_parity import catalogue, report
    from fm_parity.mutations import MUTATIONS
    from fm_parity.runner import run_jobs
    from fm_parity.suite import Job, check_mutation
    from fm_parity.twin import PROTOCOLS

    try:
        if mesh:
            device = _mesh_device_description(args.device, args.dp, args.tp, args.processes)
        else:
            device = _device_description(args.device)
    except RuntimeError as e:
        print(f"fm-parity: {e}", file=sys.stderr)
        return EXIT_USAGE
    dtypes = ("int32", "int64") if args.dtype == "all" else (args.dtype,)
    debugs = {"on": (True,), "off": (False,), "both": (False, True)}[args.debug]
    protocols = PROTOCOLS if args.protocol == "both" else (args.protocol,)
    kernels = ("xla", "pallas") if args.spec_kernel == "both" else (args.spec_kernel,)
    jobs = [
        Job(
            n,
            dt,
            dbg,
            args.device,
            args.steps,
            args.seed,
            dp=args.dp,
            tp=args.tp,
            processes=args.processes,
            protocol=proto,
            spec_kernel=kernel,
        )
        for n in names
        for proto in protocols
        if catalogue.runs_under(n, proto)
        for kernel in (kernels if catalogue.build(n).spec is not None else ("xla",))
        for dt in dtypes
        for dbg in debugs
    ]
    # Each broken variant is one protocol's mistake: it runs when that protocol does.
    mutation_names = [m for m, cls in MUTATIONS.items() if cls.judged_under in protocols]
    n_mut = len(mutation_names) if args.mutations else 0
    bar = tqdm(
        total=len(jobs) + n_mut,
        disable=args.no_progress,
        file=sys.stderr,
        unit="run",
        dynamic_ncols=True,
    )

    def progress(job: Job, _: object) -> None:
        debug = "on" if job.debug else "off"
        bar.set_postfix_str(
            f"{job.scenario} {job.protocol} {job.spec_kernel} {job.dtype} debug {debug}"
        )
        bar.update()

    results = run_jobs(jobs, progress, workers=args.jobs)
    mutations = []
    if args.mutations:
        mutate = ("jax",) if args.mutate == "jax" else ("jax", "torch")
        suite = [
            Job(n, "int32", dbg, args.device, args.steps, args.seed)
            for n in names
            for dbg in debugs
        ]
        for name in mutation_names:
            bar.set_postfix_str(f"mutation {name}")
            mutations.append(check_mutation(name, suite, mutate))
            bar.update()
    bar.close()

    print(report.scenario_table(results))
    details = report.failure_details(results)
    if details:
        print("\n" + details)
    if mutations:
        print(f"\nmutation check (int32, mutated twin: {args.mutate}):")
        print(report.mutation_table(mutations))
    if skipped:
        print("\nnot run on the mesh: " + "; ".join(f"{n} ({w})" for n, w in skipped.items()))
    if args.json:
        doc = report.report_json(device, results, mutations)
        if mesh:
            doc["skipped"] = skipped
        report.write_json(args.json, doc)
    failed = [r for r in results if not r.ok]
    missed = [m for m in mutations if m.caught_by is None]
    procs = f" over {args.processes} processes" if args.processes > 1 else ""
    what = (
        f" on a DP={args.dp} x TP={args.tp} mesh{procs}, and no unexpected compile, "
        "resharding or collective"
        if mesh
        else ""
    )
    print(
        f"\n{len(results) - len(failed)}/{len(results)} runs ({' + '.join(protocols)}) "
        f"bit-identical with a passing oracle{what}"
        + (
            f"; {len(mutations) - len(missed)}/{len(mutations)} mutations caught"
            if mutations
            else ""
        )
    )
    return EXIT_FAIL if failed or missed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
