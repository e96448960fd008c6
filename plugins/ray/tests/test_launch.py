"""An engine actor's start command comes from the launcher registered under the adapter's name,
or from the launch's own `command`; an adapter kind without a launcher is refused with what to
do. No Ray needed: `weightsync_ray.launch` builds the argv only."""

from __future__ import annotations

import sys

import pytest

from weightsync.errors import ConfigError
from weightsync_ray.launch import EngineLaunch, command


def test_the_reference_launcher_gives_the_command() -> None:
    launch = EngineLaunch(model="/m", api_key="k", load_roots=["/ckpt"])
    argv, env = command(launch, "10.0.0.2", 8123, "e0")
    assert argv[:4] == [sys.executable, "-m", "weightsync", "serve"]
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--host") + 1] == "10.0.0.2"
    assert argv[argv.index("--load-root") + 1] == "/ckpt"
    assert env["WEIGHTSYNC_API_KEY"] == "k"


def test_an_adapter_without_a_launcher_needs_a_command() -> None:
    from weightsync.plugins import load_components
    components = load_components()
    # an adapter kind no plugin registers a launcher for
    components.adapters.add(type("Bare", (components.adapters.get("reference"),), {"name": "bare"}))
    launch = EngineLaunch(model="/m", adapter={"kind": "bare"})
    with pytest.raises(ConfigError, match=r"adapter 'bare' has no launcher.*give the launch a "
                                          r"`command` \(placeholders \{python\}"):
        command(launch, "127.0.0.1", 1, "e0", components)
    given = EngineLaunch(model="/m", adapter={"kind": "bare"},
                         command=["{python}", "serve.py", "{model}", "{port}"], args=["-v"])
    assert command(given, "127.0.0.1", 9, "e0", components)[0] == \
        [sys.executable, "serve.py", "/m", "9", "-v"]


def test_an_unknown_adapter_is_named() -> None:
    from weightsync.errors import PluginError
    with pytest.raises(PluginError, match="unknown adapter 'nosuch'"):
        command(EngineLaunch(model="/m", adapter={"kind": "nosuch"}), "127.0.0.1", 1, "e0")
