"""A real vLLM server started with the weightsync backend's guards in its environment: its own
token ($WEIGHTSYNC_VLLM_TOKEN: vLLM's --api-key covers only /v1/*), signed payloads
($WEIGHTSYNC_HMAC_KEY) and load roots ($WEIGHTSYNC_VLLM_LOAD_ROOTS). Whatever is refused leaves
the served version and weights as they were."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from weightsync import SyncError, WeightSync
from weightsync_vllm.testing import Live, start_live, vllm_available

HAVE_VLLM, WHY_NOT = vllm_available()
TOKEN = "vllm-backend-token-0123456789"
HMAC = "weights-hmac-key-0123456789abcdef"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Live, Path, list[int]]]:
    if not HAVE_VLLM:
        pytest.skip(reason=WHY_NOT)
    root = tmp_path_factory.mktemp("vllm-guarded")
    loads = root / "loads"
    loads.mkdir()
    env = {"WEIGHTSYNC_VLLM_TOKEN": TOKEN, "WEIGHTSYNC_HMAC_KEY": HMAC,
           "WEIGHTSYNC_VLLM_LOAD_ROOTS": str(loads)}
    for live in start_live("llama", root, env=env):
        yield live, loads, live.greedy()


def _changed(live: Live, seed: int) -> torch.nn.Module:
    model = copy.deepcopy(live.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05)
    return model


def _config(live: Live, transport: str, token: str | None, key_file: Path | None) -> dict[str, Any]:
    cfg = live.config(transport)
    cfg["engines"] = [{**e, "options": {}} for e in cfg["engines"]]     # no token from the spec
    cfg["adapter"] = {"kind": "vllm", "options": {"token": token} if token else {}}
    if key_file is not None:
        cfg["sync"] = {**cfg["sync"], "hmac_key_file": str(key_file)}
    return cfg


def test_calls_without_the_token_are_refused(guarded: tuple[Live, Path, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    live, _, _ = guarded
    monkeypatch.delenv("WEIGHTSYNC_VLLM_TOKEN", raising=False)
    before, out = live.weight_version(), live.greedy()
    with WeightSync.from_config(_config(live, "http", None, None)) as sync:
        with pytest.raises(SyncError) as e:
            sync.push(_changed(live, 1), version=7)
    assert "weightsync token missing" in str(e.value) and "option `token`" in str(e.value)
    with WeightSync.from_config(_config(live, "http", "not-the-token-at-all", None)) as sync:
        with pytest.raises(SyncError, match="weightsync token wrong"):
            sync.push(_changed(live, 1), version=7)
    assert live.weight_version() == before and live.greedy() == out


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_unsigned_payloads_are_refused_signed_ones_land(guarded: tuple[Live, Path, list[int]], tmp_path: Path,
                                                         transport: str) -> None:
    live, _, _ = guarded
    before, out = live.weight_version(), live.greedy()
    v = live.version() + 1
    model = _changed(live, 2 + v)
    with WeightSync.from_config(_config(live, transport, TOKEN, None)) as sync:
        with pytest.raises(SyncError, match="has no signature"):
            sync.push(model, version=v)
    assert live.weight_version() == before and live.greedy() == out
    key = tmp_path / "hmac.key"
    key.write_text(HMAC)
    with WeightSync.from_config(_config(live, transport, TOKEN, key)) as sync:
        report = sync.push(model, version=v + 1)
    assert report.ok and report.verified, report
    assert sorted(report.digests) == list(range(report.buckets))
    assert live.weight_version() == str(v + 1) and live.greedy() != out


def test_load_from_disk_only_below_the_load_roots(guarded: tuple[Live, Path, list[int]]) -> None:
    live, loads, served = guarded
    adapter = live.adapter()                  # with the server's token (its spec's options)
    before = live.weight_version()
    with pytest.raises(Exception, match="outside \\$WEIGHTSYNC_VLLM_LOAD_ROOTS"):
        adapter.load_from_disk(str(live.model_dir), 100)
    assert live.weight_version() == before
    (loads / "v0").symlink_to(live.model_dir, target_is_directory=True)   # a link out: refused too
    with pytest.raises(Exception, match="outside \\$WEIGHTSYNC_VLLM_LOAD_ROOTS"):
        adapter.load_from_disk(str(loads / "v0"), 100)
    inside = loads / "copy"
    inside.mkdir()
    for f in live.model_dir.iterdir():
        (inside / f.name).write_bytes(f.read_bytes())
    # the backend holds an HMAC key: only a checkpoint signed as that version loads
    with pytest.raises(Exception, match="is not signed"):
        adapter.load_from_disk(str(inside), 101)
    assert live.weight_version() == before
    from weightsync.wire.signing import checkpoint_signature
    with pytest.raises(Exception, match="signed as version 101, not 102"):
        adapter.load_from_disk(str(inside), 102,
                               signature=checkpoint_signature(HMAC.encode(), inside, 101))
    adapter.load_from_disk(str(inside), 101,
                           signature=checkpoint_signature(HMAC.encode(), inside, 101))
    assert live.weight_version() == "101"
    assert live.greedy() == served            # the served checkpoint again, whatever ran before


def test_a_server_without_a_token_refuses_updates_unless_insecure() -> None:
    """The backend's check itself (no server needed): without $WEIGHTSYNC_VLLM_TOKEN every call
    is refused, saying how to set one; $WEIGHTSYNC_VLLM_INSECURE=1 opens it on purpose."""
    if not HAVE_VLLM:
        pytest.skip(reason=WHY_NOT)
    from types import SimpleNamespace

    from weightsync.errors import PayloadError
    from weightsync_vllm.backend import WeightSyncTransferEngine
    authorize = WeightSyncTransferEngine._authorize
    with pytest.raises(PayloadError, match="has no \\$WEIGHTSYNC_VLLM_TOKEN.*restart it with"):
        authorize(SimpleNamespace(token=None, open=False), "anything")
    authorize(SimpleNamespace(token=None, open=True), None)            # insecure: accepted
    authorize(SimpleNamespace(token=TOKEN, open=False), TOKEN)
    with pytest.raises(PayloadError, match="weightsync token wrong"):
        authorize(SimpleNamespace(token=TOKEN, open=False), TOKEN + "x")
