"""Hook implementations only: the `reference` adapter, its launcher and sampler (RL's hook), and
the `serve` command."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from weightsync import hookimpl


@hookimpl
def register_adapters(register: Callable[[type[Any]], None]) -> None:
    from weightsync_reference.adapter import ReferenceAdapter
    register(ReferenceAdapter)


@hookimpl
def register_launchers(register: Callable[[type[Any]], None]) -> None:
    from weightsync_reference.launcher import ReferenceLauncher
    register(ReferenceLauncher)


@hookimpl(optionalhook=True)
def register_samplers(register: Callable[[str, Callable[[Any], Any]], None]) -> None:
    from weightsync_reference.sampler import ReferenceSampler
    register("reference", ReferenceSampler)


@hookimpl
def register_commands(subparsers: argparse._SubParsersAction) -> None:
    from weightsync_reference.cli import add_command
    add_command(subparsers)
