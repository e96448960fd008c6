"""Running Megatron-core on CPU (gloo), for tests and for users without GPUs: the smallest patches
for the places where megatron-core 0.16 assumes CUDA, and the TransformerConfig settings that keep
it off TransformerEngine and fused kernels. Apply after `torch.distributed.init_process_group`.

Not part of the exporter: the exporter itself runs on any device Megatron does."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CPU_CONFIG", "causal_mask", "patch_for_cpu"]

CPU_CONFIG: dict[str, Any] = dict(
    use_cpu_initialization=True, transformer_impl="local", masked_softmax_fusion=False,
    bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
    gradient_accumulation_fusion=False, persist_layer_norm=False, sequence_parallel=False,
    moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", variable_seq_lengths=False)
"""TransformerConfig fields for CPU: local (non-TE) layers, no fusions, sequential experts, the
allgather token dispatcher (alltoall and grouped GEMM are CUDA-only)."""

_patched = False


def causal_mask(seq: int) -> torch.Tensor:
    """The boolean causal mask Megatron expects (True: masked), built on CPU."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def patch_for_cpu() -> None:
    """Patch megatron-core's CUDA assumptions (idempotent):
    1. the model-parallel RNG tracker reads and sets CUDA RNG states: use the CPU generator;
    2. rotary embeddings allocate on `torch.cuda.current_device()`: make that the CPU;
    3. the default causal mask is built on "cuda": build it on CPU (or pass `causal_mask`);
    4. the MoE router calls TransformerEngine's GEMM when it imported: it did not, say so;
    5. a tied output layer on the last pipeline stage is synced with the embedding through
       `weight.data.cuda()`: on a torch without CUDA, `Tensor.cuda()` returns the tensor."""
    global _patched
    if _patched:
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import utils
    from megatron.core.transformer.moe import moe_utils

    def get_state(*_: Any, **__: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(state: torch.Tensor, *_: Any, **__: Any) -> None:
        torch.set_rng_state(state)

    def seed(s: int) -> None:
        torch.manual_seed(s)

    random._get_cuda_rng_state = get_state
    random._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = get_state          # type: ignore[assignment]
    torch.cuda.set_rng_state = set_state          # type: ignore[assignment]
    torch.cuda.manual_seed = seed                 # type: ignore[assignment]
    torch.cuda.current_device = lambda: torch.device("cpu")   # type: ignore[assignment,return-value]

    def default_mask(sq: int) -> torch.Tensor:
        return causal_mask(sq)[0, 0]

    utils.get_default_causal_mask = default_mask
    fused_softmax.get_default_causal_mask = default_mask
    moe_utils.te_general_gemm = None
    if not torch.cuda.is_available():
        to_cuda = torch.Tensor.cuda

        def cuda(self: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
            return self if not torch.cuda.is_available() else to_cuda(self, *a, **kw)

        torch.Tensor.cuda = cuda                  # type: ignore[method-assign,assignment]
    _patched = True
