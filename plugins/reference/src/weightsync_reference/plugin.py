"""Hook implementations only: the `reference` adapter and the `serve` command."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from weightsync import hookimpl


@hookimpl
def register_adapters(register: Callable[[type[Any]], None]) -> None:
    from weightsync_reference.adapter import ReferenceAdapter
    register(ReferenceAdapter)


@hookimpl
def register_commands(subparsers: argparse._SubParsersAction) -> None:
    from weightsync_reference.cli import add_command
    add_command(subparsers)
