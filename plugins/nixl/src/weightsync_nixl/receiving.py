"""The engine's half of transport `nixl`: a `nixl.read` message is checked, the payload READ
one-sided from the trainer's registered memory into this process's registered staging memory
(NIXL notifies the trainer when it is done), then staged and hashed like every payload; the
digest the engine answers is what the trainer verifies. An announce (the base class's) is
refused: this transport's bodies travel only by READ."""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping

import torch

from weightsync.errors import PayloadError
from weightsync.interfaces import Stages, TransportReceiver
from weightsync_nixl.agent import agent
from weightsync_nixl.messages import NixlRead, parse_read
from weightsync_nixl.staging import staging

ROLE = "engine"


class NixlReceiver(TransportReceiver):
    private = True        # the body is this process's registered memory, read before staging

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        self._local = threading.local()
        agent(ROLE)           # at begin: NIXL loaded (or its absence said) before the first bucket

    def deliver(self, kind: str, body: Mapping[str, Any], session: Stages) -> dict[str, Any]:
        if kind != NixlRead.kind:
            return super().deliver(kind, body, session)
        loc = parse_read(body, int(self.options.max_bucket_bytes))
        deadline = time.monotonic() + min(loc.deadline, float(self.options.timeout))
        me = agent(ROLE)
        if loc.nbytes == 0:                     # nothing to read (the trainer awaits no notice)
            return {"digest": session.apply(loc.header, memoryview(b"")), "agent": me.name}
        peer = me.remote(loc.agent, loc.metadata)
        what = f"bucket {loc.header.get('index')}"
        with staging(me, str(self.options.staging_device)).slot(loc.nbytes) as buf:
            me.read(buf, peer, loc.descs, loc.mem, loc.notif, deadline, what)
            if not buf.is_cuda:       # numpy's stubs give ndarray __buffer__ only on 3.12+
                view = memoryview(buf.numpy())  # type: ignore[arg-type]
                return {"digest": session.apply(loc.header, view), "agent": me.name}
            torch.cuda.synchronize(buf.device)
            self._local.cuda = buf          # a CUDA body is no memoryview: `receive` takes it here
            try:
                return {"digest": session.apply(loc.header, None), "agent": me.name}
            finally:
                self._local.cuda = None

    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        if body is None:
            cuda = getattr(self._local, "cuda", None)
            if cuda is not None:
                return cuda
            raise PayloadError("nixl: a payload arrives with a nixl.read message; this engine got "
                               "none for it")
        if not len(body):
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(body, dtype=torch.uint8)
