"""Reusable argparse types: a flag out of range is refused at parse time, naming the flag and the range
(`pdserve serve: error: argument --port: must be an integer in [0, 65535], got '70000'`), instead of failing
later, deeper, or not at all. And `document_defaults`, which gives every flag's --help its default.

Light on purpose (the standard library only): every subcommand's parser imports it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_PORT = 65535


def _number(text: str, kind: Callable[[str], Any], what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if isinstance(value, float) and math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (no upper bound when high is None)."""
    what = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        value = _number(text, int, what)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return int(value)

    parse.__name__ = what  # argparse names the type in some messages
    return parse


port = int_in(0, MAX_PORT)  # 0: the kernel picks one (http_port.py)
positive_int = int_in(1)
non_negative_int = int_in(0)


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, MiB, GiB)."""
    value = _number(text, float, "a finite number > 0")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return float(value)


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _number(text, float, "a finite number >= 0")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return float(value)


def rate(text: str) -> float:
    """Requests per second: > 0, `inf` allowed (everything at once)."""
    value = _number(text, float, "a number > 0 or inf")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 or inf, got {text!r}")
    return float(value)


def unit_interval(text: str) -> float:
    """A ratio in [0, 1) (a spread around a length: 1 would allow zero-length prompts)."""
    value = _number(text, float, "a number in [0, 1)")
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return float(value)


def percent(text: str) -> float:
    """A percentage in (0, 100]."""
    value = _number(text, float, "a percentage in (0, 100]")
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"must be a percentage in (0, 100], got {text!r}")
    return float(value)


def comma_list(item: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """A comma-separated list of at least one `item` ("1,2,4"); a bad item is named."""

    def parse(text: str) -> tuple[Any, ...]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list, got {text!r}")
        try:
            return tuple(item(x) for x in items)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"each item {e}") from None

    return parse


def _default_text(value: Any) -> str:
    if isinstance(value, tuple | list):
        return ",".join(_default_text(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, Path | float | int | str) else repr(value)


def document_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default X)" to the help of every flag that has a default and does not state it already."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._StoreTrueAction | argparse._StoreFalseAction):
            continue  # a switch's default is "off" (or "on" for a --no-... switch): its help says what it does
        if action.default in (None, [], argparse.SUPPRESS) or not action.help:
            continue
        if "default" not in action.help.lower():
            action.help += f" (default {_default_text(action.default)})".replace("%", "%%")
