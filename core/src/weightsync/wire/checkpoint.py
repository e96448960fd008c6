"""A checkpoint directory on the local disk (safetensors files) read whole, each tensor checked
before anything is kept: what a reload from disk and a checkpoint signature both start from."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable

import torch

from weightsync.errors import PayloadError

__all__ = ["open_regular", "read_checkpoint"]


def open_regular(file: Path, inside: Path) -> int:
    """A read-only, non-blocking descriptor of `file`, which must resolve to a regular file inside
    the directory `inside` (a link out of it, a FIFO or a device is a PayloadError)."""
    real = file.resolve()
    if inside not in real.parents:
        raise PayloadError(f"checkpoint file {file} resolves to {real}, outside {inside}; links out "
                           f"of the checkpoint directory are refused")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise PayloadError(f"checkpoint file {file} cannot be opened ({e}); nothing was loaded") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PayloadError(f"checkpoint file {file} is not a regular file; nothing was loaded")
    return fd


def read_checkpoint(path: str | Path, check: Callable[[str, torch.Tensor], Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a local safetensors checkpoint directory, each passed to `check` first."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path).resolve()
    if not folder.is_dir():
        raise PayloadError(f"checkpoint directory {path} does not exist on the engine's host")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise PayloadError(f"checkpoint directory {path} holds no *.safetensors files")
    named: dict[str, torch.Tensor] = {}
    for f in files:
        fd = open_regular(f, folder)
        try:
            tensors = load_file(f"/proc/self/fd/{fd}")     # the file checked, not its name again
        except (SafetensorError, OSError) as e:
            raise PayloadError(f"checkpoint file {f} cannot be read ({e}); nothing was loaded") from None
        finally:
            os.close(fd)
        for n, t in tensors.items():
            if n in named:
                raise PayloadError(f"tensor {n!r} appears in two files of {path}")
            check(n, t)
            named[n] = t
    return named
