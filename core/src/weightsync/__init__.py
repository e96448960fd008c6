"""weightsync: move an RL trainer's weights into running inference engines.

Quick start (sync.yaml: `transport: http`, `adapter: reference`, `engines: [{url: ...}]`)::

    from weightsync import WeightSync
    with WeightSync.from_config("sync.yaml") as sync:
        for step in range(steps):
            train_step(model)
            print(sync.push(model, version=step + 1).summary())   # verify, pause, commit, resume

Plugins add components through pluggy hooks (`weightsync.hookspecs`). Names load on first use,
so `weightsync --help` and a plugin's `plugin.py` do not pay for torch."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from weightsync.errors import (ConfigError, EngineError, EngineUnavailable, EngineUnreachable,
                               PayloadError, PluginError, SyncError, TransportError,
                               WeightSyncError)
from weightsync.hookspecs import hookimpl

__version__ = "0.2.0"   # the one source: hatch reads it for the distribution's version

_LAZY = {name: module for module, names in {
    "wire.bucket": ("Bucket", "TensorSpec"), "config": ("EngineSpec", "SyncConfig"),
    "interfaces": ("Adapter", "Announce", "Encoding", "Endpoint", "EngineStatus", "Exporter",
                   "Fleet", "Member", "Message", "Payload", "PeerSource", "Transport",
                   "TransportReceiver"),
    "sync.pipeline": ("WeightSync",), "plugins": ("load_components", "make_plugin_manager"),
    "sync.report": ("EngineOutcome", "SyncReport")}.items() for name in names}

if TYPE_CHECKING:
    from weightsync.wire.bucket import Bucket, TensorSpec
    from weightsync.config import EngineSpec, SyncConfig
    from weightsync.interfaces import (Adapter, Announce, Encoding, Endpoint, EngineStatus,
                                       Exporter, Fleet, Member, Message, Payload, PeerSource,
                                       Transport, TransportReceiver)
    from weightsync.sync.pipeline import WeightSync
    from weightsync.plugins import load_components, make_plugin_manager
    from weightsync.sync.report import EngineOutcome, SyncReport


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["Adapter", "Announce", "Bucket", "ConfigError", "Encoding", "Endpoint", "EngineError",
           "EngineOutcome", "EngineSpec", "EngineStatus", "EngineUnavailable", "EngineUnreachable",
           "Exporter", "Fleet", "Member", "Message", "Payload", "PayloadError", "PeerSource",
           "PluginError", "SyncConfig", "SyncError", "SyncReport", "TensorSpec", "Transport",
           "TransportError", "TransportReceiver", "WeightSync", "WeightSyncError", "hookimpl",
           "load_components", "make_plugin_manager"]
