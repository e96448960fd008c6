"""Hook implementations only; components are imported inside the hooks, and none of them imports
NIXL before it moves a byte, so this plugin loads (and `weightsync plugins` lists it) where NIXL
is not installed."""

from weightsync import hookimpl


@hookimpl
def register_transports(register):  # noqa: ANN001, ANN201
    from .sending import NixlTransport
    register(NixlTransport)


@hookimpl
def register_peer_sources(register):  # noqa: ANN001, ANN201
    from .peer_source import NixlPeerSource
    register(NixlPeerSource)
