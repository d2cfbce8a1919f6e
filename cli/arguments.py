"""Argument types shared by the subcommands: values are checked where they are parsed."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypeAlias


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text}")
    return value


def float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


if TYPE_CHECKING:
    Subcommands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]
    """What each subcommand module's `add_command` registers itself on."""
else:
    Subcommands = argparse._SubParsersAction

LOG_LEVELS = ("debug", "info", "warning", "error")


def common_options(log_level: str = "info") -> argparse.ArgumentParser:
    """Options every subcommand takes, after its name: `specgate serve --log-level debug`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=LOG_LEVELS, default=log_level, help=f"default: {log_level}")
    return common
