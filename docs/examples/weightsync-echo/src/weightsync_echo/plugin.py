"""Hook implementations only. weightsync imports this module through the entry point."""

from weightsync import hookimpl


@hookimpl
def register_transports(register):
    from .transport import EchoTransport

    register(EchoTransport)
