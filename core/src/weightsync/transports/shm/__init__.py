"""Transport `shm`: the trainer and its engines share one host. Payloads are written straight
into shared buffers (`alloc`), and each engine is told where they are with an announce whose
header is JSON only (segment name, offset, nbytes; or a CUDA IPC handle when the buffers live on
a GPU). The engine reads the bytes in place; nothing is pickled and nothing travels over HTTP but
the header.

Double-buffered: `segments` buffers (2 by default) of the largest payload size are used in turn.
`send` announces bucket i and returns at once, so the exporter fills the other buffer while the
engines read this one; `alloc` blocks until the buffer it hands out is released, i.e. every
engine's announce for the payload that was in it returned (the engine staged it) or failed.

No leaked segments, by construction:
- segment names carry the sender's pid and a random token: ``weightsync-<pid>-<token>-<k>``;
- the sender registers every name with Python's resource tracker (the helper process that
  multiprocessing.shared_memory uses). When the sender dies, even by SIGKILL, the tracker sees its
  pipe close and unlinks every name still registered. A normal close() unlinks and unregisters;
- with ``keep_segments: false`` the names are also unlinked at the end of every sync, at the cost
  of fresh (page-faulting) memory for the next one;
- receivers open segments read-only and never create or unlink them; their mappings of an
  unlinked segment are released when they drop them (the kernel frees the memory then).
A receiver validates names against that pattern, so a header cannot point it at another file.

Generations: the last 64 bytes of a CPU segment hold a counter that `alloc` bumps before the
buffer is written again, and every announce carries the value it was sent under. A receiver
checks it before it copies and again after: a buffer rewritten while an engine still read it
(which the release protocol above rules out) would be refused, never staged. That is what lets a
receiver hash each piece as it reads it and stream it into staging (two memory transfers per
byte, as for a bare copy) instead of hashing the copy afterwards.

The package: `segments` (the sender's shared buffers, their names and their reaping),
`receiving` (the engine's half: mapping a segment, checking its generation) and `sending` (the
trainer's half: buffers used in turn, announces, releases)."""

from weightsync.transports.shm.receiving import ShmReceiver, forget_mappings
from weightsync.transports.shm.segments import (GEN_BYTES, NAME_RE, PREFIX, SHM_DIR, Segment,
                                                create_cpu_segment, unlink)
from weightsync.transports.shm.sending import ShmOptions, ShmTransport

__all__ = ["GEN_BYTES", "NAME_RE", "PREFIX", "SHM_DIR", "Segment", "ShmOptions", "ShmReceiver",
           "ShmTransport", "create_cpu_segment", "forget_mappings", "unlink"]
