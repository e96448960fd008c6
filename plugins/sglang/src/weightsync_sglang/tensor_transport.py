"""Transport `sglang_tensor`: colocated trainer and SGLang server, through SGLang's own
`/update_weights_from_tensor` route.

Each payload's data section is already SGLang's flattened_bucket (layout.py); it is handed over as
a shared tensor (CPU: shared memory by file name; CUDA: a CUDA-IPC handle), pickled in SGLang's
MultiprocessingSerializer format once per TP rank (pickling.py). Only the handles cross the HTTP
call; SGLang maps the memory and copies the weights in. The sender keeps the payload alive until
SGLang answered, which `send` does by being synchronous. Same host only; requires an adapter
that can post SGLang's tensor route (`LoadsSGLangTensors`, which only the `sglang` adapter
implements), so the config check refuses this transport with any other engine.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Protocol, runtime_checkable

from weightsync.interfaces import Adapter, Payload, Transport

from .layout import flat_bucket
from .pickling import flattened_bucket_object, serialize


@runtime_checkable
class LoadsSGLangTensors(Protocol):
    """The capability this transport requires: the adapter posts one flattened bucket, shared as
    tensor handles, to SGLang's `/update_weights_from_tensor` (`SGLangAdapter` implements it)."""

    def group_size(self) -> int:
        """The server's TP ranks: one serialized entry each."""

    def update_from_tensor(self, serialized: list[str], header: Mapping[str, Any]) -> None:
        """Post the serialized entries of the payload `header` describes; returns once SGLang
        loaded them (it acknowledges the bucket for `end`)."""


class SGLangTensorTransport(Transport):
    name = "sglang_tensor"
    requires = (LoadsSGLangTensors,)
    same_host = True
    receiver = None     # SGLang receives by itself

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._pool: ThreadPoolExecutor | None = None

    _share_lock = threading.Lock()   # moving a storage into shared memory is not thread-safe

    @classmethod
    def serialized_for(cls, payload: Payload, tp_size: int) -> list[str]:
        """One MultiprocessingSerializer string per TP rank (SGLang indexes them by tp_rank). One
        dump per rank, as SGLang's own clients do: each dump takes one reference on the shared
        memory and each rank's load gives one back. The first dump moves the body into shared
        memory, so nothing may read the body meanwhile: callers serialize before fanning out."""
        with cls._share_lock:
            fb = flat_bucket(payload.body)
            return [serialize(flattened_bucket_object(fb.data, fb.entries)) for _ in range(tp_size)]

    def send(self, payload: Payload, engines: Sequence[Adapter]) -> dict[str, BaseException]:
        fails: dict[str, BaseException] = {}
        entries: dict[str, list[str]] = {}
        for a in engines:                 # here, on one thread: see serialized_for
            try:
                entries[a.engine_name] = self.serialized_for(payload, _loader(a).group_size())
            except Exception as e:  # noqa: BLE001 - reported per engine
                fails[a.engine_name] = e
        todo = [a for a in engines if a.engine_name in entries]

        def post(a: Adapter) -> None:
            _loader(a).update_from_tensor(entries[a.engine_name], payload.header())
        if len(todo) <= 1:
            for a in todo:
                try:
                    post(a)
                except Exception as e:  # noqa: BLE001
                    fails[a.engine_name] = e
            return fails
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ws-sglang-tensor")
        futures = {a.engine_name: self._pool.submit(post, a) for a in todo}
        for name, f in futures.items():
            if f.exception() is not None:
                fails[name] = f.exception()   # type: ignore[assignment]
        return fails

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _loader(a: Adapter) -> LoadsSGLangTensors:
    if not isinstance(a, LoadsSGLangTensors):   # the config check refuses such an adapter first
        raise TypeError(f"adapter {a.name!r} cannot post SGLang tensor payloads "
                        f"(transport 'sglang_tensor' requires LoadsSGLangTensors)")
    return a
