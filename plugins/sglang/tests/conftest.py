"""Fixtures: the SGLang stand-in server as a real subprocess, and SGLang 0.5.23's own code
installed (without its dependencies) into a test-only folder for the compatibility checks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from safetensors.torch import load
from weightsync.net.server import free_port
from weightsync.testing.sample import sample_state_dict, write_weights_only_model

try:            # forked from the suite's fork server where one runs (weightsync-reference's)
    from weightsync_reference.forkserver import popen
except ImportError:
    popen = subprocess.Popen  # type: ignore[assignment]

HERE = Path(__file__).parent
STANDIN = HERE / "standin" / "sglang_standin.py"
PLUGIN = HERE.parent
REF_DIR = Path(sys.prefix) / "sglang-ref"   # test-env state: inside the venv, outside the source tree
SGLANG = "sglang==0.5.23"
# what SGLang's weight-sync modules import beyond torch/numpy/pydantic/requests (all pure or
# small wheels); --no-deps everywhere, into REF_DIR only: .venv (torch 2.13.0+cpu) is untouched
SGLANG_LIGHT_DEPS = ["orjson", "msgspec", "pybase64", "ipython", "traitlets"]


class StandIn:
    """One stand-in SGLang server process (tests/standin/sglang_standin.py)."""

    def __init__(self, model_dir: Path, log: Path, *, tp_size: int = 1, admin_key: str | None = None,
                 group_timeout: float = 30.0, step_seconds: float = 0.02, name: str | None = None,
                 deterministic: bool = False) -> None:
        self.port = free_port()
        self.model_dir = model_dir
        self.admin_key = admin_key
        self.tp_size = tp_size
        self.name = name or f"sglang-{self.port}"
        cmd = [sys.executable, str(STANDIN), "--model", str(model_dir), "--port", str(self.port),
               "--tp-size", str(tp_size), "--group-timeout", str(group_timeout),
               "--step-seconds", str(step_seconds)]
        if admin_key:
            cmd += ["--admin-api-key", admin_key]
        if deterministic:
            cmd += ["--enable-deterministic-inference"]
        self._log = open(log, "ab")
        self.proc = popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stand-in exited with {self.proc.returncode}; see {log}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"stand-in did not answer /health within 60s; see {log}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self, **options: Any) -> dict[str, Any]:
        d: dict[str, Any] = {"url": self.url, "name": self.name}
        if self.admin_key:
            d["api_key"] = self.admin_key
        opts = {"tp_size": self.tp_size, **options}
        d["options"] = opts
        return d

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def weights(self) -> dict[str, torch.Tensor]:
        r = requests.get(self.url + "/standin/weights", headers=self._headers(), timeout=30)
        r.raise_for_status()
        return load(r.content)

    def state(self) -> dict[str, Any]:
        r = requests.get(self.url + "/standin/state", headers=self._headers(), timeout=30)
        r.raise_for_status()
        return r.json()

    def weight_version(self) -> Any:
        return requests.get(self.url + "/model_info", timeout=10).json()["weight_version"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def model_sd() -> dict[str, torch.Tensor]:
    return sample_state_dict()


@pytest.fixture
def model_dir(tmp_path: Path, model_sd: dict[str, torch.Tensor]) -> Path:
    return write_weights_only_model(tmp_path / "model", model_sd)


@pytest.fixture
def start_standin(tmp_path: Path, model_dir: Path) -> Iterator[Callable[..., StandIn]]:
    started: list[StandIn] = []

    def start(model: Path | None = None, **kw: Any) -> StandIn:
        s = StandIn(model or model_dir, tmp_path / f"standin{len(started)}.log", **kw)
        started.append(s)
        return s
    yield start
    for s in started:
        s.stop()


def _ref_ready() -> bool:
    return (REF_DIR / "sglang" / "srt" / "weight_sync" / "tensor_bucket.py").exists() and \
        (REF_DIR / ".complete").exists()


@pytest.fixture(scope="session")
def sglang_ref() -> Path:
    """SGLang 0.5.23's own code in <venv>/sglang-ref (pip --no-deps --target): never
    installed into .venv and never a dependency of the plugin."""
    if not _ref_ready():
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
               "--no-deps", "--target", str(REF_DIR), SGLANG, *SGLANG_LIGHT_DEPS]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                               check=False)
        except subprocess.TimeoutExpired:
            pytest.skip(reason=f"installing {SGLANG} (--no-deps) into {REF_DIR} took over 15 min")
        if r.returncode != 0:
            pytest.skip(reason=f"could not install {SGLANG} (--no-deps) into {REF_DIR}: "
                               f"{r.stderr.strip()[-500:]}")
        (REF_DIR / ".complete").write_text(SGLANG + "\n")
    for shadow in ("torch", "numpy", "pydantic", "pydantic_core"):
        assert not (REF_DIR / shadow).exists(), f"{REF_DIR} must not carry its own {shadow}"
    return REF_DIR


def run_with_sglang(ref: Path, script: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter that sees SGLang's code (PYTHONPATH=ref)."""
    env = {**os.environ, "PYTHONPATH": str(ref)}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def sglang_runner(sglang_ref: Path) -> Callable[..., subprocess.CompletedProcess]:
    return lambda script, *args, **kw: run_with_sglang(sglang_ref, script, *args, **kw)
