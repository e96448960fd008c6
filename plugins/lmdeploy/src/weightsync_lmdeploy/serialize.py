"""LMDeploy's `serialize_state_dict` wire format, produced without LMDeploy installed.

LMDeploy (`lmdeploy/utils.py::serialize_state_dict`) sends tensors to a same-host engine as
`base64(ForkingPickler dump)` of either
  * `[(name, reduce_tensor(t)), ...]` (plain), or
  * `{"flattened_tensor": reduce_tensor(flat), "metadata": [lmdeploy.utils.FlattenedTensorMetadata]}`
    (load_format "flattened_bucket": one dtype per buffer, element indices).
The engine unpickles with plain `ForkingPickler.loads`, so the metadata must pickle under the class
path `lmdeploy.utils.FlattenedTensorMetadata`. This module writes exactly that pickle (the same
bytes LMDeploy's own dataclass produces) from a local dataclass, so the plugin never imports
LMDeploy. Only dumps happen here: nothing received is ever unpickled.
"""

from __future__ import annotations

import base64
import copyreg
import io
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import torch

LMDEPLOY_METADATA = ("lmdeploy.utils", "FlattenedTensorMetadata")


@dataclass
class FlattenedTensorMetadata:
    """Field for field LMDeploy's `lmdeploy.utils.FlattenedTensorMetadata`; pickles under its
    path. Indices count elements of the buffer's single dtype (the "old" layout)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    pickle_as: ClassVar[tuple[str, str]] = LMDEPLOY_METADATA


def _reduce_storage_by_name(storage: torch.UntypedStorage) -> tuple[Any, tuple]:
    """torch's `reduce_storage` under the "file_system" strategy, whatever the global strategy:
    a CPU storage travels as a shared-memory file name. torch's default ("file_descriptor")
    hands the fd over multiprocessing's resource sharer, which only a process started by this
    one can authenticate to; an engine server is never such a process. (LMDeploy itself takes
    CUDA tensors only, which travel as CUDA IPC handles; CPU handles serve same-host test engines.)"""
    from torch.multiprocessing.reductions import (StorageWeakRef, rebuild_storage_empty,
                                                  rebuild_storage_filename, shared_cache)
    if storage.device.type != "cpu":
        raise RuntimeError(f"cannot share a {storage.device.type} storage by name; "
                           f"pickle the tensor (CUDA tensors travel as IPC handles)")
    if storage.nbytes() == 0:
        return (rebuild_storage_empty, (type(storage),))
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()
    shared_cache[metadata[1]] = StorageWeakRef(storage)
    return (rebuild_storage_filename, (type(storage),) + tuple(metadata))


def _dispatch_table() -> dict:
    """ForkingPickler's reducers (torch storages -> shared memory / CUDA IPC handles)."""
    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler
    from multiprocessing.reduction import ForkingPickler
    table = copyreg.dispatch_table.copy()
    table.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]  # not in typeshed
    table[torch.UntypedStorage] = _reduce_storage_by_name
    return table


if TYPE_CHECKING:
    class _Pickler(pickle._Pickler):
        """pickle's pure-Python pickler, with the undocumented internals used here (typeshed
        leaves them out)."""

        proto: int
        dispatch: ClassVar[dict[type, Callable[..., None]]]

        def save(self, obj: Any) -> None: ...
        def write(self, data: bytes) -> None: ...
        def memoize(self, obj: Any) -> None: ...
        def save_global(self, obj: Any, name: str | None = None) -> None: ...
else:
    _Pickler = pickle._Pickler


class _LmdeployPickler(_Pickler):
    """ForkingPickler's behaviour (same dispatch table, same protocol), except that classes with
    a `pickle_as` attribute are written as that global (STACK_GLOBAL module name)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.dispatch_table = _dispatch_table()

    def save_global(self, obj: Any, name: str | None = None) -> None:
        target = obj.__dict__.get("pickle_as") if isinstance(obj, type) else None
        if target is None:
            return super().save_global(obj, name)
        module, qualname = target
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:  # pragma: no cover - DEFAULT_PROTOCOL is 4 or 5 on every supported Python
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _LmdeployPickler(buf).dump(obj)
    return buf.getvalue()


def encode(obj: Any) -> str:
    """`serialize_state_dict`'s last step: base64 of the pickle, as UTF-8 text."""
    return base64.b64encode(dumps(obj)).decode("utf-8")


def reduce(t: torch.Tensor) -> tuple[Any, tuple]:
    """`torch.multiprocessing.reductions.reduce_tensor`: an explicit (rebuild_fn, args) pair, so the
    engine can patch the device index (args[6]) before rebuilding a CUDA tensor."""
    from torch.multiprocessing.reductions import reduce_tensor
    return reduce_tensor(t)


def serialize_plain(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Plain payload: `[(name, reduce_tensor(t)), ...]` (the only form TurboMind takes)."""
    return encode([(n, reduce(t)) for n, t in named])


def flattened_metadata(named: Sequence[tuple[str, torch.Tensor]]) -> list[FlattenedTensorMetadata]:
    """Element ranges of tensors laid back to back in one buffer of their common dtype."""
    out, idx = [], 0
    for n, t in named:
        k = t.numel()
        out.append(FlattenedTensorMetadata(n, torch.Size(t.shape), t.dtype, idx, idx + k, k))
        idx += k
    return out


def serialize_flattened(flat: torch.Tensor, metadata: list[FlattenedTensorMetadata]) -> str:
    """Flattened payload for load_format "flattened_bucket". `flat` is 1-D, one dtype, and holds
    every tensor of `metadata` at its element range."""
    if flat.dim() != 1:
        raise ValueError(f"a flattened bucket is 1-D, got shape {tuple(flat.shape)}")
    for m in metadata:
        if m.dtype != flat.dtype:
            raise ValueError(f"{m.name}: dtype {m.dtype} differs from the buffer's {flat.dtype}; "
                             f"LMDeploy's flattened_bucket holds one dtype per buffer")
        if not 0 <= m.start_idx <= m.end_idx <= flat.numel() or m.end_idx - m.start_idx != m.numel:
            raise ValueError(f"{m.name}: element range {m.start_idx}..{m.end_idx} does not fit "
                             f"a {flat.numel()}-element buffer")
    return encode({"flattened_tensor": reduce(flat), "metadata": list(metadata)})
