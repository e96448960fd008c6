"""Hook implementations only: the `demo` and `route` commands."""

from __future__ import annotations

import argparse

from weightsync import hookimpl


@hookimpl
def register_commands(subparsers: argparse._SubParsersAction) -> None:
    from weightsync_rl.cli import add_commands
    add_commands(subparsers)
