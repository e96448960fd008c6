"""Request bodies for vLLM's own `nccl` and `ipc` weight-transfer backends (vLLM 0.32), for a
trainer that drives such a server with the `vllm` adapter instead of the `weightsync` backend.

Exactly the shapes of docs/engines.md (vLLM's own backends) and vLLM's
`NCCLWeightTransferInitInfo` / `NCCLWeightTransferUpdateInfo` / `IPCWeightTransferUpdateInfo`:
packing settings live in `init_info` (0.32 rejects them in `update_info`), dtype names are bare
torch names, and the IPC handles' GPU key is the bare UUID (no "GPU-" prefix)."""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from weightsync.wire.bucket import dtype_name

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_PACKED_NUM_BUFFERS = 2


def nccl_init_info(*, rank_offset: int, world_size: int, master_address: str | None = None,
                   master_port: int | None = None, nccl_unique_id: bytes | None = None,
                   packed: bool = True,
                   packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                   packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> dict[str, Any]:
    """`init_info` for backend `nccl`. Exactly one rendezvous: address+port (vLLM's
    StatelessProcessGroup, the trainer is rank 0) or a 128-byte ncclUniqueId."""
    if (master_address is None) == (nccl_unique_id is None):
        raise ValueError("give exactly one rendezvous: master_address+master_port or nccl_unique_id")
    if not 0 < rank_offset < world_size:
        raise ValueError(f"rank_offset {rank_offset} must be in 1..{world_size - 1} (the trainer is rank 0)")
    info: dict[str, Any] = {"rank_offset": int(rank_offset), "world_size": int(world_size),
                            "packed": bool(packed),
                            "packed_buffer_size_bytes": int(packed_buffer_size_bytes),
                            "packed_num_buffers": int(packed_num_buffers)}
    if master_address is not None:
        if master_port is None:
            raise ValueError("master_port is required with master_address")
        info.update(master_address=str(master_address), master_port=int(master_port))
    else:
        if len(nccl_unique_id) != 128:  # type: ignore[arg-type]
            raise ValueError(f"an ncclUniqueId has 128 bytes, not {len(nccl_unique_id)}")  # type: ignore[arg-type]
        info["nccl_unique_id_b64"] = base64.b64encode(nccl_unique_id).decode()  # type: ignore[arg-type]
    return info


def tensor_meta(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """names / dtype_names / shapes, the per-round metadata both native backends take."""
    names, dtypes, shapes = [], [], []
    for n, t in named:
        names.append(n)
        dtypes.append(dtype_name(t.dtype))
        shapes.append(list(t.shape))
    return {"names": names, "dtype_names": dtypes, "shapes": shapes}


def nccl_update_info(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """`update_info` for backend `nccl`: metadata only; the bytes follow as broadcasts from rank 0
    (one per tensor unpacked, or per packed chunk, see `packed_chunks`)."""
    return tensor_meta(named)


def packed_chunks(nbytes: Sequence[int], buffer_size_bytes: int) -> list[list[int]]:
    """vLLM's packed chunk boundaries (`packed_tensor.pack_tensors`): tensors are appended in
    order and a chunk is closed once its size *exceeds* the buffer size, so the tensor that
    crosses the limit stays in that chunk. Returns tensor indices per chunk."""
    chunks: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in enumerate(nbytes):
        cur.append(i)
        total += int(n)
        if total > buffer_size_bytes:
            chunks.append(cur)
            cur, total = [], 0
    if cur:
        chunks.append(cur)
    return chunks


def ipc_init_info(packed: bool = False) -> dict[str, Any]:
    return {"packed": bool(packed)}


def gpu_uuid(device: int) -> str:
    """vLLM's IPC key: `str(torch.cuda.get_device_properties(i).uuid)`, without "GPU-"."""
    return str(torch.cuda.get_device_properties(device).uuid).removeprefix("GPU-")


def ipc_update_info(named: Sequence[tuple[str, torch.Tensor]], handles: list[dict[str, Any]] | dict[str, Any],
                    tensor_sizes: list[int] | None = None) -> dict[str, Any]:
    """`update_info` for backend `ipc` over HTTP: `ipc_handles_pickled` = base64(pickle(handles)).
    The server must run with VLLM_ALLOW_INSECURE_SERIALIZATION=1; same host only (CUDA IPC).
    `handles` is one `{uuid: reduce_tensor args}` per tensor, or one dict for a packed buffer
    (then `tensor_sizes` gives each tensor's bytes in it)."""
    info: dict[str, Any] = tensor_meta(named)
    if isinstance(handles, list) and len(handles) != len(info["names"]):
        raise ValueError(f"{len(handles)} IPC handles for {len(info['names'])} tensors")
    if isinstance(handles, dict) and tensor_sizes is None:
        raise ValueError("a packed IPC buffer needs tensor_sizes")
    info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode()
    if tensor_sizes is not None:
        info["tensor_sizes"] = [int(s) for s in tensor_sizes]
    return info


def ipc_handles(named: Sequence[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """One `{uuid: reduce_tensor(t) args}` per CUDA tensor (needs a GPU). Keep the tensors
    alive until the server answered."""
    from torch.multiprocessing.reductions import reduce_tensor
    out = []
    for n, t in named:
        if not t.is_cuda:
            raise ValueError(f"tensor {n!r} is on {t.device}; the ipc backend shares CUDA memory")
        if not t.is_contiguous():
            raise ValueError(f"tensor {n!r} is not contiguous; share a contiguous copy you keep alive")
        out.append({gpu_uuid(t.device.index or 0): reduce_tensor(t)[1]})
    return out
