"""Hook implementations only: the bench's own hooks and its `bench` command."""

from __future__ import annotations

import argparse
from typing import Any

from weightsync import hookimpl


@hookimpl
def add_hookspecs(pluginmanager: Any) -> None:
    from weightsync_bench import hookspecs
    pluginmanager.add_hookspecs(hookspecs)


@hookimpl
def register_commands(subparsers: argparse._SubParsersAction) -> None:
    from weightsync_bench.cli import add_command
    add_command(subparsers)
