"""weightsync's adapter contract, run against the LMDeploy stand-in server (a real process),
over both of LMDeploy's paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import weightsync_lmdeploy.adapter as adapter_mod

from lmd_process import Standin
from weightsync.config import EngineSpec
from weightsync.interfaces import Adapter
from weightsync.testing.contracts import AdapterContract
from weightsync_lmdeploy.adapter import LmdeployAdapter, LmdeployOptions


class _LmdeployContract(AdapterContract):
    options: dict[str, Any] = {"ipc_device": "cpu", "payload_timeout": 60.0}

    def start_engine(self, tmp_path: Path, model: dict[str, torch.Tensor]) -> tuple[EngineSpec, Any]:
        s = Standin(tmp_path, model).start()
        # LMDeploy has no version route: the adapter remembers versions per URL in this process.
        # A fresh engine on a port an earlier test's engine used is indistinguishable, so forget it.
        with adapter_mod._versions_lock:
            adapter_mod.versions.pop(s.url.rstrip("/"), None)
        self._standins = {**getattr(self, "_standins", {}), s.url: s}
        return EngineSpec(url=s.url, options=dict(self.options)), s.stop

    def make_adapter(self, spec: EngineSpec) -> Adapter:
        return LmdeployAdapter(LmdeployOptions(**spec.options), spec)

    def read_weights(self, spec: EngineSpec, names: list[str]) -> dict[str, torch.Tensor] | None:
        return self._standins[spec.url].weights()


class TestAdapterContractUpdateWeights(_LmdeployContract):
    transport = "lmdeploy_ipc"


class TestAdapterContractCollective(_LmdeployContract):
    transport = "collective"
    transport_options = {"backend": "gloo", "timeout": 60}
