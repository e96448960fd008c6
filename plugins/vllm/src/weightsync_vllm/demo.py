"""`weightsync demo --engine vllm`: the main job against a live vLLM server on this machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .testing import VllmServer, build_tokenizer, vllm_available


def launch(model_dir: Path, workdir: Path) -> tuple[dict[str, Any], str, Callable[[], None],
                                                   Callable[[list[int], int], dict[str, Any]]]:
    """Start vLLM (OpenAI entrypoint, `weightsync` backend) on the demo's model directory; return
    (engine spec, adapter kind, stop, generate). `generate(ids, n)` is a greedy completion of a
    token-id prompt through the server's completion API."""
    ok, why = vllm_available()
    if not ok:
        raise SystemExit(f"{why}\n(`make demo ENGINE=vllm` installs it first)")
    if not (Path(model_dir) / "tokenizer.json").exists():
        import json
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        build_tokenizer(model_dir, vocab)
    log = Path(workdir) / "vllm.log"
    print(f"starting vLLM on {model_dir} (about 20-60 s on a small CPU; log: {log})", flush=True)
    server = VllmServer(model_dir, log=log, name="vllm").start()
    return server.spec(), "vllm", server.stop, server.generate
