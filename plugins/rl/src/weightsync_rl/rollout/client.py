"""The rollout client: prompts in, Samples out, from whichever members of the fleet hold a version
the gate admits. Each engine is driven by the sampler its plugin registers for its adapter
(`weightsync_rl.rollout.Sampler`), so the request and the answer look the same for every engine; a sampling parameter an engine cannot honour is
refused before anything is sent.

    client = RolloutClient(engines=[{"url": "http://e1:8100"},
                                    {"url": "http://e2:8000", "adapter": "vllm"}])
    samples = client.sample(prompts, SamplingParams(n=8, max_new_tokens=16),
                            min_version=step - 1)          # one step of staleness

Requests go to the member with the fewest outstanding requests among those whose last known
version fits. Engines that gate on the server (the reference engine) wait there; for the others
the client reads the version before and after. A sample that spans a swap is regenerated (it is
never reported as one version) unless `mixed="keep"`, which returns it with both versions.

A prompt whose engine answers nothing for `stuck` seconds (frozen, or its member left the
fleet) is cancelled there and sent to another engine (`liveness`); a call whose `cancel` event
is set (its caller went away) is cancelled on the engines and raises `Cancelled`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import requests

from weightsync.config import EngineSpec
from weightsync.errors import EngineError, WeightSyncError
from weightsync.interfaces import Adapter, Fleet, Member
from weightsync.interfaces.sampling import (Gate, NotFitting, Refused, Sample, SamplingParams,
                                            StaleEngines, Unsupported)
from weightsync_rl.rollout.cancel import mount
from weightsync_rl.rollout.liveness import Liveness
from weightsync_rl.rollout.sampler import Sampler, sampler_for

MembersSource = Callable[[], list[Member]]


@dataclass
class _Slot:
    """One member as the client sees it."""

    name: str
    adapter: Adapter
    key: str
    version: int | None = None
    sampler: Sampler | None = None      # None: no installed plugin generates on this engine
    outstanding: int = 0
    down_until: float = 0.0
    last_error: str | None = None
    served: int = field(default=0)
    alive_at: float = 0.0               # the last time it answered anything


class _Moved(Exception):
    """The engine stopped answering while it held the prompt: it goes to another engine."""


class Cancelled(WeightSyncError):
    """The caller of a `sample` went away (its `cancel` event was set); the engines were told."""


class RolloutClient:
    """Spreads generation over a fleet's members. `engines`: a static list (dicts as in a sync
    config's `engines:`); or `fleet`: a Fleet component or a callable returning Members (a
    registry fleet's live members), re-read every `refresh` seconds."""

    @classmethod
    def of(cls, sync: Any, **options: Any) -> RolloutClient:
        """A client over a `WeightSync`'s fleet: its live members, as the pushes see them."""
        return cls(fleet=sync.fleet, adapter=sync.resolved.config.adapter.kind,
                   components=sync.components, **options)

    def __init__(self, engines: Iterable[dict[str, Any] | EngineSpec] | None = None, *,
                 fleet: Fleet | MembersSource | None = None, adapter: str = "reference",
                 staleness: int = 0, refresh: float = 1.0, workers: int = 32,
                 components: Any = None, stuck: float = 10.0) -> None:
        if (engines is None) == (fleet is None):
            raise ValueError("RolloutClient takes either `engines` or `fleet`")
        if engines is not None:
            specs = [e if isinstance(e, EngineSpec) else EngineSpec.model_validate(e) for e in engines]
            if not specs:
                raise ValueError("RolloutClient needs at least one engine")
            static = [Member(s.name or s.url, s) for s in specs]
            self._source: MembersSource = lambda: static
        else:
            assert fleet is not None            # one of the two, checked above
            self._source = fleet.members if isinstance(fleet, Fleet) else fleet
        if components is None:
            from weightsync.plugins import load_components
            components = load_components()
        self.components = components
        self.default_adapter = adapter
        self.staleness = staleness
        self.refresh = refresh
        self._slots: dict[str, _Slot] = {}
        self._read_at = 0.0
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ws-rollout")
        self.refused_mixed = 0                  # samples regenerated because they spanned a swap
        self.liveness = Liveness(stuck, self.slots)
        self.moved = 0                          # prompts moved off an engine that stopped answering

    # -- members --------------------------------------------------------------------------------
    def _adapter(self, m: Member) -> tuple[str, Adapter]:
        ref = m.spec.adapter.kind if m.spec.adapter is not None else self.default_adapter
        cls = self.components.adapters.get(ref)
        options = {**(m.spec.adapter.options if m.spec.adapter else {}), **m.spec.options}
        adapter = cls(cls.Options.model_validate(options), m.spec)
        if isinstance(getattr(adapter, "session", None), requests.Session):
            mount(adapter.session)           # its generations can be cancelled
        return ref, adapter

    def slots(self) -> list[_Slot]:
        """The members now, re-read from the source at most every `refresh` seconds."""
        with self._lock:
            if time.monotonic() - self._read_at < self.refresh and self._slots:
                return list(self._slots.values())
        members = self._source()
        with self._lock:
            seen = {}
            for m in members:
                key = m.spec.model_dump_json()
                old = self._slots.get(m.name)
                if old is not None and old.key == key:
                    seen[m.name] = old
                    continue
                if old is not None:
                    old.adapter.close()
                adapter = self._adapter(m)[1]
                try:
                    sampler: Sampler | None = sampler_for(adapter, self.components)
                except Unsupported:
                    sampler = None
                seen[m.name] = _Slot(m.name, adapter, key, m.version, sampler)
            for name, old in self._slots.items():
                if name not in seen:
                    old.adapter.close()
            self._slots = seen
            self._read_at = time.monotonic()
            return list(seen.values())

    def held(self) -> dict[str, Any]:
        """What each member holds, as far as the client knows (None: unknown or not fitting)."""
        return {s.name: (s.version if s.last_error is None else f"{s.version} ({s.last_error})")
                for s in self.slots()}

    # -- sampling -------------------------------------------------------------------------------
    def sample(self, prompts: list[list[int]], params: SamplingParams | dict[str, Any] | None = None,
               *, min_version: int | None = None, exact_version: int | None = None,
               wait: float = 30.0, mixed: str = "retry", retries: int = 3,
               cancel: threading.Event | None = None) -> list[Sample]:
        """`params.n` Samples per prompt (in prompt order, `prompt_index` set), each from one
        member holding a fitting version: at least `min_version` minus the client's staleness,
        or exactly `exact_version`. Raises StaleEngines (naming what each member holds) when no
        member could serve a prompt within `wait` seconds, Unsupported when a member cannot
        honour a parameter. With a `seed`, prompt j is asked with seed `seed + j * n` (so its
        sample i has `seed + j * n + i`): no two samples of one call share a seed, even for two
        equal prompts, and the call is reproducible as a whole. Setting `cancel` stops the call:
        its generations are cancelled on the engines and it raises Cancelled."""
        if mixed not in ("retry", "keep"):
            raise ValueError(f"mixed={mixed!r}: use 'retry' or 'keep'")
        p = params if isinstance(params, SamplingParams) else SamplingParams.model_validate(params or {})
        if min_version is not None:
            min_version -= self.staleness
        gate = Gate(min_version=min_version, exact_version=exact_version, wait=wait)
        def params_of(j: int) -> SamplingParams:
            return p if p.seed is None else p.model_copy(update={"seed": p.seed + j * p.n})
        futures = [self._pool.submit(self._one, i, list(ids), params_of(i), gate, mixed, retries,
                                     cancel) for i, ids in enumerate(prompts)]
        try:
            return [s for f in futures for s in f.result()]
        except BaseException:
            if cancel is not None:
                cancel.set()                 # the other prompts stop too
            for f in futures:
                f.cancel()
            raise

    def generate(self, input_ids: list[int], max_new_tokens: int, *, min_version: int | None = None,
                 exact_version: int | None = None, wait: float = 30.0) -> dict[str, Any]:
        """Greedy tokens of one prompt (the short form): output_ids, logprobs, weight_version,
        engine, finish_reason."""
        s = self.sample([input_ids], SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                        min_version=min_version, exact_version=exact_version, wait=wait)[0]
        return {"output_ids": s.token_ids, "logprobs": s.logprobs, "weight_version": s.version,
                "engine": s.engine, "finish_reason": s.finish_reason}

    def _pick(self, gate: Gate, tried: set[str]) -> _Slot | None:
        now = time.monotonic()
        slots = [s for s in self.slots() if s.down_until <= now and s.name not in tried]
        if not slots:
            return None
        fitting = [s for s in slots if s.version is None or gate.fits(s.version)
                   or (s.sampler is not None and s.sampler.gates)]
        pool = fitting or slots
        with self._lock:
            best = min(pool, key=lambda s: (s.outstanding, s.served))
            best.outstanding += 1
        return best

    def _one(self, index: int, ids: list[int], p: SamplingParams, gate: Gate, mixed: str,
             retries: int, cancel: threading.Event | None = None) -> list[Sample]:
        deadline = time.monotonic() + gate.wait
        tried: set[str] = set()
        mixed_left = retries
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"prompt {index}: the caller went away")
            slot = self._pick(gate, tried)
            if slot is None:
                if time.monotonic() >= deadline:
                    held = self.held()
                    raise StaleEngines(f"no member could serve {gate.describe()} within "
                                       f"{gate.wait:g}s; they hold {held}", held)
                tried.clear()
                time.sleep(0.05)
                continue
            try:
                sampler = slot.sampler
                if sampler is None:
                    raise Unsupported(f"{slot.name} ({slot.adapter.name}) cannot generate: no "
                                      f"installed plugin registers a sampler for adapter "
                                      f"{slot.adapter.name!r}")
                missing = p.asked() - sampler.sampling
                if missing:
                    raise Unsupported(f"{slot.name} ({slot.adapter.name}) cannot honour "
                                      f"{sorted(missing)}; it honours {sorted(sampler.sampling)}")
                left = max(0.0, deadline - time.monotonic())
                out = self._generate(slot, sampler, ids, p, gate.model_copy(update={"wait": left}),
                                     cancel)
            except _Moved as e:
                self.moved += 1
                slot.last_error = str(e)[:200]
                slot.down_until = time.monotonic() + self.liveness.stuck
                tried.add(slot.name)
                continue
            except NotFitting as e:
                slot.version = e.held        # a fitting version refused says why (its probe)
                slot.last_error = str(e)[:300] if gate.fits(e.held) else None
                tried.add(slot.name)
                continue
            except Unsupported:
                raise
            except EngineError as e:
                if e.status is not None and 400 <= e.status < 500 and e.status not in (408, 409, 429):
                    # the request's fault (a token id outside the vocabulary): the same request
                    # fails on every engine, and this one is not down
                    raise Refused(f"{slot.name} refused the request: {e.detail}") from None
                slot.last_error = str(e)[:200]
                slot.down_until = time.monotonic() + 1.0
                tried.add(slot.name)
                continue
            except (WeightSyncError, OSError) as e:
                slot.last_error = str(e)[:200]
                slot.down_until = time.monotonic() + 1.0
                tried.add(slot.name)
                continue
            finally:
                with self._lock:
                    slot.outstanding -= 1
            slot.version, slot.last_error = out[-1].version_end if out else slot.version, None
            slot.served += 1
            if mixed == "retry" and any(s.mixed for s in out):
                self.refused_mixed += 1
                mixed_left -= 1
                if mixed_left < 0:
                    raise StaleEngines(f"every sample of prompt {index} spanned a weight swap "
                                       f"({retries + 1} tries); ask with mixed='keep' to take them")
                continue
            for s in out:
                s.prompt_index = index
            return out

    def _generate(self, slot: _Slot, sampler: Sampler, ids: list[int], p: SamplingParams,
                  gate: Gate, cancel: threading.Event | None) -> list[Sample]:
        """One generation on `slot`, cancellable: by the liveness watcher (the engine stopped
        answering: `_Moved`) or by `cancel` (`Cancelled`)."""
        scope = self.liveness.begin(slot, cancel)
        answered = False
        try:
            with scope.active():
                out = sampler.generate(ids, p, gate)
            answered = True
            return out
        except (WeightSyncError, OSError) as e:
            answered = isinstance(e, NotFitting) or getattr(e, "status", None) is not None
            if scope.why == "cancelled":
                raise Cancelled("the caller went away; its generation was cancelled on "
                                "the engine") from None
            if scope.why not in (None, "done"):
                raise _Moved(str(scope.why)) from None
            raise
        finally:
            self.liveness.end(slot, scope, answered)

    def close(self) -> None:
        self.liveness.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for s in self._slots.values():
            s.adapter.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
