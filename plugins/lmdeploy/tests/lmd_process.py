"""The LMDeploy stand-in server (lmd_standin.py) as a real child process, for tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests
import torch
from safetensors.torch import load, save_file

from weightsync.net.server import free_port

HERE = Path(__file__).parent


class Standin:
    """`python lmd_standin.py` in a child process holding `model`'s tensors."""

    def __init__(self, tmp: Path, model: dict[str, torch.Tensor], *, tp: int = 1,
                 backend: str = "pytorch", api_key: str | None = None,
                 logprobs_mode: str | None = "raw_logprobs") -> None:
        self.logprobs_mode = logprobs_mode
        self.port = free_port()
        self.tp, self.backend, self.api_key = tp, backend, api_key
        self.model_file = tmp / f"standin-{self.port}.safetensors"
        save_file({k: v.contiguous() for k, v in model.items()}, str(self.model_file))
        self.log = tmp / f"standin-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self, **options: Any) -> dict[str, Any]:
        d: dict[str, Any] = {"url": self.url, "name": f"lmdeploy-{self.port}"}
        if self.api_key:
            d["api_key"] = self.api_key
        opts = {"tp_size": self.tp, "backend": self.backend, "payload_timeout": 60.0, **options}
        d["options"] = opts
        return d

    def start(self, timeout: float = 120.0) -> "Standin":
        cmd = [sys.executable, str(HERE / "lmd_standin.py"), "--model", str(self.model_file),
               "--port", str(self.port), "--tp", str(self.tp), "--backend", self.backend,
               "--group-timeout", "60"]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.logprobs_mode:
            cmd += ["--logprobs-mode", self.logprobs_mode]
        self._fh = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stand-in exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                requests.get(self.url + "/standin/stats", timeout=1)
                return self
            except requests.RequestException:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"stand-in did not start within {timeout}s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_fh", None):
            self._fh.close()

    def stats(self) -> dict[str, Any]:
        return requests.get(self.url + "/standin/stats", timeout=10).json()

    def weights(self, rank: int = 0) -> dict[str, torch.Tensor]:
        r = requests.get(self.url + "/standin/weights", params={"rank": rank}, timeout=60)
        if r.status_code != 200:
            raise AssertionError(f"stand-in weights: HTTP {r.status_code}: {r.text}")
        return load(r.content)

    def is_sleeping(self) -> bool:
        h = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return requests.get(self.url + "/is_sleeping", headers=h, timeout=10).json()["is_sleeping"]
