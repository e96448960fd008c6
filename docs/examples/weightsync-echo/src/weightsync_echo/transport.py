"""Transport `echo`: the trainer writes each payload body to a file in `directory` and tells the
engine which file with a message of its own (`echo.file`); the engine reads that file. Same host
only."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from weightsync import (Adapter, Message, Payload, PayloadError, Transport,
                        TransportReceiver)


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    directory: str = Field(description="a directory the trainer writes and the engines read")


class EchoFile(Message):
    """The echo transport's own message: `body` is {"header": the payload's header, "file": the
    file in `directory` that holds its body}. The engine answers {"digest": ...} once staged."""

    kind = "echo.file"


class EchoReceiver(TransportReceiver):
    """The receiving half. The engine builds it by name, from its own plugin registry."""

    def deliver(self, kind: str, body: Mapping[str, Any], session: Any) -> dict[str, Any]:
        if kind != EchoFile.kind:
            return super().deliver(kind, body, session)
        file = str(body.get("file"))
        if Path(file).name != file or file.startswith("."):
            raise PayloadError(f"echo: refusing file name {file!r}; it must be a plain name")
        header = body.get("header")
        if not isinstance(header, Mapping):
            raise PayloadError("echo: an echo.file message needs the payload's header")
        data = (Path(self.options.directory) / file).read_bytes()
        if len(data) != int(header["nbytes"]):
            raise PayloadError(f"echo: {file} has {len(data)} bytes, {header['nbytes']} were sent")
        return {"digest": session.apply(header, memoryview(data))}

    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        if body is None:
            raise PayloadError("echo: a payload arrives with an echo.file message")
        if not len(body):
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)


class EchoTransport(Transport):
    name = "echo"
    Options = EchoOptions
    messages = (EchoFile,)  # the adapter must be able to deliver it
    same_host = True  # the directory is local: remote engines are refused at config load
    receiver = EchoReceiver

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        directory = Path(self.options.directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"payload-{payload.index}-{uuid.uuid4().hex}.bin"
        payload.body.cpu().numpy().tofile(path)
        message = EchoFile({"header": payload.header(), "file": path.name})
        failures: dict[str, BaseException] = {}
        try:
            for engine in engines:
                try:
                    engine.deliver(message)  # returns once the engine has staged the payload
                except Exception as e:
                    failures[engine.engine_name] = e
        finally:
            path.unlink(missing_ok=True)
        return failures
