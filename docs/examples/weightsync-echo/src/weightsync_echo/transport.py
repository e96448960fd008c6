"""Transport `echo`: the trainer writes each payload body to a file in `directory` and announces
it; the engine reads the file the announcement names. Same host only."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from weightsync import Adapter, Payload, PayloadError, Transport, TransportReceiver


class EchoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    directory: str = Field(description="a directory the trainer writes and the engines read")


class EchoReceiver(TransportReceiver):
    """The receiving half. The engine builds it by name, from its own plugin registry."""

    def receive(self, header: Mapping[str, Any], body: memoryview | None) -> torch.Tensor:
        file = str(header["transport"]["file"])
        if Path(file).name != file or file.startswith("."):
            raise PayloadError(f"echo: refusing file name {file!r}; it must be a plain name")
        data = (Path(self.options.directory) / file).read_bytes()
        if len(data) != int(header["nbytes"]):
            raise PayloadError(f"echo: {file} has {len(data)} bytes, {header['nbytes']} were sent")
        if not data:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class EchoTransport(Transport):
    name = "echo"
    Options = EchoOptions
    requires = "announce"  # the adapter tells the engine where the bytes are
    same_host = True  # the directory is local: remote engines are refused at config load
    receiver = EchoReceiver

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        directory = Path(self.options.directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"payload-{payload.index}-{uuid.uuid4().hex}.bin"
        payload.body.cpu().numpy().tofile(path)
        header = payload.header(file=path.name)
        failures: dict[str, BaseException] = {}
        try:
            for engine in engines:
                try:
                    engine.announce(header)  # returns once the engine has staged the payload
                except Exception as e:
                    failures[engine.engine_name] = e
        finally:
            path.unlink(missing_ok=True)
        return failures
