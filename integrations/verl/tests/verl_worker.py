"""One verl worker process for the tests: builds the checkpoint engine the way verl does
(custom_backend_module, then CheckpointEngineRegistry.new) and runs the calls the driver sends,
one JSON object per line on stdin, answering one JSON line on stdout.

  python verl_worker.py master|replica"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from typing import Any

import torch

BUCKET = 64 * 1024          # small buckets: every round spans many
LEASE = 2.0


def weights(step: int) -> dict[str, torch.Tensor]:
    """The actor's tensors at `step`: several dtypes and shapes, some larger than a bucket."""
    g = torch.Generator().manual_seed(step)
    return {"model.embed_tokens.weight": torch.randn(256, 96, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(192, 96, generator=g).to(torch.bfloat16),
            "model.layers.0.input_layernorm.weight": torch.rand(96, generator=g),
            "model.layers.0.self_attn.q_proj.bias": torch.randn(96, generator=g).half(),
            "model.step_counter": torch.tensor([step, 7 * step], dtype=torch.int64),
            "lm_head.weight": torch.randn(300, 96, generator=g)}


def fingerprint(named: Any) -> dict[str, list[Any]]:
    return {n: [str(t.dtype), list(t.shape),
                hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()]
            for n, t in named}


def engine(is_master: bool | None) -> Any:
    """As verl builds it: actor ranks pass is_master, rollout workers do not."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    import_external_libs("weightsync_verl")
    kw: dict[str, Any] = {"lease": LEASE, "deadline": 120.0}
    if is_master is not None:
        kw["is_master"] = is_master
    return CheckpointEngineRegistry.new("weightsync", bucket_size=BUCKET, **kw)


def run(e: Any, cmd: str, arg: Any) -> Any:
    if cmd == "prepare":
        return e.prepare()
    if cmd == "init":
        return e.init_process_group(**arg)
    if cmd == "send":
        return asyncio.run(e.send_weights(iter(weights(arg).items()), global_steps=arg))
    if cmd == "receive":
        async def take() -> list[tuple[str, torch.Tensor]]:
            return [(n, t.clone()) async for n, t in e.receive_weights(global_steps=arg)]
        return fingerprint(asyncio.run(take()))
    if cmd == "finalize":
        return e.finalize()
    if cmd == "leave":
        return e.leave()
    raise ValueError(f"unknown command {cmd!r}")


def main() -> None:
    e = engine(True if sys.argv[1] == "master" else None)
    print(json.dumps({"ok": "ready"}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "exit":
            e.close()
            print(json.dumps({"ok": None}), flush=True)
            return
        try:
            out = {"ok": run(e, msg["cmd"], msg.get("arg"))}
        except Exception as ex:  # noqa: BLE001 - reported to the driver
            out = {"error": f"{type(ex).__name__}: {ex}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
