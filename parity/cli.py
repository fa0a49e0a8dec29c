"""`fm-parity`: run the parity scenarios (and the mutation check), print a table, exit 0/1.

Exit status: 0 when every run has zero divergences and a passing oracle and every
mutation is caught; 1 otherwise; 2 for bad arguments or a missing device.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


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
        "--steps", type=int, default=None, help="stop each scenario after this many scheduler steps"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random-mix scenarios")
    p.add_argument(
        "--dtype",
        choices=("int32", "int64", "all"),
        default="all",
        help="token/length dtype; int64 runs in a JAX x64 subprocess",
    )
    p.add_argument(
        "--debug",
        choices=("on", "off", "both"),
        default="both",
        help="FutureMap debug mode (consume tracking and invariant checks)",
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
        help="also run the mutation check over the selected scenarios (int32)",
    )
    p.add_argument(
        "--mutate",
        choices=("jax", "both"),
        default="jax",
        help="which twin the mutation check breaks (both: parity is blind, the "
        "oracle and debug checks must catch it)",
    )
    p.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _device_description(device: str) -> str:
    """'cpu', or the GPU both twins use; RuntimeError when there is none."""
    if device == "cpu":
        return "cpu"
    import torch

    from parity.twin_jax import jax_device
    from parity.twin_torch import torch_device

    torch_device("cuda")
    jd = jax_device("cuda")
    return f"cuda ({torch.cuda.get_device_name()}; jax {jd.device_kind})"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `fm-parity`."""
    args = build_parser().parse_args(argv)
    from parity.catalogue import CATALOGUE

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
    if args.device == "cuda":  # before JAX starts: the x64 worker shares the GPU
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    from tqdm import tqdm

    from parity import report
    from parity.mutations import MUTATIONS
    from parity.runner import run_jobs
    from parity.suite import Job, check_mutation

    try:
        device = _device_description(args.device)
    except RuntimeError as e:
        print(f"fm-parity: {e}", file=sys.stderr)
        return EXIT_USAGE
    dtypes = ("int32", "int64") if args.dtype == "all" else (args.dtype,)
    debugs = {"on": (True,), "off": (False,), "both": (False, True)}[args.debug]
    jobs = [
        Job(n, dt, dbg, args.device, args.steps, args.seed)
        for n in names
        for dt in dtypes
        for dbg in debugs
    ]
    n_mut = len(MUTATIONS) if args.mutations else 0
    bar = tqdm(
        total=len(jobs) + n_mut,
        disable=args.no_progress,
        file=sys.stderr,
        unit="run",
        dynamic_ncols=True,
    )

    def progress(job: Job, _: object) -> None:
        bar.set_postfix_str(f"{job.scenario} {job.dtype} debug {'on' if job.debug else 'off'}")
        bar.update()

    results = run_jobs(jobs, progress)
    mutations = []
    if args.mutations:
        mutate = ("jax",) if args.mutate == "jax" else ("jax", "torch")
        suite = [
            Job(n, "int32", dbg, args.device, args.steps, args.seed)
            for n in names
            for dbg in debugs
        ]
        for name in MUTATIONS:
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
    if args.json:
        report.write_json(args.json, report.report_json(device, results, mutations))
    failed = [r for r in results if not r.ok]
    missed = [m for m in mutations if m.caught_by is None]
    print(
        f"\n{len(results) - len(failed)}/{len(results)} runs bit-identical with a passing "
        f"oracle"
        + (
            f"; {len(mutations) - len(missed)}/{len(mutations)} mutations caught"
            if mutations
            else ""
        )
    )
    return EXIT_FAIL if failed or missed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
