"""Making a plan's outputs, one batch (about one bucket) at a time: views of what the model holds
(zero copy), LoRA-merged values, or a conversion group's results, each kept only until its last
output. In a sharded trainer every rank walks the same batches and sends the sending rank the
slices of its own shards (`gather.exchange`), after the ranks checked they planned the same export:
a model that differs between ranks is then an error on every rank instead of a hang."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, cast

import torch
import xxhash

from weightsync.exporters.gather import SENDER, Request, Rows, exchange, rows_of
from weightsync.exporters.plan import (Group, Output, Plan, Source, contiguous_strides,
                                       needed_sources)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_FALLBACK = "full"


def _rank() -> int:
    """This process's rank in the group whose shards it gathers (the exporter's own question: it
    sits below the push, so it does not ask `sync.ranks`)."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Fetcher:
    """Holds what several outputs share (merged values, group results, fallback gathers) exactly
    until the last output that needs it has been made."""

    def __init__(self, plan: Plan, every_rank: bool = False) -> None:
        self.plan = plan
        self.me = _rank()
        self.sending = every_rank or self.me == SENDER
        self.rows: dict[Source, Rows | str] = {}
        for s in plan.sources():
            if s.distributed:
                rows = None if every_rank else rows_of(s.tensor, self.me)
                self.rows[s] = rows or _FALLBACK
        self.last: dict[Any, int] = {}
        for i, o in enumerate(plan.outputs):
            for key in self._keys(o):
                self.last[key] = i
        self.values: dict[Any, Any] = {}   # sender only: the kept values
        self.done: set[Any] = set()        # every rank: what has been fetched (same on all ranks)

    def _keys(self, o: Output) -> list[Any]:
        """What making `o` keeps in `values`: its group, merged or fully gathered sources."""
        kept: list[Any] = [o.group] if o.group is not None else []
        return kept + [s for s in needed_sources(o)
                       if s.merge is not None or self.rows.get(s) == _FALLBACK]

    # -- the plan check ----------------------------------------------------------------------
    def describe(self) -> bytes:
        h = xxhash.xxh3_128()
        for o in self.plan.outputs:
            src = o.source.name if o.source is not None else f"group:{o.group.layer_name}"  # type: ignore[union-attr]
            h.update(f"{o.name}|{list(o.shape)}|{o.dtype}|{src}|{o.stride}|{o.offset}\n".encode())
        for s, rows in self.rows.items():
            h.update(f"{s.name}|{rows}\n".encode())
        return h.digest()

    def agree(self) -> None:
        """One 16-byte all-gather before any tensor moves: every rank planned the same export."""
        import torch.distributed as dist
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.frombuffer(bytearray(self.describe()), dtype=torch.uint8).to(device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        differ = [r for r, t in enumerate(every) if not torch.equal(t, every[SENDER])]
        if differ:
            raise ValueError(f"ranks {differ} planned a different export than rank {SENDER} "
                             f"(tensor names, shapes, dtypes or shard layouts differ): every rank "
                             f"must push the same model, sharded the same way")

    # -- one batch ---------------------------------------------------------------------------
    def _local(self, s: Source) -> torch.Tensor:
        if s.merge is None:
            return s.tensor.detach()
        if s not in self.values:
            self.values[s] = s.merge(s.tensor)
        return self.values[s]

    def _whole(self, s: Source) -> Request:
        rows = self.rows[s]
        assert isinstance(rows, Rows)
        return Request(s.tensor, rows, s.shape, contiguous_strides(s.shape), 0)

    def fetch(self, start: int, batch: list[Output]) -> list[torch.Tensor] | None:
        """The batch's tensors on the sending rank; None on the others (after sending)."""
        for o in batch:                              # 1. fallback gathers: collectives, plan order
            for s in needed_sources(o):
                if self.rows.get(s) == _FALLBACK and s not in self.done:
                    full = cast("DTensor", s.tensor).full_tensor()  # falls back: a DTensor
                    self.done.add(s)
                    if self.sending:
                        self.values[s] = full
                    del full
        requests: list[Request] = []                 # 2. row-sharded slices: point to point
        wanted: dict[Any, int] = {}                  # a whole source or a view output -> request
        for o in batch:
            if o.group is not None:
                if o.group in self.done:
                    continue
                for _, _, s in o.group.members:
                    if isinstance(self.rows.get(s), Rows) and s not in wanted:
                        wanted[s] = len(requests)
                        requests.append(self._whole(s))
                self.done.add(o.group)
            elif o.source is not None and isinstance(self.rows.get(o.source), Rows):
                s = o.source
                if o.whole:
                    requests.append(self._whole(s))
                else:
                    requests.append(Request(s.tensor, self.rows[s], o.shape, o.stride, o.offset))  # type: ignore[arg-type]
                wanted[o] = len(requests) - 1
        got = exchange(requests, self.me) if requests else []
        # 3. the tensors, on the sending rank
        out = [self._make(o, got, wanted) for o in batch] if self.sending else None
        self._forget(start + len(batch) - 1)
        return out

    def _value(self, s: Source, got: list, wanted: dict) -> torch.Tensor:
        if s in wanted:
            return got[wanted[s]]
        if self.rows.get(s) == _FALLBACK:
            return self.values[s]
        return self._local(s)

    def _make(self, o: Output, got: list, wanted: dict) -> torch.Tensor:
        if o.group is not None:
            if o.group not in self.values:
                self.values[o.group] = self._run(o.group, got, wanted)
            return self.values[o.group][o.key]
        s = o.source
        assert s is not None
        if o in wanted:
            return got[wanted[o]]
        v = self._value(s, got, wanted)
        if o.whole:
            return v
        return v.as_strided(o.shape, o.stride, v.storage_offset() + o.offset)  # type: ignore[arg-type]

    def _run(self, group: Group, got: list, wanted: dict) -> dict[str, torch.Tensor]:
        return group.run({s: self._value(s, got, wanted) for _, _, s in group.members})

    def _forget(self, index: int) -> None:
        for key in [k for k, last in self.last.items() if last <= index]:
            self.values.pop(key, None)
            del self.last[key]


def stream(plan: Plan, batch_bytes: int, every_rank: bool = False
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in plan order on the sending rank (every rank with `every_rank`); the others
    yield nothing. Closed early on the sending rank (an abandoned sync), it still serves the
    remaining batches' exchanges so the other ranks are not left waiting."""
    fetcher = Fetcher(plan, every_rank)
    if plan.distributed:
        fetcher.agree()
    elif not fetcher.sending:
        return
    batches = plan.batches(batch_bytes)
    try:
        for start, batch in batches:
            tensors = fetcher.fetch(start, batch)
            if tensors is None:
                continue
            for o, t in zip(batch, tensors):
                yield o.name, t
            del tensors
    except GeneratorExit:
        if plan.distributed:
            for start, batch in batches:
                fetcher.fetch(start, batch)
        raise
