"""Bad input: SGLang's `success: false` is raised with SGLang's own message, naming the engine
and the route; configurations that cannot work are refused before anything runs."""

from __future__ import annotations

import pytest
import requests
from weightsync.config import EngineSpec
from weightsync.errors import ConfigError, EngineError, WeightSyncError
from weightsync.interfaces import Message
from weightsync.sync.pipeline import WeightSync
from weightsync.net.server import free_port
from weightsync.transports.collective import Broadcast, JoinGroup, LeaveGroup
from weightsync_sglang.adapter import SGLangAdapter
from weightsync_sglang.versions import from_sglang, to_sglang


def _header(group: str) -> dict:
    return {"index": 0, "digest": "d", "transport": {
        "group_name": group, "layout": "flat", "nbytes": 8, "dtype": "uint8", "numel": 8,
        "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [2]}]}}


def test_distributed_update_without_group_raises_sglangs_message(start_standin) -> None:
    engine = start_standin()
    a = SGLangAdapter(engine=EngineSpec(**engine.spec()))
    a.begin(1, {})
    with pytest.raises(EngineError) as e:
        a.deliver(Broadcast(_header("never_joined")))
    msg = str(e.value)
    assert msg.startswith(f"engine {engine.name}: SGLang refused POST /update_weights_from_distributed")
    assert "Group never_joined not in []" in msg and "partially updated" in msg
    assert a.end() == {}            # nothing acknowledged: the pipeline will not verify it


def test_join_that_cannot_reach_the_store_raises_sglangs_message(start_standin) -> None:
    engine = start_standin(group_timeout=2.0)
    a = SGLangAdapter(engine=EngineSpec(**engine.spec()))
    info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
            "world_size": 2, "group_name": "g", "backend": "gloo"}
    with pytest.raises(EngineError, match="SGLang refused POST /init_weights_update_group: Failed "
                                          "to initialize custom process group"):
        a.deliver(JoinGroup(info))
    assert engine.state()["rank_groups"] == [[]]
    # leaving a group the engine does not have is SGLang's refusal too (the transport ignores it)
    with pytest.raises(EngineError, match="The group to be destroyed does not exist"):
        a.deliver(LeaveGroup(info))


def test_malformed_body_is_reported_with_fastapis_detail(start_standin) -> None:
    engine = start_standin()
    a = SGLangAdapter(engine=EngineSpec(**engine.spec()))
    with pytest.raises(EngineError, match="HTTP 422"):
        a._post("/update_weights_from_distributed", {"names": ["x"]})
    r = requests.post(engine.url + "/update_weights_from_disk", json={"model_path": "/x", "rid": "r1",
                                                                     "not_a_field": 1}, timeout=10)
    assert r.status_code == 400 and r.json()["success"] is False   # unknown keys are ignored


def test_unreachable_engine_names_itself() -> None:
    a = SGLangAdapter(engine=EngineSpec(url=f"http://127.0.0.1:{free_port()}", name="gone"))
    with pytest.raises(EngineError, match="engine gone: .*cannot connect"):
        a.health()


def test_foreign_weight_version_is_a_clear_error(start_standin) -> None:
    engine = start_standin()
    requests.post(engine.url + "/update_weight_version", json={"new_version": "rl_step_x"}, timeout=10)
    with pytest.raises(EngineError, match="weight_version 'rl_step_x' was not written by weightsync"):
        SGLangAdapter(engine=EngineSpec(**engine.spec())).health()


def test_version_strings_round_trip() -> None:
    assert [to_sglang(v) for v in (0, 7)] == ["0", "7"]
    assert from_sglang("default") == 0 and from_sglang(None) == 0 and from_sglang("12") == 12
    assert from_sglang(to_sglang(5, "step_"), "step_") == 5
    with pytest.raises(ValueError):
        from_sglang("step_5")


def test_delta_encoding_is_refused() -> None:
    """SGLang loads the tensors it is given; a delta would overwrite weights with differences."""
    cfg = {"adapter": "sglang", "transport": "collective", "encoding": "delta",
           "engines": [{"url": "http://127.0.0.1:30000"}]}
    with pytest.raises(ConfigError, match="cannot apply encoding 'delta' natively; use one of "
                                          "\\['cast', 'raw'\\]"):
        WeightSync.from_config(cfg)


def test_unknown_pause_mode_and_option_are_refused() -> None:
    cfg = {"adapter": "sglang", "transport": "collective", "engines": [{"url": "http://127.0.0.1:30000"}],
           "sync": {"pause_mode": "wait"}}
    with pytest.raises(ConfigError, match="pause_mode 'wait' is not supported by adapter 'sglang'"):
        WeightSync.from_config(cfg)
    cfg = {"adapter": {"kind": "sglang", "options": {"tp": 2}}, "transport": "collective",
           "engines": [{"url": "http://127.0.0.1:30000"}]}
    with pytest.raises(ConfigError, match="tp_size"):
        WeightSync.from_config(cfg)


def test_messages_it_does_not_translate_are_refused_and_shm_is_refused() -> None:
    """The adapter translates the collective transport's messages only; a bare Announce (a body in
    shared memory, which SGLang cannot read) is not a Broadcast, so `shm` is refused at config load."""
    class Other(Message):
        kind = "other.verb"
    a = SGLangAdapter()
    with pytest.raises(WeightSyncError, match="adapter 'sglang' takes no transport messages "
                                              "\\('other.verb' refused\\)"):
        a.deliver(Other({}))
    assert a.deliver(LeaveGroup({})) == {}            # no group named: nothing to destroy
    cfg = {"adapter": "sglang", "transport": "shm", "engines": [{"url": "http://127.0.0.1:30000"}]}
    with pytest.raises(ConfigError, match="adapter 'sglang' cannot receive over transport 'shm' \\(it "
                                         "lacks message Announce"):
        WeightSync.from_config(cfg)
