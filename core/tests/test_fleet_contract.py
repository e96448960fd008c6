"""The built-in registry fleet passes the fleet contract (the same tests a third party's fleet
source runs), and the static fleet is the `engines:` list."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weightsync import WeightSync
from weightsync.fleets.client import RegistryClient
from weightsync.fleets.static import StaticFleet
from weightsync_reference.contracts import FleetContract
from weightsync_reference.processes import EngineProcess

KEY = "contract-fleet-key-0123"


class TestRegistryFleet(FleetContract):
    def fleet_config(self, tmp_path: Path) -> dict[str, Any]:
        return {"kind": "registry", "options": {"api_key": KEY, "lease": 5}}

    credentials: dict[str, str] = {}

    def add_member(self, sync: WeightSync, name: str, engine: EngineProcess) -> None:
        out = RegistryClient(sync.fleet_url, KEY).register({"name": name, "url": engine.url})
        self.credentials[name] = out["credential"]        # a member acts only as itself

    def remove_member(self, sync: WeightSync, name: str) -> None:
        RegistryClient(sync.fleet_url, KEY).deregister(name, self.credentials.pop(name))


def test_static_fleet_is_the_engines_list() -> None:
    from weightsync.config import EngineSpec
    specs = [EngineSpec(url="http://127.0.0.1:8100", name="a"), EngineSpec(url="http://127.0.0.1:8101")]
    fleet = StaticFleet(engines=specs)
    assert [m.name for m in fleet.members()] == ["a", "127.0.0.1:8101"]
    assert fleet.excluded() == {} and fleet.members()[0].spec is specs[0]


def test_a_member_marked_behind_is_live_again_once_it_holds_the_fleets_version() -> None:
    """A catch-up that lost a race with a push marks its member `behind` although the push
    brought it to the fleet's version; nothing else would ever make it `live` again."""
    from weightsync.fleets.roster import Registration, Roster
    roster = Roster(lease=30.0)
    roster.register(Registration(name="a", url="http://127.0.0.1:1", version=0))
    roster.register(Registration(name="b", url="http://127.0.0.1:2", version=0))
    roster.synced(3, {"a": 3, "b": 2})
    roster.set_state("b", "behind", "could not catch up from peer a")
    assert roster.members["b"].state == "behind"           # still at 2 of 3: behind it stays
    roster.synced(4, {"a": 4, "b": 4})                     # the next push reached it
    assert roster.members["b"].state == "live" and roster.members["b"].error is None
    roster.set_state("b", "behind", "pull refused: a round is open")   # the late loser of the race
    assert roster.members["b"].state == "live"
    roster.synced(5, {"a": 5})
    roster.set_state("b", "behind", "no peer")
    roster.heartbeat("b", version=5)                       # it reports the version it now holds
    assert roster.members["b"].state == "live"
