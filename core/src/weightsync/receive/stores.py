"""What an engine exposes to the receiver (`WeightStore`: its tensors by HF name, an atomic load),
the stores weightsync's own engines use, and the checks of a tensor or checkpoint against them."""

from __future__ import annotations

import difflib
from typing import Mapping, Protocol

import torch

from weightsync.wire.bucket import dtype_name
from weightsync.errors import PayloadError


class WeightStore(Protocol):
    """What an engine exposes to the receiver: its tensors by HF name, and an atomic load."""

    def get(self, name: str) -> torch.Tensor | None: ...

    def names(self) -> list[str]: ...

    def load(self, named: Mapping[str, torch.Tensor]) -> None: ...

    def staging_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """A buffer the store keeps to stage `name` in across rounds; None: new memory."""
        ...


class ModuleStore:
    """A torch module's state dict (tied aliases included) as a WeightStore."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._tensors = dict(module.state_dict(keep_vars=True))

    def get(self, name: str) -> torch.Tensor | None:
        t = self._tensors.get(name)
        return None if t is None else t.detach()

    def names(self) -> list[str]:
        return list(self._tensors)

    def staging_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """None: a live module's tensors are shared with its users, so staging is new memory."""
        return None

    @torch.no_grad()
    def load(self, named: Mapping[str, torch.Tensor]) -> None:
        for name, t in named.items():
            self._tensors[name].detach().copy_(t)


class DictStore(ModuleStore):
    """Plain named tensors (a weights-only engine). With `owned` (nothing outside holds them) it
    stages into buffers kept across rounds, and a commit swaps staged and live tensors instead
    of copying: each received byte is copied once on the engine side."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], owned: bool = True) -> None:
        self._tensors = dict(tensors)
        self._owned = owned
        self._staging: dict[str, torch.Tensor] = {}

    def staging_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """A buffer to stage `name` in (shaped like the live tensor), or None: clone."""
        if not self._owned or name not in self._tensors:
            return None
        live = self._tensors[name]
        buf = self._staging.get(name)
        if buf is None or buf.shape != live.shape or buf.dtype != live.dtype or buf.device != live.device:
            buf = self._staging[name] = torch.empty_like(live)
        return buf

    @torch.no_grad()
    def load(self, named: Mapping[str, torch.Tensor]) -> None:
        for name, t in named.items():
            if self._owned and self._staging.get(name) is t:
                self._staging[name], self._tensors[name] = self._tensors[name], t
            else:
                self._tensors[name].detach().copy_(t)


class _Named(Protocol):
    """What `check_tensor` reads of a store (a checkpoint index has it too)."""

    def get(self, name: str) -> torch.Tensor | None: ...

    def names(self) -> list[str]: ...


def check_tensor(store: _Named, name: str, t: torch.Tensor) -> torch.Tensor:
    """The engine's tensor for `name`, or an error saying exactly what does not match."""
    live = store.get(name)
    if live is None:
        close = difflib.get_close_matches(name, store.names(), n=3)
        hint = f"; did you mean {close}?" if close else ""
        hint += ("; the exporter sends checkpoint names (option checkpoint_layout), can check "
                 "them against the engine's checkpoint before sending (expect_names_from), and "
                 "maps names with rename / skip / name_map")
        raise PayloadError(f"tensor {name!r} is not in the engine's model{hint}")
    if tuple(live.shape) != tuple(t.shape):
        raise PayloadError(f"tensor {name!r}: shape {list(t.shape)} sent, engine has {list(live.shape)}")
    if live.dtype != t.dtype:
        raise PayloadError(f"tensor {name!r}: dtype {dtype_name(t.dtype)} sent, engine has "
                           f"{dtype_name(live.dtype)}; use encoding 'cast' with dtype "
                           f"{dtype_name(live.dtype)!r}")
    return live
