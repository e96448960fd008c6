"""A pull-relay member in a process of its own, for the fetch relay tests: it runs the code a vLLM
worker runs (`weightsync.transports.http.member_fetch`) without vLLM. It prints its body server's URL, then for
each JSON line on stdin ({"fetch": ref}) fetches that bucket through the tree and prints
{"digest": xxh3 of the body it holds, "from_parent", "reason"} (or {"error"}).

A request may say how to misbehave with that bucket: "tamper" flips a bit of every piece it
offers after checking it; "stall" offers the first piece and nothing after it (the process stays
up); "die" exits as soon as its child has read the first piece."""

from __future__ import annotations

import json
import os
import sys
import time

from weightsync.net.bodyserver import BodyServer, Live
from weightsync.wire.digests import digest_at
from weightsync.transports.http.member_fetch import FetchSpec, fetch_body

_honest_ready = Live.ready


def misbehave(how: str | None) -> None:
    def tamper(self: Live, upto: int) -> None:
        a = self.watermark
        if upto > a:
            self.view[a] ^= 1                # after this member checked it
        _honest_ready(self, upto)

    def stall(self: Live, upto: int) -> None:
        if self.watermark == 0:
            _honest_ready(self, upto)        # one piece, then never another

    def die(self: Live, upto: int) -> None:
        _honest_ready(self, upto)
        deadline = time.monotonic() + 30
        while self.served == 0 and time.monotonic() < deadline:
            time.sleep(0.01)                 # its child got the first piece; then it dies
        os._exit(3)

    Live.ready = {"tamper": tamper, "stall": stall, "die": die, None: _honest_ready}[how]  # type: ignore[method-assign]


def main() -> None:
    server = BodyServer("127.0.0.1", timeout=60, linger=20)
    print(json.dumps({"url": server.url}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        ref = msg["fetch"]
        misbehave(msg.get("misbehave"))
        try:
            got = fetch_body(ref, FetchSpec.parse(ref), server, max_bytes=1 << 30, timeout=60)
            out = {"digest": _digest(got.body), "from_parent": got.from_parent,
                   "reason": got.reason}
        except Exception as e:  # noqa: BLE001 - the test reads it
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


def _digest(view: memoryview) -> str:
    import torch
    t = torch.frombuffer(bytearray(view), dtype=torch.uint8) if len(view) else torch.empty(0)
    return digest_at(b"", t.data_ptr(), len(view))


if __name__ == "__main__":
    main()
