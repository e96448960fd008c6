"""SGLang's MultiprocessingSerializer format, written without importing SGLang.

`/update_weights_from_tensor` takes `base64(ForkingPickler.dumps(payload))` per TP rank, and
SGLang 0.5.23 loads it with a SafeUnpickler that accepts only exact `(module, name)` globals
(docs/engines.md, SGLang). Two of those globals live in SGLang itself:

- `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata` (the bucket metadata class);
- `sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified` (CUDA tensors keyed by GPU UUID).

Pickle's own writer imports a class's module to check it, which would need SGLang installed in
the trainer. So this module uses a Python Pickler that writes those two globals by name (plain
GLOBAL opcodes), and takes every other reduction from torch's ForkingPickler registry. The bytes
load with SGLang's own `MultiprocessingSerializer.deserialize` (the tests check it).

CPU tensors are shared by file name (torch's `file_system` strategy, done per call: the global
strategy is untouched), because the `file_descriptor` strategy hands fds over a socket that only
processes of one multiprocessing family may connect to. CUDA tensors travel as CUDA-IPC handles.
Both are same-host only, and the sender must keep the tensors alive until the engine answers.
This module only *dumps*; weightsync never unpickles anything.
"""

from __future__ import annotations

import base64
import copyreg
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
from torch.multiprocessing import reductions as _red  # registers torch's reducers

METADATA_GLOBAL = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
CUDA_REBUILD_GLOBAL = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
_DEVICE_ARG = 6   # sglang patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX


@dataclass
class FlattenedTensorMetadata:
    """Field-for-field SGLang's `FlattenedTensorMetadata` dataclass; pickles under SGLang's name
    (the only class path its allow-list accepts for bucket metadata). Offsets count bytes."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _rebuild_cuda_tensor_modified(*args: Any) -> Any:  # pragma: no cover - never called here
    """Placeholder pickled as SGLang's `_rebuild_cuda_tensor_modified`; SGLang runs the real one."""
    raise RuntimeError("weightsync never unpickles SGLang payloads")


_REMOTE_GLOBALS: dict[int, tuple[str, str]] = {
    id(FlattenedTensorMetadata): METADATA_GLOBAL,
    id(_rebuild_cuda_tensor_modified): CUDA_REBUILD_GLOBAL,
}


def _reduce_storage_by_filename(storage: torch.UntypedStorage) -> Any:
    """torch's reduce_storage, `file_system` branch (shared memory named by file)."""
    if storage.is_cuda:
        raise RuntimeError("Cannot pickle CUDA storage; pickle the CUDA tensor instead")
    if storage.size() == 0:
        return (_red.rebuild_storage_empty, (type(storage),))
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()
    _red.shared_cache[metadata[1]] = _red.StorageWeakRef(storage)
    return (_red.rebuild_storage_filename, (type(storage),) + metadata)


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    """torch's reduce_tensor; for CUDA tensors, SGLang's patch (GPU UUID in argument 6)."""
    fn, args = _red.reduce_tensor(tensor)
    if tensor.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])
        fn = _rebuild_cuda_tensor_modified
    return fn, args


def _dispatch_table() -> dict[type, Any]:
    table = dict(copyreg.dispatch_table)
    table.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]  # not in typeshed
    table[torch.UntypedStorage] = _reduce_storage_by_filename
    for cls in list(table):
        if isinstance(cls, type) and issubclass(cls, torch.Tensor):
            table[cls] = _reduce_tensor
    table[torch.Tensor] = _reduce_tensor
    table[torch.nn.Parameter] = _reduce_tensor
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


class SGLangPickler(_Pickler):
    """ForkingPickler's reductions, plus SGLang's two globals written by name."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.dispatch_table = _dispatch_table()

    def save_global(self, obj: Any, name: str | None = None) -> None:
        remote = _REMOTE_GLOBALS.get(id(obj))
        if remote is None:
            return super().save_global(obj, name)
        module, qualname = remote
        self.write(pickle.GLOBAL + module.encode() + b"\n" + qualname.encode() + b"\n")
        self.memoize(obj)

    # pickle's table calls its own save_global for functions; route them through ours (classes
    # already go through `self.save_global`).
    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]
    dispatch[type(_rebuild_cuda_tensor_modified)] = save_global


def dumps(obj: Any) -> bytes:
    """The bytes `ForkingPickler.dumps(obj)` stands for in SGLang's protocol."""
    buf = io.BytesIO()
    SGLangPickler(buf).dump(obj)
    return buf.getvalue()


def serialize(obj: Any) -> str:
    """`MultiprocessingSerializer.serialize(obj, output_str=True)`: base64 text of the pickle."""
    return base64.b64encode(dumps(obj)).decode("ascii")


def flattened_bucket_object(flat: torch.Tensor, entries: list[Any]) -> dict[str, Any]:
    """SGLang's flattened_bucket payload: {"flattened_tensor": uint8, "metadata": [...]}."""
    metadata = [FlattenedTensorMetadata(e.name, torch.Size(e.shape), e.torch_dtype, e.start, e.end,
                                        e.end - e.start) for e in entries]
    return {"flattened_tensor": flat, "metadata": metadata}
