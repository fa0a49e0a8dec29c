"""fm_torch's debug checks on CUDA: each violation class is still reported there.

On CUDA the invariants are `torch._assert_async` device asserts (no host sync at the call):
a violation surfaces at the next synchronisation as "device-side assert triggered", and the
CUDA context is unusable afterwards. So every case runs in its own child process: it builds a
CUDA map, commits one violation (or, for the controls, the legal order), synchronises and
prints whether anything was reported. Each class the CPU tests raise InvariantViolation for
(tests/test_fm_torch_debug.py, tests/test_fm_torch_gather.py) has a case here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

NO_CUDA = "needs a CUDA device; torch.cuda.is_available() is False on this machine"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

PRELUDE = """
import os, sys, torch
from fm_torch import DraftInput, DraftPayload, ForwardMode, FutureMap, ScheduleBatch

dev = torch.device("cuda", torch.cuda.current_device())

def t(values):
    return torch.tensor(values, dtype=torch.int64, device=dev)

def decode(slots):  # sentinel protocol: -slot ids and lengths
    s = [-x for x in slots]
    return ScheduleBatch(ForwardMode.DECODE, t(slots), t(s), t(s))

def gather_decode(slots):  # gather protocol: no ids, the host's lengths
    return ScheduleBatch(ForwardMode.DECODE, t(slots), None, t([5] * len(slots)))

def draft(bonus):
    rows = len(bonus)
    return DraftPayload(
        t(bonus),
        torch.ones((rows, 2), dtype=torch.float32, device=dev),
        torch.ones((rows, 2), dtype=torch.int64, device=dev),
    )

def spec_decode(slots):
    batch = decode(slots)
    batch.draft = DraftInput(t(slots))
    return batch
"""

EPILOGUE = """
try:
    case()
    torch.cuda.synchronize()
except RuntimeError as e:
    print("REPORTED", " ".join(str(e).split())[:300], flush=True)
    os._exit(0)
print("UNREPORTED", flush=True)
os._exit(0)
"""

VIOLATIONS = {
    "consume_read_read": """
        fm = FutureMap(4, device=dev, debug=True)
        fm.publish(t([2]), t([5]))
        fm.stash(t([2]), t([9]))
        fm.resolve(decode([2]))
        fm.resolve(decode([2]))
    """,
    "consume_read_before_first_write": """
        fm = FutureMap(4, device=dev, debug=True)
        fm.publish(t([1, 3]), t([5, 5]))
        fm.stash(t([1]), t([4]))
        fm.resolve(decode([1, 3]))
    """,
    "consume_mixed_tail_sentinel": """
        fm = FutureMap(5, device=dev, debug=True)
        fm.publish(t([1, 3]), t([5, 5]))
        fm.stash(t([1]), t([4]))
        fm.resolve(ScheduleBatch(ForwardMode.MIXED, t([2, 1, 3]), t([8, 8, -1, -3]), t([2, 6, 6])))
    """,
    "consume_spec_bonus_read_read": """
        fm = FutureMap(4, device=dev, spec=True, debug=True)
        fm.publish(t([1, 2]), t([5, 5]))
        fm.stash(t([1, 2]), draft([7, 0]))
        fm.resolve(spec_decode([1, 2]))
        fm.resolve(spec_decode([2, 1]))
    """,
    "consume_gather_read_read": """
        fm = FutureMap(6, device=dev, debug=True, protocol="gather")
        fm.stash(t([1, 2]), t([10, 20]))
        fm.resolve(gather_decode([1, 2]))
        fm.resolve(gather_decode([1, 2]))
    """,
    "positive_lengths_decode": """
        fm = FutureMap(4, device=dev, debug=True)
        fm.stash(t([1, 2]), t([3, 4]))
        fm.publish(t([1]), t([6]))
        fm.resolve(decode([1, 2]))
    """,
    "positive_lengths_gather_spec": """
        fm = FutureMap(6, device=dev, spec=True, debug=True, protocol="gather")
        fm.publish(t([1]), t([5]))
        fm.stash(t([1, 2]), draft([11, 22]))
        slots = t([1, 2, 0])
        fm.resolve(ScheduleBatch(ForwardMode.DECODE, slots, None, t([0, 0, 0]), DraftInput(slots)))
    """,
}

CONTROLS = {  # the legal order W R W R in each protocol: nothing may be reported
    "sentinel_write_read_write_read": """
        fm = FutureMap(4, device=dev, debug=True)
        fm.publish(t([1, 2]), t([5, 5]))
        for tokens in ([3, 0], [7, 8]):
            fm.stash(t([1, 2]), t(tokens))
            fm.resolve(decode([1, 2]))
    """,
    "gather_write_read_write_read": """
        fm = FutureMap(6, device=dev, debug=True, protocol="gather")
        for tokens in ([10, 20], [11, 21]):
            fm.stash(t([1, 2]), t(tokens))
            fm.resolve(gather_decode([1, 2]))
    """,
}


def _run(body: str) -> str:
    """The child's verdict line: 'REPORTED <error>' or 'UNREPORTED'."""
    code = PRELUDE + "\ndef case():\n" + textwrap.indent(textwrap.dedent(body), "    ") + EPILOGUE
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=Path(__file__).resolve().parent.parent,
    )
    verdicts = [ln for ln in proc.stdout.splitlines() if ln.startswith(("REPORTED", "UNREPORTED"))]
    assert verdicts, f"the child gave no verdict (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return verdicts[-1]


@pytest.mark.parametrize("name", sorted(VIOLATIONS))
def test_each_violation_class_is_reported_by_a_device_assert(name: str) -> None:
    """Pins: a debug check that on CUDA never fires (or fires as something other than the
    device assert), so a violation goes unreported on the device engines run on."""
    verdict = _run(VIOLATIONS[name])
    assert verdict.startswith("REPORTED"), verdict
    assert "device-side assert" in verdict, verdict


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_the_legal_order_reports_nothing_on_cuda(name: str) -> None:
    """The control: the same harness on a legal sequence reports nothing, so a REPORTED
    verdict above is the violation's, not the harness's. Pins: a false positive on CUDA."""
    assert _run(CONTROLS[name]) == "UNREPORTED"
