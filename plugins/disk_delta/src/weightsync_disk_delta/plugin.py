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


@hookimpl(optionalhook=True)   # weightsync-bench's hook: only where the bench is installed
def register_bench_rows(register):  # noqa: ANN001, ANN201
    from .bench import disk_delta_rows
    register(disk_delta_rows)


@hookimpl
def register_commands(subparsers):  # noqa: ANN001, ANN201
    from .cli import register_commands as add
    add(subparsers)
