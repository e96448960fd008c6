"""An RL loop on weightsync: GRPO on samples from live engines, sync or one step off-policy,
with the train–inference gap measured every step (docs/rl.md); rollouts through one client or
router over a fleet's live members (`weightsync_rl.rollout`); the demo. Its own distribution
(`weightsync-rl`): core never imports it."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsync_rl.loop import PushesFailed, RLLoop, StepStats
    from weightsync_rl.task import CountingTask

__version__ = "0.2.0"   # the one source: hatch reads it for the distribution's version

_LAZY = {"PushesFailed": "weightsync_rl.loop", "RLLoop": "weightsync_rl.loop",
         "StepStats": "weightsync_rl.loop",
         "CountingTask": "weightsync_rl.task"}


def __getattr__(name: str) -> Any:
    """The names load on first use, so the plugin's hooks (and `weightsync --help`) do not import
    torch."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["CountingTask", "PushesFailed", "RLLoop", "StepStats"]
