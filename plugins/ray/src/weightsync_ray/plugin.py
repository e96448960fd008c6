"""Hook implementations only: the `ray` fleet source."""

from __future__ import annotations

from typing import Any, Callable

from weightsync import hookimpl


@hookimpl
def register_fleets(register: Callable[[type[Any]], None]) -> None:
    from weightsync_ray.fleet import RayFleet     # imports no Ray: only opening the fleet needs it
    register(RayFleet)
