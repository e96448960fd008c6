"""The built-in registry fleet passes the fleet contract (the same tests a third party's fleet
source runs), and the static fleet is the `engines:` list."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weightsync import WeightSync
from weightsync.fleet.client import RegistryClient
from weightsync.fleet.static import StaticFleet
from weightsync.testing import EngineProcess, FleetContract

KEY = "contract-fleet-key-0123"


class TestRegistryFleet(FleetContract):
    def fleet_config(self, tmp_path: Path) -> dict[str, Any]:
        return {"kind": "registry", "options": {"api_key": KEY, "lease": 5}}

    def add_member(self, sync: WeightSync, name: str, engine: EngineProcess) -> None:
        RegistryClient(sync.fleet_url, KEY).register({"name": name, "url": engine.url})

    def remove_member(self, sync: WeightSync, name: str) -> None:
        RegistryClient(sync.fleet_url, KEY).deregister(name)


def test_static_fleet_is_the_engines_list() -> None:
    from weightsync.config import EngineSpec
    specs = [EngineSpec(url="http://127.0.0.1:8100", name="a"), EngineSpec(url="http://127.0.0.1:8101")]
    fleet = StaticFleet(engines=specs)
    assert [m.name for m in fleet.members()] == ["a", "127.0.0.1:8101"]
    assert fleet.excluded() == {} and fleet.members()[0].spec is specs[0]
