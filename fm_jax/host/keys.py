"""Which executable serves a call: a typed key, made by placement, read by the registry.

The class, its engine steps, warm-up and the serving guard all key executables by `Key`,
so a call finds what warm-up compiled for it by construction (warm-up places empty batches
through the same placement as serving).
"""

from __future__ import annotations

from typing import NamedTuple

from fm_jax.ops.types import ForwardMode

OPS = ("publish", "stash", "finish", "sentinels", "seq_lens_at", "resolve", "step")
"""The executables' operations: the class's entry points, and an engine's whole step."""

MODES = ("extend", "decode", "traced")
"""How a resolve (or a step) knows its batch's kind: fixed when traced, not DECODE or
DECODE (no branch in the executable), or traced (the mode is an argument)."""

FIXED_MODES = {m.name.lower(): m for m in ForwardMode}
"""The ForwardMode a fixed-mode executable is traced with, by its key's mode. A resolve's
relay depends on the kind only (DECODE or not): its keys use 'extend' for every batch that
is not DECODE. An engine step's forward sees the mode itself: its keys name it exactly."""


class Key(NamedTuple):
    """One executable: an operation and the static sizes and inputs it was traced for.

    Attributes:
      op: one of OPS.
      rows: rows per DP rank (a batch bucket).
      tokens: tokens per rank (a resolve's or a step's token bucket); 0 for a tail op.
      draft: a resolve with draft indices.
      slots: a resolve with token slots.
      mode: a resolve's or a step's mode (one of MODES); '' for the other ops.
      checked: a debug map's tail op with its slot checks (False: slots already checked,
        on the host or by the last resolve).
      ids: a resolve that places input ids (False: a gather-protocol DECODE whose ids are
        gathered, T = B); a spec DECODE at the same sizes may come either way.
      confidence: a publish or finish that also writes confidence rows (and returns a copy
        of the confidence buffer for its host ring).
      omits: a partial stash's (or finish's) declared fields left out, in stash order; ()
        for a full one. Which fields a draft carries is its pytree structure: static.
    """

    op: str
    rows: int
    tokens: int = 0
    draft: bool = False
    slots: bool = False
    mode: str = ""
    checked: bool = True
    ids: bool = True
    confidence: bool = False
    omits: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The executable's name as `FutureMap.executables()` and warm-up reports give it:
        'resolve_fixed_extend', 'unchecked_publish', 'step_fixed_mixed', 'resolve'."""
        fixed = self.mode in FIXED_MODES
        base = f"{self.op}_fixed_{self.mode}" if fixed else self.op
        base += "_with_confidence" if self.confidence else ""
        return base if self.checked else f"unchecked_{base}"

    def describe(self) -> str:
        """The key in words: the op and its per-rank sizes."""
        if not self.tokens:
            partial = f" without {', '.join(self.omits)}" if self.omits else ""
            return f"{self.name} at {self.rows} rows per rank{partial}"
        return (
            f"{self.name} at {self.rows} rows x {self.tokens} tokens per rank"
            f"{' with a draft' if self.draft else ''}{' with token slots' if self.slots else ''}"
        )


def writes_state(op: str, debug: bool) -> bool:
    """Whether `op` writes the map's state, so takes it donated: the tail ops always,
    resolve only in debug (the consume poison), a step always."""
    return op in ("publish", "stash", "finish", "step") or (debug and op == "resolve")


def takes_state(op: str) -> bool:
    """Whether `op`'s executable takes the state first (all but the sentinels)."""
    return op != "sentinels"
