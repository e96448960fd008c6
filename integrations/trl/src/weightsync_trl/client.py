"""`WeightSyncVLLMClient`: TRL's `VLLMClient` with its weight-sync methods pushing through
weightsync instead of vLLM's NCCL engine. Generation (`generate`, `chat`, ...) is TRL's own and
goes to TRL's one server; the weights go to every engine of weightsync's fleet.

TRL 1.16 syncs with `init_communicator(device)` once, then per step
`update_named_params(metadata, iterator)` and `reset_prefix_cache()`; a user may also group
`update_named_param` calls in `with client.weight_update():`. Either way one step is ONE
weightsync push (one version): parts are collected and pushed when the group closes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from trl.generation.vllm_client import VLLMClient
from weightsync import SyncReport

from .session import ConfigSource, SyncSession, distributed


class WeightSyncVLLMClient(VLLMClient):
    """Built by TRL exactly like `VLLMClient` (base_url, group_port, connection_timeout);
    `use_weightsync` binds the config through a subclass (`weightsync_config`)."""

    weightsync_config: ClassVar[ConfigSource] = None
    weightsync_sessions: ClassVar[list[SyncSession] | None] = None   # every session built, in order

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weightsync = SyncSession(self.weightsync_config, server_url=self.base_url)
        if self.weightsync_sessions is not None:
            self.weightsync_sessions.append(self.weightsync)
        self._parts: dict[str, torch.Tensor] = {}

    @property
    def last_report(self) -> SyncReport | None:
        return self.weightsync.last_report

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        """Builds the weightsync pipeline (any device: weightsync's transports need no NCCL)."""
        self.weightsync.open()

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]],
                            named_params: Iterator[tuple[str, torch.Tensor]]) -> None:
        """One verified push of every tensor (inside `weight_update()`: collected for one push
        when the group closes). `metadata` is checked against what the iterator yields."""
        expected = {m[0]: (str(m[1]), [int(x) for x in m[2]]) for m in metadata}
        copy = self._updating_weights or distributed()
        items = []
        for name, t in named_params:
            want = expected.get(name)
            if want is not None and list(t.shape) != want[1]:
                raise ValueError(f"tensor {name!r} has shape {list(t.shape)} but TRL's metadata "
                                 f"says {want[1]}")
            items.append((name, t.detach().clone() if copy else t.detach()))
        missing = sorted(set(expected) - {n for n, _ in items})
        if missing:
            raise ValueError(f"TRL's metadata names {len(missing)} tensors the iterator did not "
                             f"yield, e.g. {missing[:3]}")
        if self._updating_weights:
            self._parts.update(items)
            return
        self.weightsync.push(items)

    def _start_weight_update(self) -> None:
        self._parts = {}

    def _finish_weight_update(self) -> None:
        parts, self._parts = self._parts, {}
        if parts:
            self.weightsync.push(parts.items())

    def reset_prefix_cache(self) -> None:
        """Nothing to do: every push already reset each engine's prefix cache right after its new
        weights landed (the vllm adapter's `reset_prefix_cache` option)."""

    def close_communicator(self) -> None:
        self.weightsync.close()
