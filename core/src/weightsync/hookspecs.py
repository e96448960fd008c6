"""The hooks: six that register components (assembly only; nothing here runs per bucket), and
two for tools: subcommands of the `weightsync` command and rows of `weightsync bench`."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Callable

import pluggy

__all__ = ["PROJECT", "hookimpl", "hookspec", "register_adapters", "register_bench_rows",
           "register_commands", "register_encodings", "register_exporters", "register_fleets",
           "register_peer_sources", "register_transports"]

PROJECT = "weightsync"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

if TYPE_CHECKING:
    from weightsync.interfaces import Adapter, Encoding, Exporter, Fleet, PeerSource, Transport


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
def register_bench_rows(register: Callable[[Callable[[Any, dict[str, Any]], None]], None]) -> None:
    """Register extra rows for `weightsync bench`: each callable gets the running
    `weightsync.bench.Bench` and its LLM-shaped model, and appends its `Row`s to `bench.rows`
    (and any conclusions to `bench.extra_targets`), so a plugin measures itself next to core."""


@hookspec
def register_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the `weightsync` command: `subparsers.add_parser(name, ...)`, then
    `set_defaults(fn=...)` with a function of the parsed arguments that returns an exit status.
    Called every time the command starts: import anything heavy inside `fn`, not here."""
