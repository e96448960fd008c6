"""Read back what a vLLM server serves and compare it with the trainer's tensors, bit for bit:
vLLM's own `POST /weight_checker {"action": "checksum"}` route (VLLM_SERVER_DEV_MODE=1) digests
every parameter in the worker. A check for tests and for users who want to see it themselves."""

from __future__ import annotations

import hashlib

import requests
import torch

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def served_digests(url: str) -> dict[str, str]:
    """sha256 of every parameter the server's model holds, computed in its worker (vLLM's
    `POST /weight_checker {"action": "checksum"}`), keyed by vLLM's parameter name."""
    r = requests.post(url + "/weight_checker", json={"action": "checksum"}, timeout=60)
    r.raise_for_status()
    return {k.split(":")[-1]: v for k, v in r.json()["checksums"].items()}


def _sha(t: torch.Tensor) -> str:
    # numpy's stubs give ndarray __buffer__ only on Python 3.12+
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw).hexdigest()  # type: ignore[arg-type]


EMPTY = _sha(torch.empty(0))


def expected_digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """What vLLM's parameters hold for these checkpoint tensors: the same name, or q/k/v and
    gate/up concatenated into vLLM's fused parameter."""
    out = {n: _sha(t) for n, t in weights.items()}
    for n in list(weights):
        for fused, parts in FUSED.items():
            if n.endswith(f".{parts[0]}.weight"):
                pieces = [weights[n.replace(f".{parts[0]}.", f".{p}.")] for p in parts]
                out[n.replace(f".{parts[0]}.", f".{fused}.")] = _sha(torch.cat(pieces))
    return out


def compare_served(url: str, weights: dict[str, torch.Tensor]) -> list[str]:
    """Every served parameter that holds its bytes (vLLM on CPU repacks many linear weights into
    kernel layouts and leaves the parameter empty) equals the trainer's bytes; returns the names
    compared. Raises AssertionError naming the first parameter that differs."""
    want = expected_digests(weights)
    compared = []
    for name, digest in served_digests(url).items():
        if digest == EMPTY:
            continue
        if name not in want:
            raise AssertionError(f"{url}: served parameter {name} has no trainer counterpart")
        if digest != want[name]:
            raise AssertionError(f"{url}: served {name} differs from the trainer's")
        compared.append(name)
    return compared
