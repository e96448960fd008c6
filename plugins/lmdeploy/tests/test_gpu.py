"""The CUDA IPC path of /update_weights (what real LMDeploy takes): the trainer's tensors travel
as CUDA IPC handles and the stand-in rebuilds them with rebuild argument 6 set to its current
device, as LMDeploy's update_params does. Needs a CUDA device (`-m gpu`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from weightsync import WeightSync

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("flattened", [True, False])
def test_cuda_ipc_three_versions_bit_exact(standin: Any, model_factory: Any, version_factory: Any,
                                           flattened: bool) -> None:
    sd = model_factory()
    eng = standin(sd)
    cfg = {"exporter": {"kind": "torch", "options": {"bucket_bytes": 1500}}, "transport": "lmdeploy_ipc",
           "adapter": {"kind": "lmdeploy", "options": {"ipc_device": "cuda", "flattened": flattened}},
           "engines": [eng.spec()]}
    with WeightSync.from_config(cfg) as sync:
        for v in (1, 2, 3):
            sd = version_factory(sd, v)
            report = sync.push({k: t.cuda() for k, t in sd.items()}, version=v)
            assert report.ok and not report.verified, report.summary()   # LMDeploy only acknowledges
            assert {o.status for o in report.engines.values()} == {"acknowledged"}
            got = eng.weights()
            assert all(torch.equal(got[n], t) for n, t in sd.items())
