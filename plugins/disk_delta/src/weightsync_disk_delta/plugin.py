"""Hook implementations only; components are imported inside the hooks."""

from weightsync import hookimpl


@hookimpl
def register_encodings(register):  # noqa: ANN001, ANN201
    from .encoding import DeltaEncoding
    register(DeltaEncoding)


@hookimpl
def register_transports(register):  # noqa: ANN001, ANN201
    from .transport import DiskDeltaTransport
    register(DiskDeltaTransport)
