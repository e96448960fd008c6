"""The trainer's half of transport `collective`: send buffers used in turn, announces, broadcasts
watched alongside them, and who broke a broadcast (the package docstring says why)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel

from weightsync.errors import TransportError
from weightsync.interfaces import Adapter, JoinsGroups, Payload, Transport
from weightsync.transports.collective import pg as pgs
from weightsync.transports.collective.ahead import AnnounceAhead, _Ahead
from weightsync.transports.collective.calls import _Call, _spawn
from weightsync.transports.collective.group import GroupLifecycle
from weightsync.transports.collective.layout import split_payload
from weightsync.transports.collective.messages import Broadcast, JoinGroup, LeaveGroup
from weightsync.transports.collective.options import CollectiveOptions
from weightsync.transports.collective.receiving import CollectiveReceiver


class _Buffer:
    """One reusable send buffer (warm memory), handed out again once its broadcast is done."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.free = threading.Event()
        self.free.set()

    def holds(self, t: torch.Tensor) -> bool:
        b = self.tensor
        return (b is not None and b.device == t.device and b.data_ptr() <= t.data_ptr()
                and t.data_ptr() + t.numel() <= b.data_ptr() + b.numel())


class CollectiveTransport(GroupLifecycle, AnnounceAhead, Transport):
    name = "collective"
    Options = CollectiveOptions
    requires = (JoinsGroups,)
    messages = (Broadcast, JoinGroup, LeaveGroup)
    receiver = CollectiveReceiver
    # Transport's optional hook, filled by the mixin's method (named here for the type checker)
    announce_ahead = AnnounceAhead.announce_ahead

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self.group: pgs.Group | None = None
        self.infos: dict[str, dict[str, Any]] = {}
        self.key: tuple | None = None
        self.backend = self.options.backend if self.options.backend != "auto" else pgs.default_backend()
        self.pending: list[tuple[dict[str, _Call], int]] = []   # announces of the previous broadcast
        self._seq = 0                                             # broadcasts on the current group
        self._members: dict[str, Adapter] = {}
        self._ring = [_Buffer() for _ in range(self.options.buffers)]
        self._turn = 0
        self._ring_lock = threading.Lock()
        # announces made ahead (`announce_ahead`): by payload index, with the seq they carry
        self._ahead: dict[int, _Ahead] = {}
        self._ahead_seq = 0          # the seq the next announce made ahead carries
        self._ahead_next = -1        # the payload index that may be announced ahead next
        self._ahead_lock = threading.Lock()

    def alloc(self, nbytes: int) -> torch.Tensor:
        """The next send buffer, once its previous broadcast is done; grown when too small."""
        with self._ring_lock:
            buf = self._ring[self._turn]
            self._turn = (self._turn + 1) % len(self._ring)
        wait = self.bounded(self.options.timeout)
        if not buf.free.wait(wait):
            raise TransportError(f"no send buffer was released within {wait:.0f}s")
        buf.free.clear()
        if buf.tensor is None or buf.tensor.numel() < nbytes:
            buf.tensor = None
            device = "cuda" if self.backend == "nccl" else "cpu"
            buf.tensor = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)
        return buf.tensor[:nbytes]

    def _release(self, body: torch.Tensor, retire: bool = False) -> None:
        """The buffer of `body` is free again; `retire`: with fresh memory (the old may be read)."""
        for b in self._ring:
            if b.holds(body):
                if retire:
                    b.tensor = None
                b.free.set()

    def open(self, engines: Sequence[Adapter], version: int) -> dict[str, BaseException]:
        with self._ring_lock:       # buffers of an aborted sync were never sent: all free again
            self._turn = 0
            for b in self._ring:
                b.free.set()
        self._forget_ahead()
        self._layout(engines)
        if not engines:
            return {}
        fails = self._ensure(engines)
        with self._ahead_lock:
            self._ahead_seq, self._ahead_next = self._seq, 0
        return fails
    # -- sending ----------------------------------------------------------------------------
    def _device(self, t: torch.Tensor) -> torch.Tensor:
        if self.backend == "nccl" and not t.is_cuda:
            return t.cuda(non_blocking=False)
        if self.backend == "gloo" and t.device.type != "cpu":
            return t.cpu()
        return t

    def _drain(self, keep: int = 0) -> dict[str, BaseException]:
        """Wait for the announces of every broadcast but the last `keep`; their failures."""
        fails: dict[str, BaseException] = {}
        cut = max(0, len(self.pending) - keep)
        done, self.pending = self.pending[:cut], self.pending[cut:]
        for calls, _ in done:
            wait = self.bounded(self.options.timeout)
            for name, c in calls.items():
                if not c.done(wait):
                    fails.setdefault(name, TransportError(
                        f"engine did not finish loading a broadcast bucket within {wait:.0f}s"))
                elif c.error:
                    fails.setdefault(name, c.error[0])
        return fails

    def discard(self, payload: Payload) -> None:
        with self._ahead_lock:
            ahead = self._ahead.pop(payload.index, None)
            if ahead is not None:
                self._drop_ahead(ahead)
        self._release(payload.body)

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        try:
            return self._send(payload, engines)
        finally:
            self._release(payload.body)

    def _send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        failures: dict[str, BaseException] = {}
        layout = self._layout(engines)
        engines = list(engines)
        pieces = ([(payload.body, "uint8", None)] if layout == "safetensors"
                  else split_payload(payload.body, layout))
        k = attempts = 0
        ahead = self._take_ahead(payload, engines)
        while k < len(pieces) and engines:
            fails = self._ensure(engines)
            failures.update(fails)
            engines = [a for a in engines if a.engine_name not in fails]
            if not engines or self.group is None:
                break
            tensor, dtype, specs = pieces[k]
            # engines that serve announces in arrival order must see k done before k+1; others
            # stage the previous bucket while this one is broadcast (never more than two)
            keep = 1 if all(a.ordered_announces for a in engines) else 0
            for name, err in self._drain(keep).items():
                failures.setdefault(name, err)
            if ahead is not None and ahead.group == self.group.name:
                calls, wake = ahead.calls, ahead.wake
            else:
                with self._ahead_lock:       # announced here: later payloads are too
                    self._ahead_next = -1
                fields = {"group_name": self.group.name, "layout": layout, "seq": self._seq,
                          "nbytes": tensor.numel() * tensor.element_size(), "dtype": dtype,
                          "numel": tensor.numel()}
                if specs is not None:
                    fields["tensors"] = specs
                header = payload.header(**fields)
                wake = threading.Event()
                calls = {a.engine_name: _spawn(a.deliver, Broadcast(header), wake=wake) for a in engines}
            try:
                self._broadcast(self._device(tensor), calls, payload.body, wake)
            except Exception as e:  # noqa: BLE001 - find who broke it, rebuild, send again
                attempts += 1
                ahead = None
                with self._ahead_lock:
                    self._ahead_next = -1
                failures.update(self._broken(engines, calls, attempts, payload.index, e))
                engines = [a for a in engines if a.engine_name not in failures]
                self.key = None              # the group has a broken rank: rebuild it
                for name, err in self._drain().items():
                    failures.setdefault(name, err)
                continue
            self._seq += 1
            self.pending.append((calls, payload.index))
            ahead = None
            k += 1
        return failures

    def _broadcast(self, tensor: torch.Tensor, calls: dict[str, _Call], body: torch.Tensor,
                   wake: threading.Event | None = None) -> None:
        """Broadcast while watching the announces: one that fails (its engine never posts its
        receive) abandons the broadcast at once instead of after the whole timeout, and retires
        the buffer. The wait wakes on completion or an announce's failure, whichever is first."""
        timeout = self.bounded(self.options.timeout)       # never past the push's deadline
        assert self.group is not None                       # _send checked it
        work = pgs.start_broadcast(self.group.pg, tensor, timeout)
        wake = wake or threading.Event()
        try:
            work.get_future().add_done_callback(lambda _: wake.set())
        except (AttributeError, RuntimeError):       # a backend without futures: poll
            wake = None
        deadline = time.monotonic() + timeout
        nap = 0.0005
        while not work.is_completed():
            bad = [(n, c.error[0]) for n, c in calls.items() if c.error]
            if bad or time.monotonic() > deadline:
                self._release(body, retire=True)
                if bad:
                    raise TransportError(f"engine {bad[0][0]} failed before receiving the "
                                         f"broadcast: {bad[0][1]}")
                raise TransportError(f"broadcast did not complete within {timeout:.0f}s (the push's "
                                     f"deadline or the transport's timeout)")
            if wake is not None and not wake.is_set():
                wake.wait(min(0.25, max(0.0, deadline - time.monotonic())))
            else:       # no future, or it fired a moment before the work says completed
                time.sleep(nap)
                nap = min(nap * 2, 0.005)
        pgs.finish_broadcast(work, tensor, timeout)

    def _broken(self, engines: Sequence[Adapter], calls: dict[str, _Call], attempts: int,
                index: int, err: BaseException) -> dict[str, BaseException]:
        """Who broke a broadcast: first the engines that no longer answer health; on a second
        failure also those whose announce failed; on a third, all."""
        fails: dict[str, BaseException] = {}
        dead: dict[str, BaseException] = {}
        for a in engines:
            try:
                a.health()
            except Exception as e:  # noqa: BLE001 - this engine is gone
                dead[a.engine_name] = e
        for a in engines:
            c = calls[a.engine_name]
            if a.engine_name in dead:
                fails[a.engine_name] = c.error[0] if c.done(0.5) and c.error else dead[a.engine_name]
            elif attempts >= 2 and c.done(0.5) and c.error:
                fails[a.engine_name] = c.error[0]
        if attempts >= 3 or (attempts >= 2 and not fails):
            for a in engines:
                fails.setdefault(a.engine_name, TransportError(
                    f"broadcast of bucket {index} failed twice: {err}"))
        return fails

    def finish(self, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        self._forget_ahead()
        return self._drain()

    def close(self) -> None:
        self._forget_ahead()
        self._drain()
        self._destroy()
