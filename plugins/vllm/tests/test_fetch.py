"""http payloads reach the vLLM worker in binary: the adapter publishes each body on the trainer's
body server and /update_weights carries only a one-time reference, which the worker fetches
straight into its staging tensors (checked without a server here; live in test_live_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from weightsync.wire.bucket import Bucket
from weightsync.config import EngineSpec
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import PayloadError
from weightsync.transports.http.sending import HttpReceiver, HttpTransport
from weightsync_vllm.adapter import VllmAdapter, VllmOptions
from weightsync_vllm.bodies import render_fetch
from weightsync_vllm.staging import CheckpointIndex, StagedRound
from weightsync_vllm.testing import vllm_available

HAVE_VLLM, WHY_NOT = vllm_available()


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [("model.embed_tokens.weight", torch.randn(160, 80, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.ones(80)),
            ("lm_head.weight", torch.randn(160, 80, generator=g).to(torch.bfloat16))]


@pytest.fixture
def index(tmp_path: Path) -> CheckpointIndex:
    save_file(dict(_named()), str(tmp_path / "model.safetensors"))
    return CheckpointIndex(tmp_path)


def _adapter() -> VllmAdapter:
    return VllmAdapter(VllmOptions(), EngineSpec(url="http://127.0.0.1:9"))


def test_the_adapter_publishes_each_body_once_and_sends_a_reference(index: CheckpointIndex) -> None:
    a = _adapter()
    try:
        a.round_id = "r1"
        ep = a.payload_endpoint()
        new = [(n, t + 1) for n, t in _named()]
        p = RawEncoding().encode(Bucket(0, new, last=True))
        parts, ctype = ep.render(p.header(), p.body)
        info = json.loads(b"".join(parts))["update_info"]
        assert ctype == "application/json" and info["round"] == "r1"
        assert "body_b64" not in info and info["fetch"]["nbytes"] == p.body.numel()
        assert info["fetch"]["url"].startswith("http://127.0.0.1:")
        assert len(b"".join(parts)) < 4096                       # no payload bytes in the JSON
        r = StagedRound(index, RawEncoding(), HttpReceiver(HttpTransport.Options()), 1)
        d = r.stage_fetched(info["header"], info["fetch"])
        assert d == p.digest and r.end() == {0: d}
        assert all(torch.equal(r.staged[n], t) for n, t in new)
        with pytest.raises(Exception, match="404"):               # fetched once, then gone
            r.stage_fetched(info["header"], info["fetch"])
        p2 = RawEncoding().encode(Bucket(1, new[:1], last=True))
        parts2, _ = ep.render(p2.header(), p2.body)              # the previous one is withdrawn
        assert a._bodies.published() == 1
        a.abort()                                                # the round's bodies go with it
        assert a._bodies.published() == 0
    finally:
        a.close()


def test_a_fetched_body_is_checked_like_an_inline_one(index: CheckpointIndex) -> None:
    from weightsync.net.bodyserver import BodyServer
    server = BodyServer()
    try:
        r = StagedRound(index, RawEncoding(), HttpReceiver(HttpTransport.Options()), 1)
        bad = RawEncoding().encode(Bucket(0, [("model.norm.weight", torch.ones(9))], last=True))
        with pytest.raises(PayloadError, match=r"\[9\]"):
            r.stage_fetched(bad.header(), server.publish(bad.body))
        p = RawEncoding().encode(Bucket(0, _named()[:1], last=True))
        body = p.body.clone()
        body[-1] ^= 0xFF
        with pytest.raises(PayloadError, match="digest"):
            r.stage_fetched(p.header(), server.publish(body))
        with pytest.raises(PayloadError, match="fetch reference"):
            r.stage_fetched(p.header(), {**server.publish(p.body), "nbytes": 3})
        assert r.staged == {}
    finally:
        server.close()


def test_render_fetch_is_json_only() -> None:
    parts, ctype = render_fetch({"index": 0}, {"url": "http://x/y?id=1", "token": "t", "nbytes": 3}, "r")
    assert json.loads(b"".join(parts)) == {"update_info": {"round": "r", "header": {"index": 0},
                                                           "fetch": {"url": "http://x/y?id=1",
                                                                     "token": "t", "nbytes": 3}}}


@pytest.mark.skipif(not HAVE_VLLM, reason=WHY_NOT or "vLLM is importable")
def test_backend_update_info_takes_a_fetch_reference() -> None:
    from weightsync_vllm.backend import WeightSyncUpdateInfo
    info = WeightSyncUpdateInfo(header={"index": 0}, fetch={"url": "http://x", "token": "t", "nbytes": 1},
                                round="r")
    assert info.fetch["token"] == "t" and info.body_b64 is None
