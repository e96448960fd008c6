"""Hook implementations only; components are imported inside the hooks (megatron-core is
imported only when a push runs)."""

from weightsync import hookimpl


@hookimpl
def register_exporters(register):  # noqa: ANN001, ANN201
    from .exporter import MegatronExporter
    register(MegatronExporter)
