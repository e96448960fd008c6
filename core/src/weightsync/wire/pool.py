"""One shared pool of worker threads for per-tensor work that releases the GIL (hashing, compares,
copies). `map_threads` runs inline on the pool's own threads: a nested call never waits on it."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

__all__ = ["R", "T", "map_threads", "workers"]

T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_inside = threading.local()


def workers() -> int:
    """WEIGHTSYNC_THREADS, else the CPUs this process may run on."""
    env = os.environ.get("WEIGHTSYNC_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                          # not Linux
        return max(1, os.cpu_count() or 1)


def _mark() -> None:
    _inside.worker = True


def _get() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="ws-work",
                                       initializer=_mark)
        return _pool


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: start a new pool on first use."""
    global _pool, _lock
    _pool = None
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def map_threads(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """`[fn(x) for x in items]`, spread over the pool; results in order, first error raised."""
    items = list(items)
    if len(items) < 2 or workers() < 2 or getattr(_inside, "worker", False):
        return [fn(x) for x in items]
    return list(_get().map(fn, items))
