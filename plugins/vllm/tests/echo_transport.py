"""A third-party transport for the tests, `echo`: the trainer writes each payload body to a file
and delivers a message of its own ("echo.file", header and path) through `Adapter.deliver`; the
engine's receiving half reads the file and stages it, answering with the digest it staged and
the process that read it. Nothing in weightsync_vllm knows this transport: the live test
installs it in the vLLM server's environment (an entry point, as pip would) and in the trainer's
plugin manager, and a push must work."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from weightsync import hookimpl
from weightsync.errors import PayloadError, TransportError
from weightsync.interfaces import Adapter, Message, Payload, Stages, Transport, TransportReceiver


class EchoFile(Message):
    """Stage the payload whose body is in the file at `body["path"]` (`body["header"]`)."""

    kind = "echo.file"


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dir: str = "/tmp"


class EchoReceiver(TransportReceiver):
    def deliver(self, kind: str, body: Mapping[str, Any], session: Stages) -> dict[str, Any]:
        if kind == EchoFile.kind:
            data = bytearray(Path(str(body["path"])).read_bytes())
            digest = session.apply(body["header"], memoryview(data))
            return {"digest": digest, "pid": os.getpid(), "nbytes": len(data)}
        return super().deliver(kind, body, session)

    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        if body is None:
            raise PayloadError("echo: a payload without its file's bytes")
        return torch.frombuffer(body, dtype=torch.uint8) if len(body) else torch.empty(0, dtype=torch.uint8)


class EchoTransport(Transport):
    name = "echo"
    Options = EchoOptions
    messages = (EchoFile,)
    same_host = True
    receiver = EchoReceiver

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self.answers: list[dict[str, Any]] = []      # what each engine answered, in order

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        path = Path(self.options.dir) / f"echo-{payload.index}-{secrets.token_hex(4)}.bin"
        path.write_bytes(payload.body.contiguous().numpy().tobytes())
        fails: dict[str, BaseException] = {}
        try:
            for a in engines:
                try:
                    got = dict(a.deliver(EchoFile({"header": payload.header(), "path": str(path)})))
                except Exception as e:  # noqa: BLE001 - reported per engine
                    fails[a.engine_name] = e
                    continue
                self.answers.append(got)
                if got.get("digest") != payload.digest:
                    fails[a.engine_name] = TransportError(
                        f"echo: engine {a.engine_name} answered {got}, not digest {payload.digest}")
        finally:
            path.unlink()
        return fails


@hookimpl
def register_transports(register: Any) -> None:
    register(EchoTransport)
