"""An RL loop on weightsync: GRPO on samples from live engines, sync or one step off-policy,
with the train–inference gap measured every step (docs/rl.md)."""

from weightsync.rl.loop import RLLoop, StepStats
from weightsync.rl.task import CountingTask

__all__ = ["CountingTask", "RLLoop", "StepStats"]
