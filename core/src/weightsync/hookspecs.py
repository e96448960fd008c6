"""The hooks: seven that register components (assembly only; nothing here runs per bucket), one for
subcommands of the `weightsync` command, one for an application's own hooks (bench rows)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable

import pluggy

__all__ = ["PROJECT", "add_hookspecs", "hookimpl", "hookspec", "register_adapters",
           "register_commands", "register_encodings", "register_exporters", "register_fleets",
           "register_launchers", "register_peer_sources", "register_transports"]

PROJECT = "weightsync"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

if TYPE_CHECKING:
    from weightsync.interfaces import (Adapter, Encoding, Exporter, Fleet, Launcher, PeerSource,
                                       Transport)


@hookspec
def register_exporters(register: Callable[[type[Exporter]], None]) -> None:
    """Register exporters that turn a model into a stream of Buckets under HF names."""


@hookspec
def register_encodings(register: Callable[[type[Encoding]], None]) -> None:
    """Register encodings that turn a Bucket into a wire payload and back."""


@hookspec
def register_transports(register: Callable[[type[Transport]], None]) -> None:
    """Register transports that move encoded payloads from trainer to engines."""


@hookspec
def register_adapters(register: Callable[[type[Adapter]], None]) -> None:
    """Register adapters that speak one engine's weight-update control protocol."""


@hookspec
def register_fleets(register: Callable[[type[Fleet]], None]) -> None:
    """Register fleet sources: where the members of a sync come from (static, registry, Ray...)."""


@hookspec
def register_peer_sources(register: Callable[[type[PeerSource]], None]) -> None:
    """Register peer sources: how a joining member fetches a current member's bytes (HTTP, RDMA)."""


@hookspec
def register_launchers(register: Callable[[type[Launcher]], None]) -> None:
    """Register launchers that start an engine kind (named after its adapter)."""


@hookspec
def add_hookspecs(pluginmanager: pluggy.PluginManager) -> None:
    """Add an application's own hooks (`pluginmanager.add_hookspecs(module)`), once every plugin
    is registered; an implementation of another distribution's hook is marked
    `@hookimpl(optionalhook=True)`, so it loads where that distribution is not installed."""


@hookspec
def register_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the `weightsync` command: `subparsers.add_parser(name, ...)`, then
    `set_defaults(fn=...)` with a function of the parsed arguments that returns an exit status.
    Called every time the command starts: import anything heavy inside `fn`, not here."""
