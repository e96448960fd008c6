"""Hook implementations only; components are imported inside the hooks so the plugin imports
without its engine installed (SGLang is never imported at all)."""

from weightsync import hookimpl


@hookimpl
def register_adapters(register):
    from .adapter import SGLangAdapter
    register(SGLangAdapter)


@hookimpl
def register_transports(register):
    from .tensor_transport import SGLangTensorTransport
    register(SGLangTensorTransport)
