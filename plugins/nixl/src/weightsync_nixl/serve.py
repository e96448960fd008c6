"""`python -m weightsync_nixl.serve --model DIR --version V`: a peer host process serving one
version of a checkpoint directory (what a member holds) to joiners over NIXL. SIGUSR1 withdraws it
(its memory is deregistered, as when a member moves on); SIGTERM or SIGINT stops the process."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from weightsync.net.keys import resolve_key
from weightsync.wire.checkpoint import read_checkpoint
from weightsync_nixl.peer_host import PeerHost, serve_host


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightsync_nixl.serve", description=__doc__)
    p.add_argument("--model", required=True, help="a directory of *.safetensors files")
    p.add_argument("--version", type=int, required=True, help="the version those weights are")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--bucket-bytes", type=int, default=64 * 2**20)
    p.add_argument("--api-key", default=None)
    p.add_argument("--api-key-file", default=None)
    args = p.parse_args(argv)
    host = PeerHost(bucket_bytes=args.bucket_bytes)
    host.publish(args.version, read_checkpoint(args.model, lambda n, t: None))
    key = resolve_key(args.api_key, args.api_key_file, env="WEIGHTSYNC_ENGINE_KEY")
    server = serve_host(host, args.host, args.port, key)
    done = threading.Event()

    def stop(*_: Any) -> None:
        done.set()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, lambda *_: host.withdraw())
    threading.Thread(target=server.serve_forever, daemon=True, name="ws-nixl-peer-http").start()
    print(f"nixl peer serving version {args.version} on http://{args.host}:"
          f"{server.server_address[1]}", flush=True)
    while not done.wait(0.5):
        pass
    server.shutdown()
    host.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
