"""The entry point is found, and the plugin loads (and says what to install) without NIXL."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from weightsync import load_components, make_plugin_manager
from weightsync.errors import ConfigError

from weightsync_nixl import agent, loader


def test_entry_point_is_discovered_and_registers_both_components() -> None:
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="weightsync")}
    assert eps["nixl"].value == "weightsync_nixl.plugin"
    components = load_components(make_plugin_manager())
    assert components.transports.get("nixl").__module__ == "weightsync_nixl.sending"
    assert components.peer_sources.get("nixl").__module__ == "weightsync_nixl.peer_source"


def test_without_nixl_the_plugin_loads_and_the_first_use_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl", None)           # as if NIXL were not installed
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    monkeypatch.setattr(loader, "_api", None)
    monkeypatch.setattr(agent, "_agents", {})               # no agent made by another test
    components = load_components(make_plugin_manager())
    assert not components.failed, components.failed
    transport = components.transports.get("nixl")()        # building it needs no NIXL either
    with pytest.raises(ConfigError, match=r"install torch first, then `python -m pip install "
                                          r"nixl==1\.5\.1`"):
        transport.alloc(16)
    assert not loader.available()
