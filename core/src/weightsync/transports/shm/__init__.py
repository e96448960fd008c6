"""Transport `shm`: the trainer and its engines share one host. Payloads are written straight into
shared buffers (`alloc`), and each engine gets an announce whose header is JSON only (segment name,
offset, nbytes; or a CUDA IPC handle); it reads the bytes in place, nothing is pickled.

Double-buffered: `send` returns at once, and `alloc` waits until the buffer's announces returned.
No leaked segments: names carry the sender's pid and a random token and are registered with
Python's resource tracker, which unlinks them if the sender dies (even by SIGKILL); receivers
open them read-only and check names against `NAME_RE`. The last 64 bytes of a CPU segment hold a
generation counter that `alloc` bumps before a buffer is rewritten; a receiver checks it before
and after its copy, which lets it hash each piece as it reads it."""

from weightsync.transports.shm.receiving import ShmReceiver, forget_mappings
from weightsync.transports.shm.segments import (GEN_BYTES, NAME_RE, PREFIX, SHM_DIR, Segment,
                                                create_cpu_segment, unlink)
from weightsync.transports.shm.sending import ShmOptions, ShmTransport

__all__ = ["GEN_BYTES", "NAME_RE", "PREFIX", "SHM_DIR", "Segment", "ShmOptions", "ShmReceiver",
           "ShmTransport", "create_cpu_segment", "forget_mappings", "unlink"]
