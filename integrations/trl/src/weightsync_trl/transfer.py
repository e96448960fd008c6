"""`WeightSyncTransfer`: the `weight_transfer=` object of TRL's AsyncGRPOTrainer
(`trl.experimental.async_grpo`), pushing through weightsync into one or many vLLM servers.

The trainer calls `init_weight_transfer()` once on train begin, then per sync `pause()`,
`send_weights(iterator)`, `resume()`, and `destroy()` on train end. The push pauses each engine
itself, only around its swap (weightsync's `pause: swap`), so `pause()` and `resume()` only mark
the window; generation keeps running while the bytes move and are verified."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from weightsync import SyncReport

from .session import ConfigSource, SyncSession, distributed


class WeightSyncTransfer:
    """`AsyncGRPOTrainer(..., weight_transfer=WeightSyncTransfer(config))`.

    Versions are 1, 2, ... (the async trainer's `model_version` after each sync), or what
    `version()` returns; `attach(trainer)` logs `weightsync/*` metrics into its logs."""

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
        self.session.trainer = trainer       # metrics only: versions stay the sync count
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
