"""Where an end-to-end shm sync's time goes on this machine: the cost of one copy and one
xxh3-128 pass over 1 GiB, the sender's encode (pack + digest) and a receiver's stage (copy +
digest), and the best an shm sync can do when every byte is verified on both ends.
Run: .venv/bin/python benchmarks/profile_copy_hash.py"""
import time, torch, xxhash
from weightsync.bucket import digest_tensors, Bucket
from weightsync.encodings.raw import RawEncoding
from weightsync.wire import unpack
n = 2**30
src = torch.empty(n, dtype=torch.uint8).random_(0, 255)
dst = torch.empty_like(src); dst.copy_(src)
def t(f, k=3):
    best = 9e9
    for _ in range(k):
        t0 = time.perf_counter(); f(); best = min(best, time.perf_counter() - t0)
    return best
torch.set_num_threads(2); c2 = t(lambda: dst.copy_(src))
torch.set_num_threads(1); c1 = t(lambda: dst.copy_(src))
h = t(lambda: xxhash.xxh3_128(memoryview(src.numpy())).hexdigest())
model = [(f"w{i}", src[i*2**26:(i+1)*2**26].view(torch.bfloat16)) for i in range(16)]
enc = RawEncoding(); buf = torch.empty(2**26 + 4096, dtype=torch.uint8)
pk = t(lambda: [enc.encode(Bucket(i, [model[i]]), alloc=lambda k: buf[:k]) for i in range(16)])
pl = enc.encode(Bucket(0, [model[0]]))
named = unpack(pl.body)[0]
stg = torch.empty(2**25, dtype=torch.bfloat16)
rx = t(lambda: [ (stg.copy_(named[0][1]), digest_tensors([("w0", stg)])) for _ in range(16)])
print(f"memcpy 1 GiB: 2 threads {c2:.3f}s ({1/c2:.1f} GiB/s), 1 thread {c1:.3f}s ({1/c1:.1f} GiB/s)")
print(f"xxh3-128 1 GiB: {h:.3f}s ({1/h:.1f} GiB/s)")
print(f"sender encode (pack copy + digest) 1 GiB in 64 MiB buckets: {pk:.3f}s")
print(f"receiver stage (copy + digest) 1 GiB: {rx:.3f}s")
print(f"lower bound shm, 2 receivers on 2 cores: ~{(pk + 2*rx)/2:.3f}s -> {c2/((pk+2*rx)/2):.2f} of floor")
print(f"lower bound shm, 1 receiver: ~{max(pk, rx):.3f}s -> {c2/max(pk,rx):.2f} of floor")
