"""LoRA policies (issue 15, item 4), without an engine: a PEFT model exports merged under the base
model's names with the bytes `merge_and_unload()` + `save_pretrained` give (dense and MoE, in
checkpoint layout), merging one tensor at a time as buckets are built; the adapter alone is
written as PEFT writes it. The live-vLLM halves are in plugins/vllm/tests/test_live_lora.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from weightsync.exporters.lora import adapter_config, adapter_tensors, write_adapter
from weightsync.exporters.torch import TorchExporter

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def llama(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    from weightsync_reference.models import tiny_config
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", vocab=256)).to(dtype)


def moe(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    from weightsync_reference.models import tiny_moe_config
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe", vocab=256)).to(dtype)


def wrap(model: torch.nn.Module, **kw) -> torch.nn.Module:
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kw)
    return peft.get_peft_model(model, cfg)


def merged_and_saved(pm: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    copy.deepcopy(pm).merge_and_unload().save_pretrained(path)
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def exported(model, bucket_bytes: int = 4096) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: t for b in TorchExporter(TorchExporter.Options(bucket_bytes=bucket_bytes)).buckets(model)
            for n, t in b.tensors}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n].contiguous(), t), n


def test_merged_dense_equals_merge_and_unload(tmp_path: Path) -> None:
    pm = wrap(llama(), target_modules=["q_proj", "v_proj", "gate_proj", "embed_tokens"],
              modules_to_save=["lm_head"])
    with torch.no_grad():                      # the copy PEFT trains instead of lm_head
        pm.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    want = merged_and_saved(pm, tmp_path)
    got = exported(pm)
    assert_same(got, want)
    base = pm.get_base_model()
    # untouched weights are the model's own tensors, not copies
    k = base.model.layers[0].self_attn.k_proj.weight
    assert got["model.layers.0.self_attn.k_proj.weight"].data_ptr() == k.data_ptr()
    # and the merge really changed the adapted ones
    q = base.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], q)


def test_merged_moe_experts_in_checkpoint_layout(tmp_path: Path) -> None:
    """LoRA on the fused expert parameters (PEFT's target_parameters) and on attention: merged,
    then split per expert as the checkpoint holds them."""
    pm = wrap(moe(), target_modules=["q_proj"],
              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    want = merged_and_saved(pm, tmp_path)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in want
    assert_same(exported(pm), want)


def test_lora_bias_merges(tmp_path: Path) -> None:
    from weightsync_reference.models import tiny_config
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab=256))   # q/k/v have biases
    pm = wrap(base, target_modules=["q_proj", "k_proj"], lora_bias=True)
    with torch.no_grad():                      # lora_B's bias starts at zero: give it values
        for name, p in pm.named_parameters():
            if "lora_B" in name and name.endswith("bias"):
                p.normal_()
    assert_same(exported(pm), merged_and_saved(pm, tmp_path))


def test_merging_happens_bucket_by_bucket(monkeypatch) -> None:  # noqa: ANN001
    """Each adapted tensor is merged when its bucket is built, never all of them up front."""
    from peft.tuners.lora.layer import Linear
    pm = wrap(llama(), target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    calls = []
    real = Linear.get_delta_weight
    monkeypatch.setattr(Linear, "get_delta_weight", lambda self, a: calls.append(1) or real(self, a))
    merged_so_far = 0
    for bucket in TorchExporter(TorchExporter.Options(bucket_bytes=8192)).buckets(pm):
        merged_so_far += sum(n.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight",
                                         "down_proj.weight")) for n in bucket.names)
        assert len(calls) <= merged_so_far + 1          # at most the next tensor ahead
    assert len(calls) == merged_so_far == 8


def test_lora_variants_are_refused_with_a_way_out() -> None:
    pm = wrap(llama(), target_modules=["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match="LoRA variant .*merge it with PEFT first or export the adapter"):
        exported(pm)


def test_adapter_alone_is_written_as_peft_writes_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    pm = wrap(llama(), target_modules=["q_proj", "v_proj"])
    pm.save_pretrained(tmp_path / "peft")
    out = write_adapter(tmp_path / "ours" / "v1", adapter_tensors(pm), adapter_config(pm))
    want = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    got = load_file(out / "adapter_model.safetensors")
    assert_same(got, want)
    ours = json.loads((out / "adapter_config.json").read_text())
    theirs = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    norm = {k: sorted(v) if isinstance(v, list) else v for k, v in theirs.items()}
    assert {k: sorted(v) if isinstance(v, list) else v for k, v in ours.items()} == norm
    assert ours["inference_mode"] is True and ours["r"] == 4
    with pytest.raises(FileExistsError, match="every adapter version needs a new directory"):
        write_adapter(out, adapter_tensors(pm), adapter_config(pm))
    assert [p.name for p in (tmp_path / "ours").iterdir()] == ["v1"]    # no temporary left
