"""Argument types for the command lines: a bad value is a usage error naming the argument.

argparse turns an `argparse.ArgumentTypeError` raised by a type function into
`prog: error: argument --name: <message>` and exit status 2, before anything runs; these
types check ranges there, so no bad value reaches the model (or a measurement) to end in a
traceback.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """An int >= `low`."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v

    return parse


def odd_count(text: str) -> int:
    """An odd int >= 1 (a median of runs is one of them)."""
    v = int_at_least(1)(text)
    if v % 2 == 0:
        raise argparse.ArgumentTypeError(f"must be odd (the median run counts), got {v}")
    return v


def float_in(
    low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> Callable[[str], float]:
    """A finite float in [low, high] (an open end excluded)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"wants a number, got {text!r}") from None
        if (
            not math.isfinite(v)
            or v < low
            or v > high
            or (low_open and v == low)
            or (high_open and v == high)
        ):
            lo, hi = "(" if low_open else "[", ")" if high_open else "]"
            raise argparse.ArgumentTypeError(
                f"must be a finite number in {lo}{low:g}, {high:g}{hi}, got {text!r}"
            )
        return v

    return parse


def int_list(low: int) -> Callable[[str], list[int]]:
    """A non-empty comma-separated list of ints, each >= `low`."""

    def parse(text: str) -> list[int]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(
                f"wants a comma-separated list of integers, got {text!r}"
            )
        return [int_at_least(low)(p) for p in parts]

    return parse


def float_list(low: float) -> Callable[[str], list[float]]:
    """A non-empty comma-separated list of finite floats, each >= `low`."""
    one = float_in(low, math.inf)

    def parse(text: str) -> list[float]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(
                f"wants a comma-separated list of numbers, got {text!r}"
            )
        return [one(p) for p in parts]

    return parse


def non_empty_text(text: str) -> str:
    """A non-empty string (a stop string or a bad word)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text
