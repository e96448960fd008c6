"""weightsync: move an RL trainer's weights into running inference engines.

Quick start::

    # sync.yaml
    # transport: http          # or shm, collective, disk_delta (plugin)
    # adapter: reference       # or vllm, sglang, lmdeploy (plugins)
    # engines: [{url: "http://127.0.0.1:8100"}]

    from weightsync import WeightSync
    sync = WeightSync.from_config("sync.yaml")
    for step in range(steps):
        train_step(model)
        report = sync.push(model, version=step + 1)   # pause, stream, verify, commit, resume
        print(report.summary())
    sync.close()

Plugins add components through four pluggy hooks (see `weightsync.hookspecs`).
"""

from .bucket import Bucket, TensorSpec
from .config import EngineSpec, SyncConfig
from .errors import (ConfigError, EngineError, EngineUnavailable, EngineUnreachable, PayloadError,
                     PluginError, SyncError, TransportError, WeightSyncError)
from .hookspecs import hookimpl
from .interfaces import (Adapter, Encoding, Endpoint, EngineStatus, Exporter, Payload, Transport,
                         TransportReceiver)
from .pipeline import WeightSync
from .plugins import load_components, make_plugin_manager
from .report import EngineOutcome, SyncReport

__version__ = "0.1.0"
__all__ = [
    "Adapter", "Bucket", "ConfigError", "Encoding", "Endpoint", "EngineError", "EngineOutcome",
    "EngineSpec", "EngineStatus", "EngineUnavailable", "EngineUnreachable", "Exporter", "Payload",
    "PayloadError", "PluginError", "SyncConfig", "SyncError", "SyncReport", "TensorSpec", "Transport",
    "TransportError", "TransportReceiver", "WeightSync", "WeightSyncError", "hookimpl",
    "load_components", "make_plugin_manager",
]
