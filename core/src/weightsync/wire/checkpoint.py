"""A checkpoint directory on the local disk (safetensors files) read whole, each tensor checked
before anything is kept: what a reload from disk and a checkpoint signature both start from."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from weightsync.errors import PayloadError

__all__ = ["read_checkpoint"]


def read_checkpoint(path: str | Path, check: Callable[[str, torch.Tensor], Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a local safetensors checkpoint directory, each passed to `check` first, so
    a reload-from-disk reads and checks everything before anything is applied."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise PayloadError(f"checkpoint directory {path} does not exist on the engine's host")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise PayloadError(f"checkpoint directory {path} holds no *.safetensors files")
    named: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(f)
        except (SafetensorError, OSError) as e:
            raise PayloadError(f"checkpoint file {f} cannot be read ({e}); nothing was loaded") from None
        for n, t in tensors.items():
            if n in named:
                raise PayloadError(f"tensor {n!r} appears in two files of {path}")
            check(n, t)
            named[n] = t
    return named
