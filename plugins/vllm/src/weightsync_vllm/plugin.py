"""Hook implementations only; components are imported inside the hooks so the plugin imports
without its engine installed."""

from weightsync import hookimpl


@hookimpl
def register_adapters(register):
    from .adapter import VllmAdapter
    register(VllmAdapter)
