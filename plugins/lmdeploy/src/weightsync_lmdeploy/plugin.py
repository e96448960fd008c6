"""Hook implementations only; components are imported inside the hooks so the plugin imports
without its engine installed. The sampler is registered through RL's hook (`optionalhook`: the
plugin loads where weightsync_rl is not installed)."""

from typing import Any, Callable

from weightsync import hookimpl


@hookimpl
def register_adapters(register):  # noqa: ANN001, ANN201
    from .adapter import LmdeployAdapter
    register(LmdeployAdapter)


@hookimpl
def register_transports(register):  # noqa: ANN001, ANN201
    from .transport import LmdeployIpcTransport
    register(LmdeployIpcTransport)


@hookimpl(optionalhook=True)
def register_samplers(register: Callable[[str, Callable[[Any], Any]], None]) -> None:
    from .generation import LmdeploySampler
    register("lmdeploy", LmdeploySampler)
