"""weightsync on Ray (`pip install weightsync-ray`): fleet membership held by a named,
detached Ray actor, engines as Ray actors that Ray places and restarts, and
trainers whose ranks are Ray actors. Nothing here schedules, places or discovers anything itself:
that is Ray's job.

Importing this package never imports Ray: the names below load on first use, so the `ray` fleet
source registers (and `weightsync plugins` lists it) on a machine without Ray, and only opening it
asks for Ray."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"   # the one source: hatch reads it for the distribution's version

_EXPORTS = {
    "RayFleet": ".fleet",
    "FleetActor": ".roster",
    "start_fleet": ".roster",
    "stop_fleet": ".roster",
    "EngineActor": ".engine",
    "EngineLaunch": ".launch",
    "start_engine": ".engine",
    "stop_actors": ".engine",
    "wait_ready": ".engine",
    "RayTrainer": ".trainer",
    "TrainerError": ".trainer",
    "TrainerWorker": ".trainer",
    "local_cluster": ".cluster",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


__all__ = sorted(_EXPORTS)
