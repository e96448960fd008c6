"""Core's contract kit, run against the sglang adapter and the SGLang stand-in."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests
import torch
from safetensors.torch import load
from weightsync.config import EngineSpec
from weightsync.interfaces import Adapter
from weightsync.testing.contracts import AdapterContract
from weightsync.net.server import free_port
from weightsync.testing.sample import write_weights_only_model
from weightsync_sglang.adapter import SGLangAdapter

STANDIN = Path(__file__).parent / "standin" / "sglang_standin.py"


class TestSGLangAdapterOverTensorRoute(AdapterContract):
    transport = "sglang_tensor"

    def start_engine(self, tmp_path: Path, model: dict[str, torch.Tensor]) -> tuple[EngineSpec, Any]:
        d = write_weights_only_model(tmp_path / "model", model)
        port = free_port()
        log = open(tmp_path / "standin.log", "ab")
        p = subprocess.Popen([sys.executable, str(STANDIN), "--model", str(d), "--port", str(port)],
                             stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                raise RuntimeError(f"stand-in did not start; see {tmp_path / 'standin.log'}")
            time.sleep(0.1)

        def stop() -> None:
            p.terminate()
            p.wait(10)
            log.close()
        return EngineSpec(url=url, name=f"sglang-{port}"), stop

    def make_adapter(self, spec: EngineSpec) -> Adapter:
        return SGLangAdapter(SGLangAdapter.Options(), spec)

    def read_weights(self, spec: EngineSpec, names: list[str]) -> dict[str, torch.Tensor] | None:
        r = requests.get(spec.url + "/standin/weights", timeout=30)
        r.raise_for_status()
        return load(r.content)
