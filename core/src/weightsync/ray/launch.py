"""How an engine actor starts its engine: the command for an adapter kind, with the node's address
and a free port filled in. The reference engine and vLLM have built-in commands; any other
adapter runs the `command` the user gives (placeholders `{python}`, `{model}`, `{host}`, `{port}`,
`{name}`)."""

from __future__ import annotations

import importlib.util
import json
import secrets
import sys
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..config import ComponentRef
from ..errors import ConfigError


class EngineLaunch(BaseModel):
    """What an engine actor starts and how it registers it (JSON: it travels to the actor)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="the model directory, as a path on the engine's node")
    adapter: ComponentRef = Field(default_factory=lambda: ComponentRef(kind="reference"),
                                  description="the adapter that drives the engine, and its options")
    command: list[str] | None = Field(None, description="the start command; None: the adapter's "
                                                        "built-in one (reference, vllm)")
    args: list[str] = Field(default_factory=list, description="appended to the built-in command")
    env: dict[str, str] = Field(default_factory=dict, description="added to the environment")
    api_key: str | None = Field(None, description="the engine's key (given in its environment)")
    host: str | None = Field(None, description="address to listen on; None: the node's address")
    port: int = Field(0, ge=0, le=65535, description="0: a free port on the node")
    device: str = Field("cpu", description="reference engine: where the weights live")
    load_roots: list[str] = Field(default_factory=list, description=(
        "reference engine: directories load_from_disk may read (a disk pull agent's checkpoint)"))
    start_timeout: float = Field(180.0, gt=0, description="seconds until the engine is healthy")


def command(launch: EngineLaunch, host: str, port: int, name: str
            ) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment that start `launch` listening on host:port."""
    kind = launch.adapter.kind
    env = dict(launch.env)
    if launch.command is not None:
        argv = list(launch.command) + list(launch.args)
    elif kind == "reference":
        argv = ["{python}", "-m", "weightsync", "serve", "--model", "{model}", "--host", "{host}",
                "--port", "{port}", "--name", "{name}", "--device", launch.device]
        for root in launch.load_roots:
            argv += ["--load-root", root]
        argv += launch.args
        if launch.api_key:
            env["WEIGHTSYNC_API_KEY"] = launch.api_key
    elif kind == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("adapter 'vllm' was asked for, but vLLM is not installed on this "
                              "node; install it (and weightsync-vllm) in the Ray workers' "
                              "environment, or give `command`")
        argv = ["{python}", "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}",
                "--host", "{host}", "--port", "{port}", "--served-model-name", "{name}",
                "--weight-transfer-config", json.dumps({"backend": "weightsync"})] + launch.args
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")     # vLLM serves its update routes only then
        # the weightsync backend takes updates only with its own token: the adapter's, else one
        # made for this engine (kept in the launch, so the registration hands it to the trainer)
        token = (launch.adapter.options.get("token") or env.get("WEIGHTSYNC_VLLM_TOKEN")
                 or secrets.token_hex(16))
        launch.adapter.options["token"] = env["WEIGHTSYNC_VLLM_TOKEN"] = token
        if launch.api_key:
            env["VLLM_API_KEY"] = launch.api_key
    else:
        raise ConfigError(f"adapter {kind!r} has no built-in start command; give `command` "
                          f"(placeholders {{python}} {{model}} {{host}} {{port}} {{name}})")
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
