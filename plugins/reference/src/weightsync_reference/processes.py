"""Reference engines as real separate processes, for tests, the demo and the contract kit."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests
from safetensors.torch import load

import torch

from weightsync.net.process import ServerProcess
from weightsync.net.server import free_port
from weightsync_reference.forkserver import popen

__all__ = ["EngineProcess", "running", "start_all"]


class EngineProcess:
    """`weightsync serve` in a child process; start, kill -9, restart on the same port."""

    def __init__(self, model_dir: str | Path, *, port: int | None = None, api_key: str | None = None,
                 name: str | None = None, log: Path | None = None, env: dict[str, str] | None = None,
                 device: str = "cpu", load_roots: list[str] | None = None,
                 extra_args: list[str] | None = None, scheme: str = "http",
                 verify: bool | str = True, program: list[str] | None = None,
                 host: str = "127.0.0.1") -> None:
        self.model_dir = str(model_dir)
        self.host = host                # where it listens (an emulated host's address: netns)
        self.port = port or free_port()
        self.api_key = api_key
        self.name = name or f"{host}:{self.port}"
        self.log = log
        self.env = env
        self.device = device
        # tests load checkpoints from temporary directories: allow those unless told otherwise
        self.load_roots = [tempfile.gettempdir()] if load_roots is None else load_roots
        self.extra_args = list(extra_args or [])
        # what runs `serve`: weightsync's CLI, or a test's own engine built on it
        self.program = program or [sys.executable, "-m", "weightsync"]
        self.scheme, self.verify = scheme, verify          # https engines: --tls-cert/--tls-key
        self.server = ServerProcess(f"engine {self.name}", log)

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.server.proc

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def spec(self) -> dict:
        d: dict = {"url": self.url, "name": self.name}
        if self.verify is not True:
            d["verify"] = self.verify
        if self.api_key:
            d["api_key"] = self.api_key
        return d

    def start(self, timeout: float = 60.0) -> "EngineProcess":
        return self.launch().wait_ready(timeout)

    def launch(self) -> "EngineProcess":
        """Start the process without waiting for it (`start_all` starts several at once)."""
        cmd = [*self.program, "serve", "--model", self.model_dir, "--host", self.host,
               "--port", str(self.port), "--name", self.name, "--device", self.device]
        for root in self.load_roots:
            cmd += ["--load-root", root]
        cmd += self.extra_args
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        self.server.launch(cmd, self.env, spawn=popen)     # forked where a test runs a fork server
        return self

    def wait_ready(self, timeout: float = 60.0) -> "EngineProcess":
        """Until the launched engine answers /health (its start failing or timing out stops it)."""
        self.server.wait_healthy(self.url + "/health", timeout, verify=self.verify)
        return self

    def kill(self) -> None:
        """SIGKILL: the engine dies wherever it is, as a crashed replica would."""
        self.server.kill()

    def stop(self) -> None:
        self.server.stop(grace=10.0)

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        r = requests.get(self.url + "/weights", params={"name": names or []}, headers=self._headers(),
                         timeout=60, verify=self.verify)
        r.raise_for_status()
        return load(r.content)

    def holds(self, sd: dict[str, torch.Tensor]) -> bool:
        """Whether the engine holds every tensor of `sd` bit for bit (dtype, shape and bytes)."""
        got = self.weights()
        return set(got) >= set(sd) and all(
            got[n].dtype == t.dtype and got[n].shape == t.shape
            and torch.equal(got[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
            for n, t in sd.items())

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=5, verify=self.verify).json()

    def generate(self, ids: list[int], n: int) -> dict:
        r = requests.post(self.url + "/generate", json={"input_ids": ids, "max_new_tokens": n},
                          headers=self._headers(), timeout=120, verify=self.verify)
        r.raise_for_status()
        return r.json()

    def __enter__(self) -> "EngineProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_all(engines: list[EngineProcess], timeout: float = 60.0) -> list[EngineProcess]:
    """Start engines side by side (each start is mostly imports: on a machine with more than one
    core, N engines take about the time of one); if one fails, all are stopped."""
    try:
        for e in engines:
            e.launch()
        for e in engines:
            e.wait_ready(timeout)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


@contextmanager
def running(model_dir: str | Path, logs: Path, n: int, programs: dict[int, list[str]] | None = None,
            timeout: float = 120.0) -> Iterator[list[EngineProcess]]:
    """`n` engines named e0.. serving `model_dir` (engine i runs `programs[i]` instead of
    `weightsync serve` where given: a misbehaving engine), started side by side, logs in `logs`,
    stopped on the way out."""
    engines = [EngineProcess(model_dir, name=f"e{i}", log=logs / f"e{i}.log",
                             program=(programs or {}).get(i)) for i in range(n)]
    start_all(engines, timeout=timeout)
    try:
        yield engines
    finally:
        for e in engines:
            e.stop()
