"""weightsync for TRL: `use_weightsync(config)` before the trainer is built, and GRPOTrainer (vLLM
server mode) pushes its weights through weightsync into one or many vLLM servers, verified and
versioned by the trainer's global step; `WeightSyncTransfer` does the same for AsyncGRPOTrainer."""

from __future__ import annotations

__version__ = "0.2.0"   # the one source: hatch reads it for the distribution's version

from .client import WeightSyncVLLMClient
from .install import Installed, attach, use_weightsync
from .session import SyncSession
from .transfer import WeightSyncTransfer

__all__ = ["Installed", "SyncSession", "WeightSyncTransfer", "WeightSyncVLLMClient", "attach",
           "use_weightsync"]
