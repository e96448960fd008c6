"""Fleet `ray` passes the fleet contract (the tests every fleet source runs): members join by
registering with the named fleet actor, leave by deregistering, and a push reaches exactly the
members that are in it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from weightsync import WeightSync
from weightsync_reference.contracts import FleetContract
from weightsync_reference.processes import EngineProcess

NAMESPACE = "weightsync-contract"


def _name(tmp_path: Path) -> str:
    return "fleet-" + tmp_path.name


class TestRayFleet(FleetContract):
    @pytest.fixture(autouse=True)
    def _fleet_actor(self, cluster: dict[str, str], tmp_path: Path) -> Iterator[None]:
        """The fleet actor is detached: each test ends its own."""
        yield
        from weightsync_ray.roster import stop_fleet
        stop_fleet(_name(tmp_path), NAMESPACE)

    def fleet_config(self, tmp_path: Path) -> dict[str, Any]:
        return {"kind": "ray", "options": {"name": _name(tmp_path), "namespace": NAMESPACE,
                                           "lease": 5}}

    def _actor(self, sync: WeightSync) -> Any:
        from weightsync_ray.roster import find_fleet
        return find_fleet(sync.fleet.options.name, sync.fleet.options.namespace)

    def add_member(self, sync: WeightSync, name: str, engine: EngineProcess) -> None:
        import ray
        ray.get(self._actor(sync).register.remote({"name": name, "url": engine.url}), timeout=30)

    def remove_member(self, sync: WeightSync, name: str) -> None:
        import ray
        assert ray.get(self._actor(sync).deregister.remote(name), timeout=30)


def test_engines_and_a_ray_fleet_are_refused_together(cluster: dict[str, str]) -> None:
    from weightsync.errors import ConfigError
    cfg = {"fleet": {"kind": "ray"}, "engines": [{"url": "http://127.0.0.1:8100"}]}
    with pytest.raises(ConfigError, match="`engines` lists a static fleet, but `fleet` is 'ray'"):
        WeightSync.from_config(cfg)
