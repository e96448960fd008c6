"""Hook implementations only: RL's own hook (`register_samplers`), the `demo` and `route`
commands."""

from __future__ import annotations

import argparse
from typing import Any

from weightsync import hookimpl


@hookimpl
def add_hookspecs(pluginmanager: Any) -> None:
    from weightsync_rl import hookspecs
    pluginmanager.add_hookspecs(hookspecs)


@hookimpl
def register_commands(subparsers: argparse._SubParsersAction) -> None:
    from weightsync_rl.cli import add_commands
    add_commands(subparsers)
