"""The http transport's payloads as bodies of vLLM's JSON `/update_weights` route (the `vllm`
adapter's renderers): by reference to the trainer's body server, or inline in base64."""

from __future__ import annotations

import base64
import json
from typing import Any

import torch

__all__ = ["render_fetch", "render_update_weights"]


def render_fetch(header: dict[str, Any], fetch: dict[str, Any],
                 round_id: str | None = None, token: str | None = None) -> tuple[list[Any], str]:
    """The http transport's payload as vLLM's JSON /update_weights body without the bytes:
    {"update_info": {"round": id, "header": {...}, "fetch": {"url", "token", "nbytes"}}}; the
    worker fetches the body from the trainer's body server."""
    info = {"round": round_id, "header": header, "fetch": fetch}
    if token:
        info["token"] = token
    return [json.dumps({"update_info": info}, separators=(",", ":")).encode()], "application/json"


def render_update_weights(header: dict[str, Any], body: torch.Tensor,
                          round_id: str | None = None, token: str | None = None) -> tuple[list[Any], str]:
    """The http transport's payload as vLLM's JSON /update_weights body, built as parts (the
    base64 text is the only copy): {"update_info": {"round": id, "header": {...}, "body_b64": "..."}}."""
    # numpy's stubs give ndarray __buffer__ only on Python 3.12+
    data = memoryview(body.contiguous().numpy()) if body.numel() else b""  # type: ignore[arg-type]
    head = (b'{"update_info":{"round":' + json.dumps(round_id).encode()
            + (b',"token":' + json.dumps(token).encode() if token else b"") + b',"header":'
            + json.dumps(header, separators=(",", ":")).encode() + b',"body_b64":"')
    return [head, base64.b64encode(data), b'"}}'], "application/json"
