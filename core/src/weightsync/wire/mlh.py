"""The `mlh` digest: a tensor's bytes hashed where they live, so a CUDA bucket is verified on
its GPU instead of being copied to the host first (xxh3 is a serial stream hash; a GPU cannot
run it in parallel).

Definition (the same on every device, integer arithmetic only, so CPU and GPU agree bit for bit):
the bytes are read as little-endian int32 words (the last word zero-padded), split into chunks of
2^20 words, and each chunk j gives two sums over its words, S_k[j] = sum_t w[jC+t] * K_k[t]
mod 2^64 (k = 1, 2), with K_1, K_2 fixed odd 64-bit keys from splitmix64. The tensor's digest is
xxh3-128 over the tensor header (name, dtype, shape), the byte count and every S_k[j] in order.

A single changed word always changes the sums (an odd key times a nonzero 32-bit difference is
never 0 mod 2^64). Like xxh3, it catches corruption, not forgery. On CUDA a Triton kernel reads
every word once; elsewhere torch integer ops compute the same sums, a few chunks at a time."""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np
import torch
import xxhash

CHUNK = 1 << 20                     # words per chunk
PREFIX = "mlh:"
_SLAB = 4                           # chunks per torch step (temporaries: 2 x 8 bytes per word)
_PARTS = 32                         # Triton programs per chunk
_keys: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
_keys_lock = threading.Lock()


def _splitmix64(seed: int, n: int) -> np.ndarray:
    x = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x | np.uint64(1)


def keys(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two key vectors (int64, odd), built once per device."""
    with _keys_lock:
        k = _keys.get(device)
        if k is None:
            with np.errstate(over="ignore"):
                host = [torch.from_numpy(_splitmix64(s, CHUNK).view(np.int64).copy())
                        for s in (0x5745494748545331, 0x53594E4344494731)]
            k = _keys[device] = (host[0].to(device), host[1].to(device))
        return k


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words on its device (copied only when unaligned or ragged)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = b.numel()
    if n % 4 == 0 and b.data_ptr() % 4 == 0:
        return b.view(torch.int32)
    padded = torch.zeros((n + 3) // 4 * 4, dtype=torch.uint8, device=b.device)
    padded[:n].copy_(b)
    return padded.view(torch.int32)


_triton_kernel: Any = None
_triton_state = "unknown"


def _triton() -> Any:
    """The Triton kernel, or None where Triton is not installed or cannot compile."""
    global _triton_kernel, _triton_state
    if _triton_state != "unknown":
        return _triton_kernel
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def part_sums(w_ptr, k1_ptr, k2_ptr, o1_ptr, o2_ptr, n_words,
                      CHUNK_WORDS: tl.constexpr, PART_WORDS: tl.constexpr, BLOCK: tl.constexpr):
            # program (chunk c, part p) sums words [c*CHUNK + p*PART, +PART) against the keys at
            # the same offsets; the parts of a chunk are added afterwards (mod 2^64, in any order)
            c = tl.program_id(0)
            p = tl.program_id(1)
            acc1 = tl.zeros([BLOCK], dtype=tl.int64)
            acc2 = tl.zeros([BLOCK], dtype=tl.int64)
            base = c.to(tl.int64) * CHUNK_WORDS
            for off in range(0, PART_WORDS, BLOCK):
                idx = p * PART_WORDS + off + tl.arange(0, BLOCK)
                mask = base + idx < n_words
                w = tl.load(w_ptr + base + idx, mask=mask, other=0).to(tl.int64)
                acc1 += w * tl.load(k1_ptr + idx)
                acc2 += w * tl.load(k2_ptr + idx)
            out = c * tl.num_programs(1) + p
            tl.store(o1_ptr + out, tl.sum(acc1, 0))
            tl.store(o2_ptr + out, tl.sum(acc2, 0))

        _triton_kernel, _triton_state = part_sums, "ok"
    except Exception:  # noqa: BLE001 - no Triton: the torch path computes the same sums
        _triton_kernel, _triton_state = None, "missing"
    return _triton_kernel


def chunk_sums(t: torch.Tensor, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """S_1 and S_2 (int64, one entry per chunk) on the tensor's device."""
    w = _words(t)
    n = w.numel()
    k1, k2 = keys(w.device)
    chunks = (n + CHUNK - 1) // CHUNK
    if chunks == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=w.device)
        return empty, empty
    kernel = _triton() if (w.is_cuda and use_triton is not False) else None
    if kernel is not None:      # every chunk split in _PARTS programs: small tensors fill the GPU
        s1 = torch.empty(chunks, _PARTS, dtype=torch.int64, device=w.device)
        s2 = torch.empty_like(s1)
        kernel[(chunks, _PARTS)](w, k1, k2, s1, s2, n, CHUNK_WORDS=CHUNK,
                                 PART_WORDS=CHUNK // _PARTS, BLOCK=2048)
        return s1.sum(1), s2.sum(1)
    if use_triton and w.is_cuda:
        raise RuntimeError("the Triton mlh kernel is not available here")
    out1, out2 = [], []
    full = n // CHUNK
    grid = w[: full * CHUNK].view(full, CHUNK)
    for i in range(0, full, _SLAB):
        x = grid[i: i + _SLAB].to(torch.int64)
        out1.append((x * k1).sum(1))
        out2.append((x * k2).sum(1))
        del x
    if n > full * CHUNK:
        x = w[full * CHUNK:].to(torch.int64)
        m = x.numel()
        out1.append((x * k1[:m]).sum().reshape(1))
        out2.append((x * k2[:m]).sum().reshape(1))
    return torch.cat(out1), torch.cat(out2)


def mlh_digests(items: list[tuple[bytes, torch.Tensor]], use_triton: bool | None = None) -> list[str]:
    """Per (header, tensor): `mlh:` + xxh3-128 of header, byte count and chunk sums."""
    sums = [torch.stack(chunk_sums(t, use_triton), dim=1).reshape(-1) for _, t in items]
    host: list[Any] = [None] * len(items)
    by_device: dict[Any, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    for idx in by_device.values():
        flat = torch.cat([sums[i] for i in idx]).cpu().numpy().astype("<i8", copy=False)
        for i, part in zip(idx, np.split(flat, np.cumsum([sums[i].numel() for i in idx])[:-1])):
            host[i] = part
    out = []
    for (header, t), s in zip(items, host):
        h = xxhash.xxh3_128(header)
        h.update(b"mlh1" + struct.pack("<Q", t.numel() * t.element_size()))
        h.update(s.tobytes())
        out.append(PREFIX + h.hexdigest())
    return out


def mlh_digest(header: bytes, t: torch.Tensor, use_triton: bool | None = None) -> str:
    """One tensor's mlh digest."""
    return mlh_digests([(header, t)], use_triton)[0]
