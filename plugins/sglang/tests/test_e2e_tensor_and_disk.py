"""End to end against the SGLang stand-in (a real server process that follows
docs/engines.md, SGLang): /update_weights_from_tensor through transport `sglang_tensor`,
and /update_weights_from_disk through `load_from_disk`, three versions bit-exact each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from weightsync.config import EngineSpec
from weightsync.errors import ConfigError, EngineError, SyncError
from weightsync.sync.pipeline import WeightSync
from weightsync.testing.sample import perturb, write_weights_only_model
from weightsync_sglang.adapter import SGLangAdapter


def _config(engines: list[dict], transport: str = "sglang_tensor", **sync: object) -> dict:
    return {"adapter": "sglang", "transport": transport, "engines": engines,
            "exporter": {"kind": "torch", "options": {"bucket_bytes": 4096}},
            "sync": {"failure_policy": "continue", **sync}}


def _assert_holds(engine, sd: dict[str, torch.Tensor]) -> None:
    got = engine.weights()
    assert set(got) == set(sd)
    for n, t in sd.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), f"{n} differs"


def test_tensor_route_three_versions_bit_exact(start_standin, model_sd) -> None:
    engines = [start_standin(tp_size=1, admin_key="s3cret"), start_standin(tp_size=2)]
    sd = model_sd
    with WeightSync.from_config(_config([e.spec() for e in engines])) as sync:
        for v in (1, 2, 3):
            sd = perturb(sd, v)
            report = sync.push(sd, version=v)
            assert report.ok and report.verified, report.summary()
            assert report.buckets > 1
            for e in engines:
                assert e.weight_version() == str(v)
                _assert_holds(e, sd)
    for e in engines:   # one load per bucket (every TP rank decoded its own entry), one flush per version
        st = e.state()
        assert st["updates"] == report.buckets * 3 and st["flushes"] == 3


def test_tensor_route_refused_for_remote_engine_and_other_adapters(start_standin) -> None:
    with pytest.raises(ConfigError, match="only reaches engines on this host"):
        WeightSync.from_config(_config([{"url": "http://10.1.2.3:30000"}]))
    cfg = _config([{"url": "http://127.0.0.1:30000"}])
    cfg["adapter"] = "reference"
    with pytest.raises(ConfigError, match="cannot receive over transport 'sglang_tensor'"):
        WeightSync.from_config(cfg)
    cfg = _config([{"url": "http://127.0.0.1:30000"}], transport="http")
    with pytest.raises(ConfigError, match="cannot receive over transport 'http'"):
        WeightSync.from_config(cfg)


def test_unknown_tensor_is_refused_with_sglangs_message_and_version_kept(start_standin, model_sd) -> None:
    engine = start_standin()
    bad = {**model_sd, "no.such.tensor": torch.zeros(3)}
    with WeightSync.from_config(_config([engine.spec()])) as sync, pytest.raises(SyncError) as e:
        sync.push(bad, version=1)
    assert "SGLang refused POST /update_weights_from_tensor" in str(e.value)
    assert "no.such.tensor" in str(e.value) and "is not a parameter" in str(e.value)
    assert engine.weight_version() == "default"
    assert SGLangAdapter(engine=EngineSpec(**engine.spec(tp_size=1))).health().version == 0


def test_disk_route_three_versions_bit_exact(start_standin, model_sd, tmp_path: Path) -> None:
    engine = start_standin(admin_key="k")
    a = SGLangAdapter(SGLangAdapter.Options(), EngineSpec(**engine.spec()))
    sd = model_sd
    for v in (1, 2, 3):
        sd = perturb(sd, v)
        ckpt = write_weights_only_model(tmp_path / f"ckpt_v{v}", sd)
        a.load_from_disk(str(ckpt), v)
        assert a.health().version == v and engine.weight_version() == str(v)
        _assert_holds(engine, sd)


def test_disk_route_failure_raises_sglang_message_and_keeps_weights(start_standin, model_sd,
                                                                    tmp_path: Path) -> None:
    engine = start_standin()
    a = SGLangAdapter(engine=EngineSpec(**engine.spec()))
    bad = {**perturb(model_sd, 1), "model.norm.weight": torch.zeros(5)}
    ckpt = write_weights_only_model(tmp_path / "bad", bad)
    with pytest.raises(EngineError, match="(?s)SGLang refused POST /update_weights_from_disk: Failed to "
                                          "update weights: .*Rolling back"):
        a.load_from_disk(str(ckpt), 1)
    with pytest.raises(EngineError, match="no \\*.safetensors"):
        a.load_from_disk(str(tmp_path / "missing"), 1)
    assert a.health().version == 0
    _assert_holds(engine, model_sd)


def test_wrong_api_key_is_reported(start_standin) -> None:
    engine = start_standin(admin_key="right")
    spec = {**engine.spec(), "api_key": "wrong"}
    a = SGLangAdapter(engine=EngineSpec(**spec))
    with pytest.raises(EngineError, match="HTTP 401"):
        a.pause("abort")


def test_cast_encoding_feeds_a_bf16_engine_from_fp32_weights(start_standin, tmp_path: Path,
                                                             model_sd) -> None:
    """An fp32 trainer, a bf16 SGLang: `cast` sends bf16 bytes, SGLang loads them as they are."""
    fp32 = {n: (t.float() if t.is_floating_point() else t) for n, t in model_sd.items()}
    bf16 = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in model_sd.items()}
    engine = start_standin(model=write_weights_only_model(tmp_path / "bf16", bf16))
    cfg = _config([engine.spec()])
    cfg["encoding"] = {"kind": "cast", "options": {"dtype": "bfloat16"}}
    new = perturb(fp32, 1)
    with WeightSync.from_config(cfg) as sync:
        report = sync.push(new, version=1)
    assert report.ok and report.verified, report.summary()
    _assert_holds(engine, {n: (t.to(torch.bfloat16) if t.is_floating_point() else t)
                           for n, t in new.items()})


def test_outcome_is_acknowledged_without_readback_and_readback_catches_wrong_values(
        start_standin, model_sd) -> None:
    """SGLang cannot hash what it loaded: without read-back the outcome says `acknowledged`, not
    `verified`; with read-back (the default) a load that landed other values fails the engine."""
    import requests
    eng = start_standin()
    sd = perturb(model_sd, 1)
    spec = {**eng.spec(), "options": {"readback": False}}
    with WeightSync.from_config(_config([spec])) as sync:
        r = sync.push(sd, version=1)
        assert r.ok and not r.verified and r.engines[eng.name].status == "acknowledged"
        assert "1 acknowledged" in r.summary()
    requests.post(eng.url + "/standin/corrupt_loads", json={"on": True}, timeout=10).raise_for_status()
    with WeightSync.from_config(_config([eng.spec()])) as sync, pytest.raises(SyncError) as err:
        sync.push(perturb(sd, 2), version=2)
    r = err.value.report
    o = r.engines[eng.name]
    assert not r.ok and o.status == "failed" and o.stage == "confirm", r.summary()
    assert "read back through /get_weights_by_name differs" in o.error
