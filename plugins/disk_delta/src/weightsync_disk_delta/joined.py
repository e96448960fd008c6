"""`map_joined`: a function over items on worker threads that returns or raises only once no
call is running any more and none will start, also when one of them fails or the caller is
interrupted (Ctrl-C). Writes into a mapped data file must all be over before the caller undoes
them or unmaps the file; a pool's `map` raises at the first error while the other workers still
write.

The workers are long-lived (started once per process, again after a fork), so a call starts no
thread: an interrupt can only land while the caller waits, and then it waits on."""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, Iterable, TypeVar

from weightsync.wire.pool import workers

T = TypeVar("T")
R = TypeVar("R")


class _Batch:
    """One map_joined call: its items, results and the count of calls in progress."""

    def __init__(self, fn: Callable[[Any], Any], items: list[Any]) -> None:
        self.fn, self.items = fn, items
        self.results: list[Any] = [None] * len(items)
        self.errors: list[tuple[int, BaseException]] = []
        self.next = self.active = 0
        self.stopped = False
        self.cond = threading.Condition()

    def work(self) -> None:
        while True:
            with self.cond:
                if self.stopped or self.next >= len(self.items):
                    return
                i = self.next
                self.next += 1
                self.active += 1
            try:
                self.results[i] = self.fn(self.items[i])
            except BaseException as e:  # noqa: BLE001 - handed to the caller once all stopped
                with self.cond:
                    self.errors.append((i, e))
                    self.stopped = True
            finally:
                with self.cond:
                    self.active -= 1
                    self.cond.notify_all()

    def over(self) -> bool:
        return self.active == 0 and (self.stopped or self.next >= len(self.items))


_lock = threading.Lock()
_inboxes: list[queue.SimpleQueue[_Batch]] = []


def _serve(inbox: queue.SimpleQueue[_Batch]) -> None:
    while True:
        inbox.get().work()


def _pool(n: int) -> list[queue.SimpleQueue[_Batch]]:
    with _lock:
        while len(_inboxes) < n:
            inbox: queue.SimpleQueue[_Batch] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(inbox,), name=f"ws-write-{len(_inboxes)}",
                             daemon=True).start()
            _inboxes.append(inbox)
        return _inboxes[:n]


def _forget_pool() -> None:
    """In a forked child the workers do not exist: start new ones on first use."""
    global _lock
    _inboxes.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def map_joined(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """`[fn(x) for x in items]` on up to `workers()` threads, results in order. After a failure
    (or an interrupt of the caller) no further item is started; the error of the first failed
    item (or the interrupt) is raised once no call runs any more."""
    todo = list(items)
    n = min(workers(), len(todo))
    if n < 2:
        return [fn(x) for x in todo]
    batch = _Batch(fn, todo)
    interrupted: BaseException | None = None
    try:
        for inbox in _pool(n):
            inbox.put(batch)
    except BaseException as e:  # noqa: BLE001 - waited out below, then raised
        interrupted = e
        batch.stopped = True     # a plain store: a second interrupt cannot land inside it
    while True:
        try:
            with batch.cond:
                while not batch.over():
                    batch.cond.wait(0.1)     # wakes up for signals: Ctrl-C is seen while waiting
            break
        except BaseException as e:  # noqa: BLE001 - a running call is waited for first
            interrupted = interrupted or e
            batch.stopped = True
    if interrupted is not None:
        raise interrupted
    if batch.errors:
        raise min(batch.errors, key=lambda ie: ie[0])[1]
    return batch.results
