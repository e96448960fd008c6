"""The reference engine's launcher (`register_launchers`): the argv of `weightsync serve` for
Ray's engine actors, and an engine process on this machine for the RL demo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from weightsync.interfaces import Launcher, LocalEngine

__all__ = ["ReferenceLauncher"]


class ReferenceLauncher(Launcher):
    name = "reference"

    @classmethod
    def start_command(cls, model: str, host: str, port: int, name: str,
                      options: dict[str, Any], env: dict[str, str], **extra: Any) -> list[str]:
        argv = ["{python}", "-m", "weightsync", "serve", "--model", model, "--host", host,
                "--port", str(port), "--name", name, "--device", str(extra.get("device", "cpu"))]
        for root in extra.get("load_roots") or []:
            argv += ["--load-root", root]
        if extra.get("api_key"):
            env["WEIGHTSYNC_API_KEY"] = extra["api_key"]
        return argv

    @classmethod
    def launch_local(cls, model_dir: Path, workdir: Path, name: str,
                     extra_args: list[str] | None = None) -> LocalEngine:
        from weightsync.net.process import start_limits
        from weightsync_reference.processes import EngineProcess
        timeout, stall = start_limits(300.0, 120.0)     # the environment's, where set
        e = EngineProcess(model_dir, name=name, log=Path(workdir) / f"{name}.log",
                          extra_args=extra_args or []).launch()
        e.server.wait_healthy(e.url + "/health", timeout, verify=e.verify, stall=stall)
        return LocalEngine(e.spec(), e.stop)
