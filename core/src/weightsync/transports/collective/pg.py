"""Process groups outside the default world, built exactly as SGLang's `init_custom_process_group`
builds them (a TCPStore, a PrefixStore named after the group, `_new_process_group_helper`), so
SGLang and LMDeploy engines join a group the trainer made."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

log = logging.getLogger(__name__)

__all__ = ["Group", "broadcast", "default_backend", "finish_broadcast", "forget", "make_store",
           "new_group", "shutdown", "start_broadcast"]


@dataclass
class Group:
    """One live process group and the store it rendezvoused through."""

    name: str
    pg: Any
    store: Any
    rank: int
    world_size: int
    backend: str


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def make_store(address: str, port: int, world_size: int, is_master: bool, timeout: float) -> Any:
    """The rendezvous store; the group creation, not the store, waits for the workers."""
    from torch.distributed import TCPStore
    return TCPStore(address, port, world_size, is_master=is_master,
                    timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)


def new_group(store: Any, group_name: str, rank: int, world_size: int, backend: str,
              timeout: float) -> Any:
    """`init_custom_process_group` on PrefixStore(group_name, store); raises after `timeout`."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    prefixed = PrefixStore(group_name, store)
    kw: dict[str, Any] = {"backend_options": None}
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), prefixed,
                                      group_name=cast("GroupName", group_name),
                                      timeout=datetime.timedelta(seconds=timeout),
                                      **kw)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    # No barrier here: SGLang's and LMDeploy's init_custom_process_group issue none, so one on
    # rank 0 would wait forever for them. gloo connects the full mesh while the group is
    # created, so a rank that never joins still surfaces here, within `timeout`.
    return pg


def forget(pg: Any) -> None:
    """Drop a group from torch's bookkeeping (not the default world): no later name clash."""
    from torch.distributed.distributed_c10d import _world
    try:
        for attr in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_coalesce_state"):
            m = getattr(_world, attr, None)
            if isinstance(m, dict):
                m.pop(pg, None)
        tags = getattr(_world, "tags_to_pg", None)
        if isinstance(tags, dict):
            for v in tags.values():
                if pg in v:
                    v.remove(pg)
        pg_to_tag = getattr(_world, "pg_to_tag", None)
        if isinstance(pg_to_tag, dict):
            pg_to_tag.pop(pg, None)
    except Exception as e:  # noqa: BLE001 - bookkeeping only
        log.debug("process group bookkeeping cleanup failed: %s", e)


def shutdown(pg: Any) -> None:
    """Release sockets/communicators (may block on a dead peer: run it on a spare thread)."""
    try:
        if hasattr(pg, "shutdown"):
            pg.shutdown()
    except Exception as e:  # noqa: BLE001 - a dead peer makes shutdown fail; the group is gone anyway
        log.debug("process group shutdown failed: %s", e)


def start_broadcast(pg: Any, tensor: torch.Tensor, timeout: float) -> Any:
    """Rank 0 -> every rank, in place; returns the pending work."""
    from torch.distributed import BroadcastOptions
    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=timeout)
    return pg.broadcast([tensor], opts)


def finish_broadcast(work: Any, tensor: torch.Tensor, timeout: float) -> None:
    """Wait for `work`; raises if a peer died or the timeout passed."""
    work.wait(datetime.timedelta(seconds=timeout))
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def broadcast(pg: Any, tensor: torch.Tensor, timeout: float) -> None:
    """Rank 0 -> every rank, in place. Raises if a peer died or the timeout passed."""
    finish_broadcast(start_broadcast(pg, tensor, timeout), tensor, timeout)
