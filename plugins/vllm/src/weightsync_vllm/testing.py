"""Test helpers around a live vLLM server: a prompt, a tiny model's size, a served model with
its adapter (`Live`), a streamed completion. The server itself is `weightsync_vllm.launch`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import torch

from .launch import VllmServer, build_model_dir, build_tokenizer, vllm_available

__all__ = ["PROMPT", "TINY", "Live", "VllmServer", "build_model_dir", "build_tokenizer",
           "start_live", "stream_completion", "vllm_available"]

PROMPT = [1, 17, 42, 99, 7, 300, 12]
TINY = {"hidden": 256, "intermediate": 512}       # with the default 4 heads: head_dim 64


@dataclass
class Live:
    arch: str
    model: torch.nn.Module                      # the trainer's copy, as saved
    original: dict[str, torch.Tensor]
    model_dir: Path
    server: VllmServer

    @property
    def spec(self) -> Any:
        from weightsync.config import EngineSpec
        return EngineSpec(**self.server.spec())

    def adapter(self) -> Any:
        from .adapter import VllmAdapter, VllmOptions
        spec = self.spec
        return VllmAdapter(VllmOptions(**spec.options), spec)

    def version(self) -> int:
        return self.adapter().health().version

    def weight_version(self) -> Any:
        return requests.get(self.server.url + "/weight_info", timeout=10).json()["weight_version"]

    def greedy(self, n: int = 16) -> list[int]:
        return self.server.complete(PROMPT, n)["output_ids"]

    def config(self, transport: str | dict[str, Any] = "http", **extra: Any) -> dict[str, Any]:
        cfg: dict[str, Any] = {"adapter": "vllm", "engines": [self.server.spec()],
                               "transport": transport, "sync": {"progress": "off"},
                               "exporter": {"kind": "torch", "options": {"bucket_bytes": "1MiB"}}}
        cfg.update(extra)
        return cfg

    def reset(self) -> None:
        """Back to the served checkpoint at version 0 (disk reload through the backend)."""
        self.adapter().load_from_disk(str(self.model_dir), 0, allow_older=True)


def start_live(arch: str, root: Path, **server_kw: Any) -> Iterator[Live]:
    model_dir = root / "model"
    model = build_model_dir(model_dir, arch, dtype="bfloat16", **TINY)
    original = {n: t.detach().clone() for n, t in model.state_dict().items()}
    server_kw.setdefault("max_model_len", 2048)      # room for a request that is surely in flight
    server = VllmServer(model_dir, log=root / "server.log", name=f"vllm-{arch}", **server_kw)
    server.start()
    try:
        yield Live(arch, model, original, model_dir, server)
    finally:
        server.stop()


def stream_completion(live: Live, n: int) -> tuple[requests.Response, Iterator[dict[str, Any]]]:
    """A streamed greedy completion; returns once the server answered with headers (the chunks
    are read from the returned iterator)."""
    body: dict[str, Any] = {"model": "model", "prompt": PROMPT, "max_tokens": n,
                            "temperature": 0.0, "ignore_eos": True, "stream": True,
                            "return_token_ids": True}
    resp = requests.post(live.server.url + "/v1/completions", json=body, stream=True, timeout=120,
                         headers=live.server.headers())
    resp.raise_for_status()

    def chunks() -> Iterator[dict[str, Any]]:
        for line in resp.iter_lines(chunk_size=1):   # as bytes arrive: urllib3 holds larger reads back
            if not line or not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                return
            yield json.loads(data)

    return resp, chunks()
