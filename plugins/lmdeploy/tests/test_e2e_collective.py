"""End to end over the core `collective` transport: a real gloo group across processes (the
trainer is rank 0; every stand-in TP rank is its own process joining with LMDeploy's
init_custom_process_group), LMDeploy's /init_weights_update_group,
/update_weights_from_distributed (flattened_bucket, one broadcast per dtype run) and
/destroy_weights_update_group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from weightsync import WeightSync

pytest.importorskip("weightsync.transports.collective",
                    reason="the core collective transport is not in this checkout")


def config(engines: list[dict[str, Any]]) -> dict[str, Any]:
    return {"exporter": {"kind": "torch", "options": {"bucket_bytes": 1500}},
            "transport": {"kind": "collective", "options": {"backend": "gloo", "timeout": 60}},
            "adapter": "lmdeploy", "engines": engines}


def test_three_versions_bit_exact_over_gloo(standin: Any, model_factory: Any,
                                            version_factory: Any) -> None:
    sd = model_factory()
    engines = [standin(sd, tp=1), standin(sd, tp=2)]      # world size 1 + 1 + 2
    with WeightSync.from_config(config([e.spec() for e in engines])) as sync:
        assert [a.group_size() for a in sync.adapters] == [1, 2]
        for v in (1, 2, 3):
            sd = version_factory(sd, v)
            before = [e.stats() for e in engines]
            report = sync.push(sd, version=v)
            assert report.ok and not report.verified, report.summary()   # LMDeploy only acknowledges
            assert {o.status for o in report.engines.values()} == {"acknowledged"}
            for e, b in zip(engines, before):
                s = e.stats()
                assert s["finished"] == b["finished"] + 1, "finished=true exactly once per sync"
                calls = s["log"][len(b["log"]):]
                assert len(calls) > report.buckets      # several dtype runs per bucket
                assert all(c["route"] == "update_weights_from_distributed" for c in calls)
                assert all(c["load_format"] == "flattened_bucket" and len(c["dtypes"]) == 1 for c in calls)
                assert [c["finished"] for c in calls] == [False] * (len(calls) - 1) + [True]
                assert s["init_group"] == 1              # the group outlives one sync
                for rank in range(e.tp):
                    got = e.weights(rank)
                    for n, t in sd.items():
                        assert torch.equal(got[n], t), f"{e.url} rank {rank}: {n} differs at v{v}"
                assert not e.is_sleeping()
    for e in engines:
        assert e.stats()["destroy_group"] >= 1           # close() asked every engine to leave


def test_turbomind_engine_is_refused_before_any_group() -> None:
    """Refused when the config is validated: no group is built, no engine is called."""
    from weightsync.errors import ConfigError
    spec = {"url": "http://127.0.0.1:9", "options": {"backend": "turbomind", "flattened": False}}
    with pytest.raises(ConfigError, match="TurboMind backend has no collective weight routes"):
        WeightSync.from_config(config([spec]))
