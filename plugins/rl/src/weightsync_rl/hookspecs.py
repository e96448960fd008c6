"""RL's own hook, added to weightsync's plugin manager through `add_hookspecs` (pytest's
`pytest_addhooks` pattern). An engine plugin that can generate rollouts implements it with
`@hookimpl(optionalhook=True)`, so the plugin still loads where RL is not installed."""

from __future__ import annotations

from typing import Any, Callable

from weightsync.hookspecs import hookspec

__all__ = ["register_samplers"]


@hookspec
def register_samplers(register: Callable[[str, Callable[[Any], Any]], None]) -> None:
    """Register how each engine kind generates rollouts: `register(adapter_name, factory)`, where
    `factory(adapter)` returns an object with the members of `weightsync_rl.rollout.Sampler`
    (`sampling`, `gates`, `generate`, `weight_version`, `busy_seconds`) for that adapter's
    engine. The data it speaks (`SamplingParams`, `Gate`, `Sample`) is
    `weightsync.interfaces.sampling`."""
