"""Helpers for tests and CPU experiments: a Megatron-core GPTModel built for an HF config and this
rank's place in the parallel layout, loaded from an HF checkpoint (the import direction of the
exporter's tables), and a forward pass across pipeline stages (and virtual stages) by hand
(Megatron's schedules are CUDA-only). Needs `patch_for_cpu()` on CPU; reads checkpoints with
safetensors only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .convert import shard_from_hf
from .cpu import CPU_CONFIG, causal_mask
from .names import ARCHITECTURES, TOP, architecture, parse
from .plan import Ranks, model_chunks, expert_index, geometry_of

__all__ = ["build_gpt", "forward", "load_hf", "padded_vocab"]


def padded_vocab(vocab: int, tp: int, multiple: int = 64) -> int:
    """Megatron's padding of the vocabulary: a multiple of `multiple * tp`."""
    step = multiple * tp
    return -(-vocab // step) * step


def _config(hf: dict[str, Any], tp: int, pp: int, ep: int, etp: int, vpp: int) -> Any:
    from megatron.core.transformer import TransformerConfig
    heads = hf["num_attention_heads"]
    arch = architecture(hf["model_type"])
    moe: dict[str, Any] = {}
    experts = hf.get("num_experts") or hf.get("num_local_experts")   # transformers 4 / 5
    if experts:
        moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=hf["moe_intermediate_size"],
                   moe_router_topk=hf["num_experts_per_tok"], moe_router_load_balancing_type="none",
                   moe_router_score_function="softmax", moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
                   moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep,
                   expert_tensor_parallel_size=etp)
    return TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads),
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=arch == "qwen2", qk_layernorm=arch in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        perform_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        **moe, **CPU_CONFIG)


def build_gpt(hf_dir: str | Path, tp: int, pp: int, ep: int = 1, etp: int = 1, vpp: int = 1) -> Any:
    """This rank's GPTModel for the HF model in `hf_dir` (parallel state already initialized, with
    `virtual_pipeline_model_parallel_size=vpp` when `vpp > 1`); with `vpp > 1`, the list of its
    `vpp` model chunks, one per virtual stage, as Megatron's `get_model` builds them."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    cfg = _config(hf, tp, pp, ep, etp, vpp)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, qk_layernorm=cfg.qk_layernorm,
                                    normalization="RMSNorm")
    rope = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    vp = vpp > 1

    def chunk(stage: int | None) -> Any:
        return GPTModel(cfg, spec, vocab_size=padded_vocab(hf["vocab_size"], tp),
                        max_sequence_length=hf.get("max_position_embeddings", 4096),
                        pre_process=ps.is_pipeline_first_stage(ignore_virtual=not vp, vp_stage=stage),
                        post_process=ps.is_pipeline_last_stage(ignore_virtual=not vp, vp_stage=stage),
                        parallel_output=False, position_embedding_type="rope", rotary_base=int(rope),
                        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
                        vp_stage=stage)

    return [chunk(i) for i in range(vpp)] if vp else chunk(None)


@torch.no_grad()
def load_hf(model: Any, hf_dir: str | Path) -> None:
    """Fill this rank's shards from the HF checkpoint in `hf_dir` (safetensors files)."""
    from safetensors import safe_open
    hf_dir = Path(hf_dir)
    hf = json.loads((hf_dir / "config.json").read_text())
    arch = architecture(hf["model_type"])
    files = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            files.update({k: f for k in h.keys()})

    def read(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), "pt") as h:
            return h.get_tensor(name)

    ranks = Ranks.current()
    for chunk in model_chunks(model):
        geo = geometry_of(chunk, hf["vocab_size"])
        for name, p in chunk.named_parameters():
            layer, key, expert = parse(name)
            rule = TOP[key] if layer is None else ARCHITECTURES[arch][key]
            g_layer = chunk.decoder.layers[layer].layer_number - 1 if layer is not None else 0
            g_expert = expert_index(chunk.decoder.layers[layer], expert, ranks) if expert is not None else 0
            names = [t.format(layer=g_layer, expert=g_expert) for t in rule.hf]
            if names == ["lm_head.weight"] and "lm_head.weight" not in files:
                names = ["model.embed_tokens.weight"]          # tied: the head is the embedding
            group = ranks.group(rule.expert) if rule.kind != "copy" else (ranks.me,)
            shard = shard_from_hf(rule.kind, [read(n) for n in names], geo, group.index(ranks.me),
                                  len(group), padded_vocab=p.shape[0] * len(group))
            if shard.shape != p.shape:
                raise ValueError(f"{name}: {tuple(shard.shape)} from the checkpoint, {tuple(p.shape)} in the model")
            p.copy_(shard)


@torch.no_grad()
def forward(model: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Logits [batch, seq, padded vocab] on the last stage (None on the others): each stage runs
    its layers and passes its hidden states to the same TP rank of the next stage. With a list of
    chunks (virtual stages), in Megatron's interleaved order: every stage's chunk 0, then every
    stage's chunk 1, ..., the last stage handing its chunk i's output to the first stage's chunk
    i + 1; the last stage's last chunk gives the logits."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    chunks = model_chunks(model)
    b, s = input_ids.shape
    pos = torch.arange(s)[None].expand(b, s)
    out = None
    for i, chunk in enumerate(chunks):
        chunk.eval()
        if not chunk.pre_process:
            hidden = torch.empty(s, b, chunk.config.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())   # wraps around
            chunk.set_input_tensor(hidden)
        out = chunk(input_ids, pos, causal_mask(s))
        if not chunk.post_process:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return out if chunks[-1].post_process else None
