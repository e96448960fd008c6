"""The pull agent reloads an engine through the `ReloadsFromDisk` capability (an adapter's
`load_from_disk`), which the transport requires: an adapter without it is refused when the agent
is made (the command: when it starts), before the local checkpoint is touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pytest

from weightsync.errors import WeightSyncError
from weightsync.interfaces import Adapter, EngineStatus, ReloadsFromDisk
from weightsync_disk_delta import cli
from weightsync_disk_delta.agent import Agent
from weightsync_disk_delta.transport import DiskDeltaTransport


class NoDisk(Adapter):
    """An adapter that speaks the round protocol but cannot reload from disk."""

    name = "nodisk"

    def health(self) -> EngineStatus:
        return EngineStatus(version=0)

    def pause(self, mode: str) -> None: ...

    def resume(self) -> None: ...

    def begin(self, version: int, plan: Mapping[str, Any]) -> None: ...

    def end(self) -> dict[int, str]:
        return {}

    def commit(self, version: int) -> None: ...

    def abort(self) -> None: ...


def test_the_transport_requires_reloading_from_disk() -> None:
    assert DiskDeltaTransport.requires == (ReloadsFromDisk,)
    assert not issubclass(NoDisk, ReloadsFromDisk)


def test_the_agent_refuses_an_adapter_that_cannot_reload(tmp_path: Path) -> None:
    with pytest.raises(WeightSyncError, match="adapter NoDisk cannot reload from disk"):
        Agent(tmp_path / "root", tmp_path / "local", NoDisk())
    assert not (tmp_path / "local").exists()


def test_the_command_refuses_an_engine_kind_that_cannot_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    import weightsync.plugins as plugins
    components = plugins.load_components()
    components.adapters.add(NoDisk)
    monkeypatch.setattr(plugins, "load_components", lambda: components)
    with pytest.raises(SystemExit, match="adapter 'nodisk' cannot reload from disk"):
        cli._adapter("nodisk", "http://127.0.0.1:1", None)
    assert isinstance(cli._adapter("reference", "http://127.0.0.1:1", None), ReloadsFromDisk)
