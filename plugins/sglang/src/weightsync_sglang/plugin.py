"""Hook implementations only; components are imported inside the hooks so the plugin imports
without its engine installed (SGLang is never imported at all). The sampler is registered through
RL's hook (`optionalhook`: the plugin loads where weightsync_rl is not installed)."""

from typing import Any, Callable

from weightsync import hookimpl


@hookimpl
def register_adapters(register):
    from .adapter import SGLangAdapter
    register(SGLangAdapter)


@hookimpl
def register_transports(register):
    from .tensor_transport import SGLangTensorTransport
    register(SGLangTensorTransport)


@hookimpl(optionalhook=True)
def register_samplers(register: Callable[[str, Callable[[Any], Any]], None]) -> None:
    from .generation import SGLangSampler
    register("sglang", SGLangSampler)
