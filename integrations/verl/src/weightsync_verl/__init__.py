"""weightsync for verl: the checkpoint-engine backend `weightsync`, registered in verl's
CheckpointEngineRegistry when this module is imported (verl imports it through
`checkpoint_engine.custom_backend_module=weightsync_verl`)."""

from __future__ import annotations

__version__ = "0.2.0"   # the one source: hatch reads it for the distribution's version

from .engine import WeightSyncCheckpointEngine
from .replica import Replica
from .trainer import Trainer

__all__ = ["Replica", "Trainer", "WeightSyncCheckpointEngine"]
