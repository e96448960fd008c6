"""How an engine actor starts its engine: the command for an adapter kind, with the node's address
and a free port filled in. An adapter kind with a launcher (`register_launchers`: the reference
engine's, vLLM's) brings its own start command; any other runs the `command` the user gives
(placeholders `{python}`, `{model}`, `{host}`, `{port}`, `{name}`)."""

from __future__ import annotations

import sys
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from weightsync.config import ComponentRef
from weightsync.errors import ConfigError
from weightsync.interfaces.sampling import Unsupported

PLACEHOLDERS = "(placeholders {python} {model} {host} {port} {name})"


class EngineLaunch(BaseModel):
    """What an engine actor starts and how it registers it (JSON: it travels to the actor)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="the model directory, as a path on the engine's node")
    adapter: ComponentRef = Field(default_factory=lambda: ComponentRef(kind="reference"),
                                  description="the adapter that drives the engine, and its options")
    command: list[str] | None = Field(None, description="the start command; None: the start "
                                                        "command of the adapter's launcher")
    args: list[str] = Field(default_factory=list, description="appended to the built-in command")
    env: dict[str, str] = Field(default_factory=dict, description="added to the environment")
    api_key: str | None = Field(None, description="the engine's key (given in its environment)")
    host: str | None = Field(None, description="address to listen on; None: the node's address")
    port: int = Field(0, ge=0, le=65535, description="0: a free port on the node")
    device: str = Field("cpu", description="reference engine: where the weights live")
    load_roots: list[str] = Field(default_factory=list, description=(
        "reference engine: directories load_from_disk may read (a disk pull agent's checkpoint)"))
    start_timeout: float = Field(180.0, gt=0, description="seconds until the engine is healthy")


def command(launch: EngineLaunch, host: str, port: int, name: str, components: Any = None
            ) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment that start `launch` listening on host:port: the
    given `command`, else the start command of the launcher registered under the adapter's name."""
    env = dict(launch.env)
    if launch.command is not None:
        argv = list(launch.command) + list(launch.args)
    else:
        if components is None:
            from weightsync.plugins import load_components
            components = load_components()
        kind = launch.adapter.kind
        if kind not in components.launchers:
            components.adapters.get(kind)           # an unknown adapter is named as such
            raise ConfigError(f"adapter {kind!r} has no launcher (no installed plugin registers "
                              f"one under that name); give the launch a `command` {PLACEHOLDERS}")
        try:
            argv = components.launchers.get(kind).start_command(
                launch.model, host, port, name, launch.adapter.options, env, device=launch.device,
                load_roots=launch.load_roots, api_key=launch.api_key) + list(launch.args)
        except Unsupported as e:
            raise ConfigError(f"{e} {PLACEHOLDERS}") from None
    values = {"{python}": sys.executable, "{model}": launch.model, "{host}": host,
              "{port}": str(port), "{name}": name}
    return [_fill(a, values) for a in argv], env


def _fill(arg: str, values: dict[str, str]) -> str:
    """Placeholders replaced by plain substitution (a JSON argument keeps its braces)."""
    for k, v in values.items():
        arg = arg.replace(k, v)
    return arg


def describe(launch: EngineLaunch | dict[str, Any]) -> EngineLaunch:
    return launch if isinstance(launch, EngineLaunch) else EngineLaunch.model_validate(launch)
