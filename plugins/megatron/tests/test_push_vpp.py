"""Virtual pipeline stages (interleaved pipelining, issue 41 item 1), in the session's one process
group of 4 gloo ranks (`pushed` in conftest.py): megatron-core 0.16 builds two model chunks per
stage on CPU (`vp_stage`), each rank pushes its list of chunks. A dense Llama at TP2xPP2xVPP2 and
Qwen3 (tied embeddings) at TP1xPP2xVPP2 (two data-parallel replicas), 4 layers, one per chunk,
interleaved: stage 0 holds layers 1 and 3, stage 1 layers 2 and 4. The engine holds the
save_pretrained bytes and gives the logits of Megatron's own interleaved forward within 1e-4; with
`senders: rank0` only rank 0 receives, with `senders: all` every rank sends its own part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

CASES = {"vpp_llama_tp2_pp2_vpp2": "llama", "vpp_qwen3_tp1_pp2_vpp2": "qwen3",
         "spread_llama_tp2_pp2_vpp2": "llama"}


def _interleaved(rows: list[dict[str, Any]], case: str) -> None:
    """Ranks 0 and 1 are stage 0 (TP or data-parallel peers), ranks 2 and 3 stage 1."""
    layers = {r["rank"]: r["layers"] for r in rows if r["case"] == case}
    assert layers == {0: [[1], [3]], 1: [[1], [3]], 2: [[2], [4]], 3: [[2], [4]]}, layers


@pytest.mark.slow
@pytest.mark.parametrize("case", ["vpp_llama_tp2_pp2_vpp2", "vpp_qwen3_tp1_pp2_vpp2"])
def test_virtual_stages_push_the_checkpoint_and_megatrons_logits(pushed: tuple[Path, list], kit: Any,
                                                                 case: str) -> None:
    tmp, rows = pushed
    arch = CASES[case]
    _interleaved(rows, case)
    assert kit.problems(tmp / f"{case}.pushed.safetensors", tmp / f"{arch}-hf",
                        tmp / f"{case}.logits.safetensors", torch.tensor(kit.IDS)) == []
    kit.check_traffic(rows, case)


@pytest.mark.slow
def test_virtual_stages_with_every_rank_sending(pushed: tuple[Path, list], kit: Any) -> None:
    tmp, rows = pushed
    case = "spread_llama_tp2_pp2_vpp2"
    _interleaved(rows, case)
    assert kit.problems(tmp / f"{case}.pushed.safetensors", tmp / "llama-hf",
                        tmp / f"{case}.logits.safetensors", torch.tensor(kit.IDS)) == []
    kit.check_spread(rows, case)
