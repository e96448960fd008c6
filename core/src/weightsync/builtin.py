"""Core's own components, registered through the same hooks as any plugin."""

from __future__ import annotations

from weightsync.hookspecs import hookimpl


@hookimpl
def register_exporters(register):  # noqa: ANN001, ANN201
    from weightsync.exporters.torch import TorchExporter
    register(TorchExporter)


@hookimpl
def register_encodings(register):  # noqa: ANN001, ANN201
    from weightsync.encodings.cast import CastEncoding
    from weightsync.encodings.raw import RawEncoding
    register(RawEncoding)
    register(CastEncoding)


@hookimpl
def register_transports(register):  # noqa: ANN001, ANN201
    from weightsync.transports.http.sending import HttpTransport
    register(HttpTransport)
    from weightsync.transports.collective import CollectiveTransport
    register(CollectiveTransport)
    from weightsync.transports.shm import ShmTransport
    register(ShmTransport)


@hookimpl
def register_fleets(register):  # noqa: ANN001, ANN201
    from weightsync.fleets.registry import RegistryFleet
    from weightsync.fleets.static import StaticFleet
    register(StaticFleet)
    register(RegistryFleet)


@hookimpl
def register_peer_sources(register):  # noqa: ANN001, ANN201
    from weightsync.fleets.peer import HttpPeerSource
    register(HttpPeerSource)
