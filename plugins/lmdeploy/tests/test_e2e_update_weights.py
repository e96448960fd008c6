"""End to end over LMDeploy's /update_weights (transport lmdeploy_ipc) against the stand-in
server process: three versions bit-exact, `finished` seen exactly once per sync."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from weightsync import WeightSync


def config(engine: dict[str, Any], bucket_bytes: int = 1500, encoding: str = "raw") -> dict[str, Any]:
    return {"exporter": {"kind": "torch", "options": {"bucket_bytes": bucket_bytes}},
            "encoding": encoding, "transport": "lmdeploy_ipc",
            "adapter": {"kind": "lmdeploy", "options": {"ipc_device": "cpu"}},
            "engines": [engine]}


def assert_weights(standin: Any, sd: dict[str, torch.Tensor]) -> None:
    for rank in range(standin.tp):
        got = standin.weights(rank)
        assert set(got) == set(sd)
        for n, t in sd.items():
            assert got[n].dtype == t.dtype and torch.equal(got[n], t), f"rank {rank}: {n} differs"


@pytest.mark.parametrize("backend,flattened,tp", [
    ("pytorch", True, 1), ("pytorch", False, 1), ("pytorch", True, 2), ("turbomind", False, 1)])
def test_three_versions_bit_exact(standin: Any, model_factory: Any, version_factory: Any,
                                  backend: str, flattened: bool, tp: int) -> None:
    sd = model_factory()
    eng = standin(sd, tp=tp, backend=backend)
    finished_before = 0
    with WeightSync.from_config(config(eng.spec(flattened=flattened))) as sync:
        for v in (1, 2, 3):
            sd = version_factory(sd, v)
            calls_before = eng.stats()["update_weights"]
            report = sync.push(sd, version=v)
            assert report.ok and not report.verified, report.summary()   # LMDeploy only acknowledges
            assert {o.status for o in report.engines.values()} == {"acknowledged"}
            assert report.buckets > 1          # several buckets, so finished must be held back
            stats = eng.stats()
            assert stats["finished"] == finished_before + 1, "finished=true must come exactly once per sync"
            finished_before = stats["finished"]
            log = stats["log"][-(stats["update_weights"] - calls_before):]
            assert [c["finished"] for c in log] == [False] * (len(log) - 1) + [True]
            assert {c["load_format"] for c in log} == {"flattened_bucket" if flattened else None}
            if backend == "turbomind":      # one call per decoder layer, one for the misc weights
                assert len(log) == 2 + 1
            assert not eng.is_sleeping()
            assert_weights(eng, sd)
            assert sync.adapters[0].health().version == v


def test_api_key_is_sent(standin: Any, model_factory: Any, version_factory: Any) -> None:
    sd = model_factory()
    eng = standin(sd, api_key="s3cret")
    with WeightSync.from_config(config(eng.spec())) as sync:
        sd = version_factory(sd, 1)
        assert sync.push(sd, version=1).ok
    assert_weights(eng, sd)
    keyless = {k: v for k, v in eng.spec().items() if k != "api_key"}
    with WeightSync.from_config(config(keyless)) as sync:
        from weightsync.errors import SyncError
        with pytest.raises(SyncError, match="HTTP 401"):
            sync.push(version_factory(sd, 2), version=2)
