"""Hook implementations only; components are imported inside the hooks so the plugin imports
without its engine installed. `register_samplers` is RL's hook (optional: this plugin loads
where weightsync-rl is not installed, and never imports it)."""

from __future__ import annotations

from typing import Any, Callable

from weightsync import hookimpl


@hookimpl
def register_adapters(register: Callable[[type[Any]], None]) -> None:
    from .adapter import VllmAdapter
    register(VllmAdapter)


@hookimpl
def register_launchers(register: Callable[[type[Any]], None]) -> None:
    from .launch import VllmLauncher
    register(VllmLauncher)


@hookimpl(optionalhook=True)
def register_samplers(register: Callable[[str, Callable[[Any], Any]], None]) -> None:
    from .generation import VllmSampler
    register("vllm", VllmSampler)
