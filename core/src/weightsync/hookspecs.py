"""The four registration hooks. Hooks are for assembly only; nothing here runs per bucket."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

PROJECT = "weightsync"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

if TYPE_CHECKING:
    from .interfaces import Adapter, Encoding, Exporter, Transport


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
