"""`WeightSyncTransfer`: the `weight_transfer=` object of TRL's AsyncGRPOTrainer
(`trl.experimental.async_grpo`), pushing through weightsync into one or many vLLM servers.

The trainer calls `init_weight_transfer()` once on train begin, then per sync `pause()`,
`send_weights(iterator)`, `resume()`, and `destroy()` on train end. The push pauses each engine
itself, only around its swap (weightsync's `pause: swap`), so `pause()` and `resume()` only mark
the window; generation keeps running while the bytes move and are verified.

The trainer syncs every `weight_sync_steps` optimizer steps; when `max_steps` is not a multiple
of it, the last steps would never reach the servers. `attach(trainer)` adds `FinalSync`: at
train end it runs the trainer's own `_sync_weight()` once more, so the servers end on the final
policy."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import TrainerCallback
from weightsync import SyncReport

from .session import ConfigSource, SyncSession, distributed


class WeightSyncTransfer:
    """`AsyncGRPOTrainer(..., weight_transfer=WeightSyncTransfer(config))`.

    Versions are `base + 1, base + 2, ...` (`base`: what the servers held at the first sync, 0
    on fresh servers; the trainer's `model_version` after each sync is the count), or what
    `version()` returns. `attach(trainer)` adds the final sync and logs `weightsync/*` metrics
    into the trainer's logs."""

    def __init__(self, config: ConfigSource = None, *, server_url: str | None = None,
                 version: Callable[[], int] | None = None) -> None:
        self.session = SyncSession(config, server_url=server_url, version=version,
                                   step_versions=False)
        self.paused_at: float | None = None

    @property
    def last_report(self) -> SyncReport | None:
        return self.session.last_report

    @property
    def reports(self) -> list[SyncReport]:
        return self.session.reports

    def attach(self, trainer: Any) -> "WeightSyncTransfer":
        """Metrics into `trainer`'s logs (versions stay the sync count) and the final sync; call
        it on every rank (the final sync's gathers are collectives)."""
        self.session.trainer = trainer
        self.session.metrics_mode = "train"      # as the trainer's own perf/weight_sync_* (the
        # first sync runs at train begin, before the model is put in training mode)
        if not any(isinstance(c, FinalSync) for c in trainer.callback_handler.callbacks):
            trainer.add_callback(FinalSync(trainer))
        return self

    def init_weight_transfer(self) -> None:
        """Builds the pipeline; for a registry fleet this starts (or reaches) the registry."""
        self.session.open()

    def pause(self) -> None:
        self.paused_at = time.monotonic()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """One verified push of everything `iterator` yields, as the next version. An engine
        that fails is named in the report (and logged); the push raises only when none took it."""
        self.session.push(iterator, copy=distributed())

    def resume(self) -> None:
        self.paused_at = None

    def destroy(self) -> None:
        self.session.close()

    @property
    def fleet_url(self) -> str | None:
        """Where engines register, for a registry fleet (after `init_weight_transfer`)."""
        return self.session.sync.fleet_url if self.session.sync is not None else None


class FinalSync(TrainerCallback):
    """At train end, one more `_sync_weight()` of the async trainer when its last optimizer step
    was not synced (`global_step % weight_sync_steps != 0`): the same rule on every rank."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        every = max(int(getattr(args, "weight_sync_steps", 1) or 1), 1)
        if state.global_step % every:
            self.trainer._sync_weight()
