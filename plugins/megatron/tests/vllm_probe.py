"""The vLLM side of the Megatron -> vLLM push test (test_push_vllm.py).

`HeldWeights` is a vLLM worker extension (`--worker-extension-cls vllm_probe.HeldWeights`, with
this folder on the server's PYTHONPATH): its `weightsync_held` RPC hands back, from inside the
worker, what the weightsync backend last loaded into the model (checkpoint names and layout) and
every parameter vLLM keeps unpacked (on CPU the linear layers' weights are packed into oneDNN
handles and left as empty tensors; embeddings, norms and lm_head keep their values).

`read_back` is what rank 0 of megatron_ranks.py runs against the server after a push: those
weights, the served weight version, and the server's raw fp32 logits of token-id prompts (the
server runs with `--logprobs-mode raw_logits --max-logprobs -1`, so `prompt_logprobs: -1` returns
every logit of every prompt position, before any softmax)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import torch


class HeldWeights:
    """Mixed into vLLM's worker class (so `self` is the worker)."""

    def weightsync_held(self) -> dict[str, str]:
        from safetensors.torch import save
        engine: Any = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "index"):
            raise RuntimeError("this server does not run the weightsync backend")
        model: Any = getattr(self, "model_runner").model
        live = {n: t.detach().clone().contiguous() for n, t in engine.index.live.items()}
        params = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()
                  if p.numel() > 0}
        return {"live": base64.b64encode(save(live)).decode(),
                "params": base64.b64encode(save(params)).decode()}


def served_logits(url: str, headers: dict[str, str], ids: list[int], vocab: int) -> torch.Tensor:
    """[len(ids), vocab] raw logits of the served model at every position of `ids`: one more
    token is appended so that the last position's logits come back as a prompt logprob too
    (entry i of `prompt_logprobs` holds the scores of position i - 1)."""
    import requests
    body = {"model": "model", "prompt": [*ids, 0], "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": -1}
    r = requests.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    r.raise_for_status()
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) + 1 and entries[0] is None, entries[:2]
    out = torch.full((len(ids), vocab), float("nan"), dtype=torch.float32)
    for pos, entry in enumerate(entries[1:]):
        for tok, v in entry.items():
            out[pos, int(tok)] = float(v["logprob"])
    assert not out.isnan().any(), "the server did not return every logit"
    return out


def read_back(spec: dict[str, Any], stem: Path, ids: torch.Tensor, vocab: int) -> None:
    """Writes `<stem>.safetensors` (what the backend loaded, by checkpoint name),
    `<stem>.params.safetensors` (vLLM's unpacked parameters, by vLLM's names),
    `<stem>.vllm_logits.safetensors` ({"logits": [batch, seq, vocab]}) and `<stem>.json`
    ({"weight_version"})."""
    import requests
    from safetensors.torch import load, save_file
    headers = {"Authorization": f"Bearer {spec['api_key']}"} if spec.get("api_key") else {}
    url = spec["url"]
    r = requests.post(url + "/collective_rpc", json={"method": "weightsync_held"}, headers=headers,
                      timeout=120)
    r.raise_for_status()
    held = r.json()["results"][0]
    Path(f"{stem}.safetensors").write_bytes(base64.b64decode(held["live"]))
    save_file(load(base64.b64decode(held["params"])), f"{stem}.params.safetensors")
    logits = torch.stack([served_logits(url, headers, row, vocab) for row in ids.tolist()])
    save_file({"logits": logits}, f"{stem}.vllm_logits.safetensors")
    version = requests.get(url + "/weight_info", headers=headers, timeout=30).json()
    Path(f"{stem}.json").write_text(json.dumps(version))
