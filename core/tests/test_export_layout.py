"""Checkpoint layout (issue 15, item 1): for transformers models the `torch` exporter sends exactly
the tensors `save_pretrained` writes (names, shapes, dtypes, bytes, the per-expert split), through
transformers' own reverse conversion, bucket by bucket; `checkpoint_layout: false` turns it off;
`rename`, `skip` and a `name_map` apply to the checkpoint names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weightsync.exporters.torch import TorchExporter

pytest.importorskip("transformers")

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
ARCHS = {   # model type -> extra config; the first four hold fused experts in memory
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      intermediate_size=64, head_dim=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, intermediate_size=64),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "llama": dict(intermediate_size=128),
    "qwen2": dict(intermediate_size=128),
    "gpt_neox": dict(intermediate_size=128),          # renamed: lm_head <-> embed_out
    "hrm_text": dict(intermediate_size=128),          # fused in the checkpoint: concatenated on save
}
MOE = ["qwen3_moe", "mixtral", "qwen2_moe", "phimoe"]


def build(arch: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **kw) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **{**SMALL, **ARCHS[arch], **kw})
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def saved(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """What save_pretrained writes, every shard file read back."""
    from safetensors.torch import load_file
    model.save_pretrained(path, max_shard_size="64KB")   # several files: the split does not matter
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def export(model, bucket_bytes: int = 4096, name_map=None, **options) -> list:  # noqa: ANN001
    opts = TorchExporter.Options(bucket_bytes=bucket_bytes, **options)
    return list(TorchExporter(opts).buckets(model, name_map=name_map))


def flat(buckets: list) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for b in buckets:
        for n, t in b.tensors:
            assert n not in out, f"{n} exported twice"
            out[n] = t
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_exported_tensors_are_what_save_pretrained_writes(arch: str, tmp_path: Path) -> None:
    model = build(arch)
    want = saved(model, tmp_path)
    buckets = export(model)
    got = flat(buckets)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and tuple(got[name].shape) == tuple(t.shape), name
        assert torch.equal(got[name].contiguous(), t), name
    assert all(b.nbytes <= 4096 or len(b.tensors) == 1 for b in buckets)
    assert [b.last for b in buckets] == [False] * (len(buckets) - 1) + [True]
    if arch in MOE:      # the in-memory model really differs from its checkpoint
        assert set(model.state_dict()) != set(want)
        assert any(".experts.0." in n for n in got)


def test_a_model_loaded_from_a_checkpoint_goes_back_to_it(tmp_path: Path) -> None:
    """from_pretrained records the conversions it used; export reverses those."""
    from transformers import AutoModelForCausalLM
    want = saved(build("mixtral", seed=3), tmp_path / "a")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.bfloat16)
    assert "model.layers.0.mlp.experts.gate_up_proj" in loaded.state_dict()
    got = flat(export(loaded))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n].contiguous(), t) for n, t in want.items())


def test_experts_are_views_of_the_fused_tensor_not_copies() -> None:
    """Each expert is a strided slice of the model's own fused tensor: no converted copy."""
    model = build("qwen3_moe")
    fused = model.model.layers[0].mlp.experts.gate_up_proj
    got = flat(export(model, bucket_bytes=2**20))
    for e in range(4):
        for part in ("gate_proj", "up_proj"):
            t = got[f"model.layers.0.mlp.experts.{e}.{part}.weight"]
            assert t.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    top, bottom = fused[1].detach().chunk(2, dim=0)
    assert torch.equal(got["model.layers.0.mlp.experts.1.gate_proj.weight"], top)
    assert torch.equal(got["model.layers.0.mlp.experts.1.up_proj.weight"], bottom)


def test_concatenated_outputs_are_computed_once_per_group(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """hrm_text's checkpoint fuses q/k/v/gate: the reverse conversion concatenates, computed from
    the group's sources when its bucket is built, once per group though its outputs span buckets."""
    from weightsync.exporters import fetch
    runs: list[str] = []
    real = fetch.Fetcher._run
    monkeypatch.setattr(fetch.Fetcher, "_run",
                        lambda self, g, *a: runs.append(g.layer_name) or real(self, g, *a))
    model = build("hrm_text")
    plan = TorchExporter(TorchExporter.Options()).plan(model)
    assert plan is not None
    computed = [o.name for o in plan.outputs if o.group is not None]
    assert "model.L_module.layers.0.attn.gqkv_proj.weight" in computed
    want = saved(model, tmp_path)
    got = flat(export(model, bucket_bytes=512))      # groups spread over several buckets
    assert all(torch.equal(got[n], want[n]) for n in computed)
    assert len(runs) == len(set(runs)) == 8          # 2 groups per layer, 2 stacks of 2 layers


def test_checkpoint_layout_off_sends_the_in_memory_names() -> None:
    model = build("qwen3_moe")
    got = flat(export(model, checkpoint_layout=False))
    assert list(got) == list(model.state_dict())
    assert got["model.layers.0.mlp.experts.gate_up_proj"].data_ptr() == \
        model.model.layers[0].mlp.experts.gate_up_proj.data_ptr()


def test_rename_skip_and_name_map_apply_to_checkpoint_names() -> None:
    model = build("mixtral")
    seen: list[tuple[str, tuple]] = []

    def name_map(name, t):  # noqa: ANN001, ANN202
        seen.append((name, tuple(t.shape)))
        return [(name.replace(".w1.", ".gate.").replace(".w3.", ".up."), t)]

    got = flat(export(model, rename=[(r"^model\.", "m.")], skip=[r"\.w2\.weight$"], name_map=name_map))
    assert ("m.layers.0.block_sparse_moe.experts.2.w1.weight", (32, 64)) in seen
    assert "m.layers.0.block_sparse_moe.experts.2.gate.weight" in got
    assert "m.layers.1.block_sparse_moe.experts.3.up.weight" in got
    assert not any(".w2." in n for n in got)
    assert "m.embed_tokens.weight" in got and not any(n.startswith("model.") for n in got)


def test_tied_embeddings_keep_the_name_transformers_keeps(tmp_path: Path) -> None:
    model = build("llama", tie_word_embeddings=True)
    want = saved(model, tmp_path)
    got = flat(export(model))
    assert sorted(got) == sorted(want) and "lm_head.weight" not in got


def test_a_state_dict_is_sent_as_it_is() -> None:
    """No model, no conversion: a plain mapping keeps its names (and its tensors, uncopied)."""
    model = build("qwen3_moe")
    sd = model.state_dict()
    got = flat(export(sd))
    assert list(got) == list(sd)
    assert all(got[n].data_ptr() == sd[n].data_ptr() for n in sd)


def test_core_exports_without_transformers_or_peft() -> None:
    """transformers and peft are optional: with neither importable, modules and state dicts
    still export (no conversion, no merge)."""
    import subprocess
    import sys
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'peft'):\n"
        "            raise ImportError(name + ' is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from weightsync.exporters.torch import TorchExporter\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
        "e = TorchExporter(TorchExporter.Options(bucket_bytes=64))\n"
        "print([b.names for b in e.buckets(m)], 'transformers' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[['0.weight'], ['0.bias', '1.weight', '1.bias']] False"
