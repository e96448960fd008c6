"""What the TRL tests share beyond the live servers: how they check what a server holds after
`train()` (its version, its bytes read back, its logprobs against the trained model's), a reward
the async trainer's rollout process
can import (it runs in a spawned child, so the reward must be importable by name; the test puts
this folder on sys.path, which the child inherits), the response template TRL asks for when it
does not know a tokenizer's chat template, and the two stand-ins AsyncGRPOTrainer needs on a CPU.

AsyncGRPOTrainer (TRL 1.16) packs samples into a prefix tree and runs attention through the
FlashAttention-3 varlen kernel, fetched from the Hugging Face Hub at the first forward
(`trl.experimental.async_grpo.packing._flash_attn`: `kernels.get_kernel("kernels-community/
flash-attn3")`, a CUDA build; no `kernels` package, no network and no GPU here). `varlen_attention`
computes the same function with torch on CPU (causal, aligned bottom-right like FlashAttention's
varlen kernel when queries are fewer than keys, GQA by repeating the key/value heads). Its
other CUDA-only call, `get_peak_flops_per_device` (`torch.cuda.get_device_name`, for MFU
metrics only), is answered with None, TRL's own answer for an unknown device."""

from __future__ import annotations

import zlib
from typing import Any

import requests
import torch
import torch.nn.functional as F

# parameters vLLM on CPU keeps in checkpoint layout (it repacks most linear weights into kernel
# layouts): read back from the served model, bit for bit
READ_BACK = {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.1.post_attention_layernorm.weight", "lm_head.weight"}
PROBE = [1, 17, 42, 99, 7, 300, 12, 5, 800, 3]     # token ids both sides score
TOLERANCE = 1e-4            # float32 on both sides; vLLM's CPU kernels vs torch's: ~1e-6 seen


# how an answer of the test tokenizer's chat template ("assistant: ...") ends: TRL's rollout worker
# refuses a tokenizer whose template it does not know unless one is set (`response_template`)
RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor": "assistant: ",
                     "fields": {"content": {"close_pattern": r"</s>\s*", "content": "text"}}}


def crc_reward(completions: list[Any], **kw: Any) -> list[float]:
    """Distinct completions never tie, so every group has an advantage and every step a gradient."""
    return [zlib.crc32(str(c).encode()) / 2**32 for c in completions]


class CpuFlashAttention:
    """The one function TRL's tree attention calls on the FA3 kernel module."""

    @staticmethod
    def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None = None,
                               causal: bool = True, window_size: tuple[int, int] = (-1, -1),
                               **kw: Any) -> torch.Tensor:
        if tuple(window_size) != (-1, -1) or kw:
            raise NotImplementedError(f"CPU stand-in: no sliding window or {sorted(kw)}")
        outs = []
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
            qi, ki, vi = (x.transpose(0, 1) for x in (q[qs:qe], k[ks:ke], v[ks:ke]))
            rep = qi.shape[0] // ki.shape[0]
            ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
            mask = (torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril((ke - ks) - (qe - qs))
                    if causal else None)
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                       scale=softmax_scale).transpose(0, 1))
        return torch.cat(outs)


def run_async_grpo_on_cpu(monkeypatch: Any) -> None:
    """Replace exactly the two CUDA-only pieces named above; everything else is TRL's."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing
    monkeypatch.setattr(packing, "_flash_attn", lambda: CpuFlashAttention)
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *a, **k: None)


def served_version(url: str) -> str:
    return str(requests.get(url + "/weight_info", timeout=10).json()["weight_version"])


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def model_logprobs(model_dir: Any, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """log p(PROBE[i] | PROBE[:i]) under `weights`, from a plain Hugging Face model (the trainer's
    own copy may carry TRL's patched forward and attention)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(torch.tensor([PROBE])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(PROBE[1:])[:, None])[:, 0]


def served_logprobs(server: Any) -> tuple[torch.Tensor, int]:
    """The same logprobs from the server (vLLM's `prompt_logprobs`, through the vllm adapter's
    `score`: the probe's own call), and the version that computed them."""
    from weightsync.config import EngineSpec
    from weightsync_vllm.adapter import VllmAdapter, VllmOptions
    spec = EngineSpec(**server.spec())
    adapter = VllmAdapter(VllmOptions(**spec.options), spec)
    try:
        got, version = adapter.score(PROBE)
    finally:
        adapter.close()
    return torch.tensor(got), version


def assert_final_policy(servers: list[Any], model_dir: Any, trained: dict[str, torch.Tensor],
                        before_last_step: dict[str, torch.Tensor], version: int) -> None:
    """Every server reports `version`, holds the trained bytes (read back) and computes the trained
    model's logprobs, not those of the weights before the last optimizer step."""
    from weightsync_trl.readback import compare_served
    want = model_logprobs(model_dir, trained)
    stale = model_logprobs(model_dir, before_last_step)
    assert (want - stale).abs().max() > 10 * TOLERANCE, "the last step did not move the logprobs"
    for s in servers:
        assert served_version(s.url) == str(version), f"{s.name} reports {served_version(s.url)}"
        assert READ_BACK <= set(compare_served(s.url, trained))
        got, at = served_logprobs(s)
        assert at == version
        gap = (got - want).abs().max().item()
        assert gap < TOLERANCE, f"{s.name}: logprobs differ from the trained model's by {gap}"
