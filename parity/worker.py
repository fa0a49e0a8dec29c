"""`python -m parity.worker`: run jobs read as JSON from stdin, one JSON line out per job.

The int64 pass runs here, in its own process started with JAX_ENABLE_X64=1: fm_jax
refuses int64 without JAX's x64 mode and never flips global config itself. Mesh jobs
run here too, in a process whose JAX sees dp * tp devices (parity.runner.worker_env).
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    """Read [Job fields, ...] from stdin; print {"index", "result"} per finished job."""
    from parity.suite import Job, run_job

    jobs = [Job(**j) for j in json.load(sys.stdin)]
    for i, job in enumerate(jobs):
        result = run_job(job)
        print(json.dumps({"index": i, "result": result.to_wire()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
