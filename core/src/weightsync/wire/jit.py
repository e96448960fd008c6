"""numba pieces of weightsync's compiled loops (imported only through `digests.jit()`, when
numba is installed). The intrinsics take plain integers (addresses, lengths), so the compiled code
holds no address and stays cacheable; the disk_delta plugin's kernels use `hash_into` and
`prefetch`. Both copy loops stream with non-temporal stores and feed an XXH3-128 C state."""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

__all__ = ["hash_into", "hash_stream", "prefetch", "stream_then_hash", "warm"]

_JIT = {"nogil": True, "cache": True, "boundscheck": False}


@intrinsic
def prefetch(typingctx, addr):  # type: ignore[no-untyped-def]
    """llvm.prefetch (read, all caches) of the byte at integer address `addr`; never faults."""
    if not isinstance(addr, types.Integer):
        return None
    sig = types.void(addr)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.inttoptr(args[0], i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def hash_into(typingctx, fn, state, ptr, n):  # type: ignore[no-untyped-def]
    """Call the C function at address `fn` as XXH3_128bits_update(state, ptr, n)."""
    if not all(isinstance(t, types.Integer) for t in (fn, state, ptr, n)):
        return None
    sig = types.void(fn, state, ptr, n)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        f, st, p, k = args
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [i8p, i8p, ir.IntType(64)])
        builder.call(builder.inttoptr(f, fnty.as_pointer()),
                     [builder.inttoptr(st, i8p), builder.inttoptr(p, i8p), k])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _memcpy(typingctx, dst, src, n):  # type: ignore[no-untyped-def]
    """llvm.memcpy of `n` bytes between two integer addresses (non-overlapping)."""
    if not all(isinstance(t, types.Integer) for t in (dst, src, n)):
        return None
    sig = types.void(dst, src, n)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        d, s, k = args
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), k, 1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _stream32(typingctx, dst, src):  # type: ignore[no-untyped-def]
    """Copy 32 bytes from `src` to 32-byte aligned `dst` with a non-temporal store."""
    if not all(isinstance(t, types.Integer) for t in (dst, src)):
        return None
    sig = types.void(dst, src)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        d, s = args
        vt = ir.VectorType(ir.IntType(64), 4)
        v = builder.load(builder.inttoptr(s, vt.as_pointer()), align=1)
        st = builder.store(v, builder.inttoptr(d, vt.as_pointer()), align=32)
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _sfence(typingctx):  # type: ignore[no-untyped-def]
    """Order the non-temporal stores before anything that follows (x86 sfence)."""
    sig = types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse.sfence")
        builder.call(fn, [])
        return context.get_dummy_value()
    return sig, codegen


@numba.njit(inline="always")
def _stream(d, c, k):  # type: ignore[no-untyped-def]
    """Copy k bytes from address c to d with non-temporal stores where d is 32-byte aligned."""
    head = (32 - d % 32) % 32
    if head > k:
        head = k
    if head:
        _memcpy(d, c, head)
    end = head + (k - head) // 32 * 32
    for off in range(head, end, 32):
        _stream32(d + off, c + off)
    if end < k:
        _memcpy(d + end, c + end, k - end)


@numba.njit(**_JIT)
def hash_stream(dst, src, n, fn, state, step):  # type: ignore[no-untyped-def]
    """Hash `n` bytes at `src` into the C state `state` (through `fn`), `step` bytes at a time,
    each step streamed to `dst` right after (from the cache): for a source no one else writes."""
    for s in range(0, n, step):
        k = min(step, n - s)
        hash_into(fn, state, src + s, k)
        _stream(dst + s, src + s, k)
    _sfence()


@numba.njit(**_JIT)
def stream_then_hash(dst, src, n, fn, state, step):  # type: ignore[no-untyped-def]
    """Stream `n` bytes from `src` to `dst` by `step`, hashing each step back from `dst`."""
    for s in range(0, n, step):
        k = min(step, n - s)
        _stream(dst + s, src + s, k)
        _sfence()
        hash_into(fn, state, dst + s, k)


def warm() -> None:
    """Compile (or load from the cache) before the first sync."""
    stream_then_hash(0, 0, 0, 0, 0, 1)
    hash_stream(0, 0, 0, 0, 0, 1)
