"""Hook implementations only; components are imported inside the hooks so the plugin imports
without its engine installed."""

from weightsync import hookimpl


@hookimpl
def register_adapters(register):  # noqa: ANN001, ANN201
    from .adapter import LmdeployAdapter
    register(LmdeployAdapter)


@hookimpl
def register_transports(register):  # noqa: ANN001, ANN201
    from .transport import LmdeployIpcTransport
    register(LmdeployIpcTransport)
