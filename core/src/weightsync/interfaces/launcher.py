"""Launchers: how an engine kind is started, apart from how it is driven (the Adapter). Ray's
engine actors ask for an argv (`start_command`); the RL demo starts engines on this machine
(`launch_local`). Engine plugins register one per adapter name (`register_launchers`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

from weightsync.interfaces.sampling import Unsupported

__all__ = ["Launcher", "LocalEngine"]


@dataclass
class LocalEngine:
    """An engine `Launcher.launch_local` started: its config entry and how to stop it."""

    spec: dict[str, Any]
    stop: Callable[[], None]


class Launcher:
    """Starts engines of one kind; `name` is the name of the adapter that drives them."""

    name: ClassVar[str]

    @classmethod
    def start_command(cls, model: str, host: str, port: int, name: str,
                      options: dict[str, Any], env: dict[str, str], **extra: Any) -> list[str]:
        """The argv that starts this engine on `model` at host:port (Ray's engine actors); may
        add to `env` and `options`. "{python}" stands for the node's interpreter; `extra`: the
        launch's other fields (device, load_roots, api_key)."""
        raise Unsupported(f"launcher {cls.name!r} has no start command; give the launch a `command`")

    @classmethod
    def launch_local(cls, model_dir: Path, workdir: Path, name: str,
                     extra_args: list[str] | None = None) -> LocalEngine:
        """Start one engine here serving `model_dir` (logs in `workdir`, `extra_args` added)."""
        raise Unsupported(f"launcher {cls.name!r} cannot start an engine on this machine")
