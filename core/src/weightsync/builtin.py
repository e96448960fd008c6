"""Core's own components, registered through the same hooks as any plugin."""

from __future__ import annotations

from .hookspecs import hookimpl


@hookimpl
def register_exporters(register):  # noqa: ANN001, ANN201
    from .exporters.torch import TorchExporter
    register(TorchExporter)


@hookimpl
def register_encodings(register):  # noqa: ANN001, ANN201
    from .encodings.cast import CastEncoding
    from .encodings.raw import RawEncoding
    register(RawEncoding)
    register(CastEncoding)


@hookimpl
def register_transports(register):  # noqa: ANN001, ANN201
    from .transports.http import HttpTransport
    register(HttpTransport)
    from .transports.collective import CollectiveTransport
    register(CollectiveTransport)
    from .transports.shm import ShmTransport
    register(ShmTransport)


@hookimpl
def register_adapters(register):  # noqa: ANN001, ANN201
    from .adapters.reference import ReferenceAdapter
    register(ReferenceAdapter)


@hookimpl
def register_fleets(register):  # noqa: ANN001, ANN201
    from .fleet.registry import RegistryFleet
    from .fleet.static import StaticFleet
    from .ray.fleet import RayFleet     # imports no Ray: only opening the fleet needs it
    register(StaticFleet)
    register(RegistryFleet)
    register(RayFleet)


@hookimpl
def register_peer_sources(register):  # noqa: ANN001, ANN201
    from .fleet.peer import HttpPeerSource
    register(HttpPeerSource)
