"""Item 4: the delta apply is a library call, so weightsync's own receiver (here: reference engine
processes) takes delta payloads over any transport: core's `http`, `shm` and `collective`, bit-exact."""

from pathlib import Path

import pytest
import requests

from weightsync import WeightSync
from weightsync_reference.processes import EngineProcess, start_all

from weightsync_disk_delta.testing import Trainer, bit_equal, weights_only


def _config(engines: list[dict], model_dir: Path) -> dict:
    return {"encoding": {"kind": "delta", "options": {"base_checkpoint": str(model_dir)}},
            "transport": "http", "adapter": "reference", "engines": engines,
            "exporter": {"kind": "torch", "options": {"bucket_bytes": "256KiB"}},
            "sync": {"progress": "off", "failure_policy": "continue"}}


def test_delta_through_http_is_bit_exact_and_refuses_a_wrong_base(tmp_path: Path) -> None:
    tr = Trainer(tmp_path / "model")
    served = weights_only(tmp_path / "model", tmp_path / "served")   # fast start, same tensors
    a, b = start_all([EngineProcess(served, log=tmp_path / "a.log"),
                      EngineProcess(served, log=tmp_path / "b.log")])
    late = EngineProcess(served, log=tmp_path / "late.log")
    try:
        with WeightSync.from_config(_config([a.spec(), b.spec()], tmp_path / "model")) as sync:
            for v in (1, 2, 3):
                tr.step()
                r = sync.push(tr.state(), version=v)
                assert r.ok and r.verified, r.summary()
                assert r.density is not None and 0 < r.density < 1
                assert r.wire_bytes < r.logical_bytes      # seeded from the checkpoint: deltas from v1
                for e in (a, b):
                    assert e.health()["version"] == v
                    assert bit_equal(e.weights(), tr.state()) == []
        # an engine still at version 0 never applies a delta made against version 3
        late.start()
        from safetensors.torch import save_file
        ckpt = tmp_path / "v3"                     # the trainer restarts, seeded from version 3
        ckpt.mkdir()
        save_file(tr.state(), str(ckpt / "model.safetensors"))
        cfg = _config([a.spec(), late.spec()], ckpt)
        cfg["encoding"]["options"]["base_version"] = 3
        with WeightSync.from_config(cfg) as sync:
            tr.step()
            r = sync.push(tr.state(), version=4)
            assert r.engines[a.name].ok and a.health()["version"] == 4
            assert bit_equal(a.weights(), tr.state()) == []
            late_r = r.engines[late.name]
            if late_r.ok:      # core catches up an engine behind the fleet with whole tensors
                assert getattr(late_r, "caught_up", False), late_r
                assert late.health()["version"] == 4 and bit_equal(late.weights(), tr.state()) == []
            else:              # without catch-up, the receiver refuses the delta: nothing applied
                assert "made against version 3, but the engine holds version 0" in late_r.error
                assert late.health()["version"] == 0
    finally:
        for e in (a, b, late):
            e.stop()


def test_reference_engine_load_from_disk_checks_before_applying(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    tr = Trainer(tmp_path / "model")
    with EngineProcess(tmp_path / "model", log=tmp_path / "e.log") as e:   # a full HF model engine
        before = e.weights()
        tr.step()
        good = tmp_path / "good"
        good.mkdir()
        save_file({n: t.contiguous() for n, t in tr.state().items()}, str(good / "model.safetensors"))
        bad = tmp_path / "bad"
        bad.mkdir()
        state = tr.state()
        name = next(iter(state))
        state[name] = torch.zeros(3, 3, dtype=state[name].dtype)
        save_file({n: t.contiguous() for n, t in state.items()}, str(bad / "model.safetensors"))
        r = requests.post(e.url + "/weightsync/load_from_disk", json={"path": str(bad), "version": 5},
                          timeout=30)
        assert r.status_code == 400 and "shape [3, 3] sent" in r.json()["error"]
        assert e.health()["version"] == 0 and bit_equal(e.weights(), before) == []
        r = requests.post(e.url + "/weightsync/load_from_disk",
                          json={"path": str(tmp_path / "nope"), "version": 5}, timeout=30)
        assert r.status_code == 400 and "does not exist" in r.json()["error"]
        from weightsync_reference.adapter import ReferenceAdapter
        from weightsync.config import EngineSpec
        ad = ReferenceAdapter(None, EngineSpec(url=e.url))
        ad.load_from_disk(str(good), 5)
        assert e.health()["version"] == 5 and bit_equal(e.weights(), tr.state()) == []
        ad.close()


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_delta_through_shm_and_collective_is_bit_exact(tmp_path: Path, transport: str) -> None:
    """The same deltas over core's other two transports (a gloo group for `collective`)."""
    tr = Trainer(tmp_path / "model")
    served = weights_only(tmp_path / "model", tmp_path / "served")
    engines = start_all([EngineProcess(served, log=tmp_path / f"{n}.log") for n in "ab"])
    try:
        cfg = _config([e.spec() for e in engines], tmp_path / "model")
        cfg["transport"] = transport
        with WeightSync.from_config(cfg) as sync:
            for v in (1, 2):
                tr.step()
                r = sync.push(tr.state(), version=v)
                assert r.ok and r.verified, r.summary()
                assert r.density is not None and 0 < r.density < 1 and r.wire_bytes < r.logical_bytes
                for e in engines:
                    assert e.health()["version"] == v and bit_equal(e.weights(), tr.state()) == []
    finally:
        for e in engines:
            e.stop()
