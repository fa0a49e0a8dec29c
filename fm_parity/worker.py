"""`python -m fm_parity.worker`: run jobs read from stdin, one JSON line in and out per job.

The int64 pass runs here, in its own process started with JAX_ENABLE_X64=1: fm_jax
refuses int64 without JAX's x64 mode and never flips global config itself. Mesh jobs
run here too, in a process whose JAX sees dp * tp devices (fm_parity.runner.worker_env).
With `fm-parity --jobs N` every job runs in such a worker, N of them side by side.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    """For each line {"index", "job": Job fields} of stdin, print {"index", "result"} once
    the job has run; jobs run in the order they arrive, until stdin closes."""
    from fm_parity.suite import Job, run_job

    for line in sys.stdin:
        msg = json.loads(line)
        result = run_job(Job(**msg["job"]))
        print(json.dumps({"index": msg["index"], "result": result.to_wire()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
