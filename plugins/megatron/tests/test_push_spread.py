"""Every rank sends its own part (`sync.senders: all`, issue 41 item 2), in the session's one process
group of 4 gloo ranks (`pushed` in conftest.py): a dense Llama at TP2xPP2 and Qwen3-MoE at TP2xEP2
(expert-TP 2) and PP2xEP2. Each rank gathers shards only within its TP or expert-TP group and sends
the HF tensors it was given straight to the engine: no rank receives a point-to-point tensor, every
rank sends, none more than 40% of the bytes (the whole model funnelled through rank 0 was 100%).
The engine holds the save_pretrained bytes and gives Megatron's own fp32 logits within 1e-4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

CASES = {"spread_llama_tp2_pp2": "llama", "spread_tp2_ep2_etp2": "qwen3_moe",
         "spread_pp2_ep2": "qwen3_moe"}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_sends_its_own_part(pushed: tuple[Path, list], kit: Any, case: str) -> None:
    tmp, rows = pushed
    arch = CASES[case]
    assert kit.problems(tmp / f"{case}.pushed.safetensors", tmp / f"{arch}-hf",
                        tmp / f"{case}.logits.safetensors", torch.tensor(kit.IDS)) == []
    kit.check_spread(rows, case)
