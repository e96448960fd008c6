"""Bad input: combinations LMDeploy cannot do are refused when the config is validated (with a
sentence saying what works), LMDeploy's error replies are raised with their message, and a
failed sync applies nothing: the stand-in keeps the old weights, never sees finished=true, stays
asleep, and the version does not move."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from weightsync import WeightSync
from weightsync.config import EngineSpec
from weightsync.errors import ConfigError, EngineError, SyncError, WeightSyncError
from weightsync.interfaces import Message
from weightsync.transports.collective import Broadcast, JoinGroup, LeaveGroup
from weightsync_lmdeploy.adapter import LmdeployAdapter, LmdeployOptions

LOCAL = "http://127.0.0.1:9"


def cfg(transport: Any = "lmdeploy_ipc", adapter: Any = "lmdeploy", **options: Any) -> dict[str, Any]:
    return {"transport": transport, "adapter": adapter, "engines": [{"url": LOCAL, "options": options}]}


@pytest.mark.parametrize("config,message", [
    (cfg(backend="vllm"), "'vllm' is not an LMDeploy backend; use 'pytorch'"),
    (cfg(backend="turbomind"), "set flattened: false"),
    (cfg(backend="turbomind", flattened=True), "TurboMind backend takes only plain /update_weights"),
    (cfg(transport={"kind": "collective", "options": {"backend": "gloo"}}, backend="turbomind",
         flattened=False), "TurboMind backend has no collective weight routes"),
    (cfg(transport="collective", flattened=False), "reads only with load_format flattened_bucket"),
    (cfg(adapter="reference"), "adapter 'reference' cannot receive over transport 'lmdeploy_ipc'"),
    (cfg(transport="shm"), "adapter 'lmdeploy' cannot receive over transport 'shm'"),
    (cfg(tp_size=0), "tp_size"),
    (cfg(sleep_level=3), "sleep_level"),
    ({**cfg(), "encoding": {"kind": "cast", "options": {"dtype": "bfloat16"}},
      "sync": {"pause_mode": "keep"}}, "pause_mode 'keep' is not supported by adapter 'lmdeploy'"),
])
def test_refused_when_config_is_validated(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        WeightSync.from_config(config)
    assert message in str(e.value)


def test_ipc_transport_refuses_remote_engines() -> None:
    config = {"transport": "lmdeploy_ipc", "adapter": "lmdeploy",
              "engines": [{"url": "http://10.1.2.3:23333"}]}
    with pytest.raises(ConfigError, match="only reaches engines on this host.*'collective'"):
        WeightSync.from_config(config)


def test_turbomind_with_plain_calls_is_accepted() -> None:
    with WeightSync.from_config(cfg(backend="turbomind", flattened=False)) as sync:
        assert sync.adapters[0].options.backend == "turbomind"


def test_error_reply_is_raised_with_lmdeploys_message(standin: Any, model_factory: Any) -> None:
    eng = standin(model_factory())
    a = LmdeployAdapter(LmdeployOptions(ipc_device="cpu"), EngineSpec(url=eng.url))
    header = {"index": 0, "last": True, "digest": "x", "tensors": [{"name": "model.norm.weight",
              "dtype": "float32", "shape": [16]}],
              "transport": {"group_name": "never_joined", "layout": "flat_per_dtype", "dtype": "float32",
                            "numel": 16, "nbytes": 64, "tensors": [{"name": "model.norm.weight",
                                                                    "dtype": "float32", "shape": [16]}]}}
    with pytest.raises(EngineError, match=r"group 'never_joined' not initialized\. "
                                          r"Call init_weights_update_group first\."):
        a.deliver(Broadcast(header))
    with pytest.raises(EngineError, match="group_name: String should have at least|group_name cannot be empty"):
        a._checked("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                  "rank_offset": 1, "world_size": 2, "group_name": "",
                                                  "backend": "gloo"}, 10)


def test_turbomind_engine_answers_501_to_group_routes(standin: Any, model_factory: Any) -> None:
    eng = standin(model_factory(), backend="turbomind")
    a = LmdeployAdapter(LmdeployOptions(backend="turbomind", flattened=False), EngineSpec(url=eng.url))
    with pytest.raises(EngineError, match='HTTP 501: Disaggregated weight-update endpoints require '
                                          'backend="pytorch"'):
        a.deliver(JoinGroup({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                             "world_size": 2, "group_name": "g", "backend": "gloo"}))


def test_messages_it_does_not_translate_are_refused() -> None:
    class Other(Message):
        kind = "other.verb"
    a = LmdeployAdapter(LmdeployOptions(), EngineSpec(url=LOCAL))
    with pytest.raises(WeightSyncError, match="adapter 'lmdeploy' takes no transport messages "
                                              "\\('other.verb' refused\\)"):
        a.deliver(Other({}))
    assert a.deliver(LeaveGroup({})) == {}            # no group named: nothing to destroy


def bad_last_tensor(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model whose last tensor LMDeploy cannot load: earlier calls succeed first."""
    return {**sd, "model.layers.9.not_a_parameter": torch.ones(4)}


@pytest.mark.parametrize("transport", ["lmdeploy_ipc", "collective"])
def test_failed_sync_applies_nothing(standin: Any, model_factory: Any, version_factory: Any,
                                     transport: str) -> None:
    v0 = model_factory()
    eng = standin(v0)
    tr = {"kind": transport, "options": {"backend": "gloo", "timeout": 60} if transport == "collective" else {}}
    config = {"exporter": {"kind": "torch", "options": {"bucket_bytes": 1500}}, "transport": tr,
              "adapter": {"kind": "lmdeploy", "options": {"ipc_device": "cpu"}},
              "engines": [eng.spec()]}
    with WeightSync.from_config(config) as sync:
        v1 = version_factory(v0, 1)
        assert sync.push(v1, version=1).ok
        before = eng.stats()
        with pytest.raises(SyncError) as e:
            sync.push(bad_last_tensor(version_factory(v1, 2)), version=2)
        assert "model.layers.9.not_a_parameter is not a parameter of this model" in str(e.value) \
            or "HTTP 500" in str(e.value)
        after = eng.stats()
        calls = after["update_weights"] + after["update_weights_from_distributed"] - \
            before["update_weights"] - before["update_weights_from_distributed"]
        assert calls > 1, "earlier calls of the failed sync did reach the engine"
        assert after["finished"] == before["finished"], "finished=true must not be sent"
        got = eng.weights()
        for n, t in v1.items():
            assert torch.equal(got[n], t), f"{n} was half applied"
        assert eng.is_sleeping(), "an engine that may hold a mix must stay asleep"
        assert sync.adapters[0].health().version == 1
        v3 = version_factory(v1, 3)
        report = sync.push(v3, version=3)           # the next whole sync repairs and wakes it
        assert report.ok and not report.verified, report.summary()   # LMDeploy only acknowledges
        assert {o.status for o in report.engines.values()} == {"acknowledged"}
        assert not eng.is_sleeping()
        got = eng.weights()
        assert all(torch.equal(got[n], t) for n, t in v3.items())
